"""A prefill and a decode process move random requests between reference-style pools over UCX
(host memory); every moved page, the aux slots and every untouched page are checked."""

from __future__ import annotations

import multiprocessing as mp

import pytest

import kvt  # noqa: F401 - fail early when the package does not import

PLAN = [
    {"room": "one-token", "pages": 1, "mode": "whole"},
    {"room": "few", "pages": 3, "mode": "layerwise"},
    {"room": "many", "pages": 17, "mode": "whole", "aux": 2},
    {"room": "more", "pages": 24, "mode": "layerwise", "aux": 5},
    {"room": "chunked", "pages": 6, "mode": "whole", "chunked": True},
    {"room": "chunked-closed", "pages": 4, "mode": "layerwise",
     "chunked": "closed by an empty send"},
    {"room": "half-layers", "pages": 5, "mode": "layerwise", "layers": (1, 3)},
]


def _run(cfg: dict) -> tuple[dict, dict]:
    ctx = mp.get_context("spawn")
    port_q, back_q, prefill_q, decode_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    import transfer_worker

    prefill = ctx.Process(target=transfer_worker.prefill_main, args=(cfg, PLAN, port_q, prefill_q))
    prefill.start()
    decode = None
    try:
        # The prefill process puts its port; hand it to the decode process.
        port = port_q.get(timeout=60)
        decode = ctx.Process(target=transfer_worker.decode_main,
                             args=(cfg, PLAN, back_q, decode_q))
        back_q.put(port)
        decode.start()
        d_status, d = decode_q.get(timeout=90)
        assert d_status == "ok", d
        port_q.put("done")
        p_status, p = prefill_q.get(timeout=30)
        assert p_status == "ok", p
        return p, d
    finally:
        for proc in (decode, prefill):
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


# torch pools when torch imports (numpy otherwise), and one numpy pool either way.
@pytest.mark.parametrize("dtype, use_torch", [("bf16", True), ("fp8_e4m3", True),
                                              ("bf16", False)])
def test_two_processes_move_random_requests(dtype: str, use_torch: bool) -> None:
    cfg = {"size": 64 * 16, "page_size": 16, "head_num": 2, "head_dim": 64, "layer_num": 4,
           "dtype": dtype, "aux_slots": 8, "aux_bytes": 96, "use_torch": use_torch}
    prefill, decode = _run(cfg)
    assert decode["errors"] == [], decode["errors"]
    success = int(kvt.KVPoll.Success)
    assert decode["states"] == {item["room"]: success for item in PLAN}
    assert prefill["states"] == {item["room"]: success for item in PLAN}, prefill["failures"]
    assert decode["checked_pages"] == sum(item["pages"] for item in PLAN)
    assert decode["stats"]["requests_succeeded"] == len(PLAN)
    assert prefill["stats"]["bytes"] > 0
