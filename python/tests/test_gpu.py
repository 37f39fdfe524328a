"""CUDA pools in a prefill and a decode process: random requests (one token to many pages,
layer by layer with a torch.cuda.Event per layer, and whole) over cuda_ipc and over UCX's
staged CUDA path; every moved page is compared with torch.equal, and every untouched page and
the dummy page 0 are checked unchanged.

Skips (with the reason) without torch or without a CUDA device: it runs on a GPU machine.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

import kvt

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU tests need it")
if not torch.cuda.is_available():
    pytest.skip("torch.cuda.is_available() is False: the GPU tests need a CUDA device",
                allow_module_level=True)

PLAN = [
    {"room": "one-token", "pages": 1, "mode": "layerwise"},
    {"room": "two", "pages": 2, "mode": "whole"},
    {"room": "seven", "pages": 7, "mode": "layerwise"},
    {"room": "thirty-three", "pages": 33, "mode": "whole"},
    {"room": "many", "pages": 150, "mode": "layerwise"},
    {"room": "many-whole", "pages": 120, "mode": "whole"},
]


def _run(cfg: dict) -> tuple[dict, dict]:
    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    port_q, back_q, prefill_q, decode_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    import gpu_worker

    prefill = ctx.Process(target=gpu_worker.prefill_main, args=(cfg, PLAN, port_q, prefill_q))
    prefill.start()
    decode = None
    try:
        port = port_q.get(timeout=60)
        assert isinstance(port, int), port[1]  # the prefill process failed before it listened
        decode = ctx.Process(target=gpu_worker.decode_main, args=(cfg, PLAN, back_q, decode_q))
        back_q.put(port)
        decode.start()
        d_status, d = decode_q.get(timeout=100)
        assert d_status == "ok", d
        port_q.put("done")
        p_status, p = prefill_q.get(timeout=30)
        assert p_status == "ok", p
        return p, d
    finally:
        for proc in (decode, prefill):
            if proc is not None:
                proc.join(20)
                if proc.is_alive():
                    proc.kill()


@pytest.mark.parametrize("backend, dtype, layout", [
    ("cuda_ipc", "bf16", "tensors"),
    ("cuda_ipc", "fp8_e4m3", "buf_infos"),
    ("ucx", "bf16", "tensors"),
])
def test_cuda_pools_in_two_processes(backend: str, dtype: str, layout: str) -> None:
    if backend not in kvt.backend_names():
        pytest.skip(f"this build of kvt has no {backend!r} backend ({kvt.backend_names()})")
    cfg = {"backend": backend, "layout": layout,
           "pool": {"size": 384 * 16, "page_size": 16, "head_num": 8, "head_dim": 128,
                    "layer_num": 4, "dtype": dtype}}
    prefill, decode = _run(cfg)
    assert decode["backend"] == prefill["backend"] == backend
    assert decode["errors"] == [], decode["errors"][:20]
    success = int(kvt.KVPoll.Success)
    assert decode["states"] == {item["room"]: success for item in PLAN}
    assert prefill["states"] == {item["room"]: success for item in PLAN}, prefill["failures"]
    moved = sum(item["pages"] for item in PLAN)
    assert decode["checked_pages"] == moved * 2 * cfg["pool"]["layer_num"]
    assert decode["untouched_pages"] == 384 - moved
    assert decode["stats"]["requests_succeeded"] == len(PLAN)
    page_bytes = 16 * 8 * 128 * (1 if dtype.startswith("fp8") else 2)
    assert prefill["stats"]["bytes"] == moved * 2 * cfg["pool"]["layer_num"] * page_bytes
