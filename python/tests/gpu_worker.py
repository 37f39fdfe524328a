"""The prefill and decode processes of test_gpu.py: CUDA pools laid out like the reference pool
(per-layer K and V tensors of [size + page_size, head_num, head_dim] on cuda:0, page 0 the zero
dummy page), spawned, results back on queues.

Page bytes are drawn on the GPU from a generator seeded by (room, buffer), so both processes
derive the same bytes without shipping them. The prefill side writes a room's pages as a fake
forward on a side stream: per layer a delay kernel (so that a copy which did not wait for the
layer's event would read the old bytes), the layer's K and V pages, an event, then
layers_ready(room, layer + 1, event).
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import kvt

# kvt dtype -> torch storage dtype name (fp8 pools store uint8, as the reference pool does).
_STORE = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "uint8"}


class GpuPool:
    """layer_num K and V CUDA tensors; page p of a buffer is token rows [p*page_size, (p+1)*page_size)."""

    def __init__(self, torch: Any, size: int, page_size: int, head_num: int, head_dim: int,
                 layer_num: int, dtype: str):
        self.torch = torch
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        shape = (size + page_size, head_num, head_dim)
        store = getattr(torch, _STORE[dtype])
        self.k_buffer = [torch.zeros(shape, dtype=store, device="cuda:0") for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=store, device="cuda:0") for _ in range(layer_num)]
        self.num_pages = (size + page_size) // page_size

    def buffers(self) -> list:
        return self.k_buffer + self.v_buffer

    def page_view(self, buffer: int) -> Any:
        """Buffer `buffer` as a [num_pages, page_bytes] uint8 CUDA view (shares memory)."""
        return self.buffers()[buffer].view(self.torch.uint8).view(self.num_pages, -1)

    @property
    def page_bytes(self) -> int:
        return self.page_view(0).shape[1]

    def layout(self, how: str) -> kvt.TransferLayout:
        dtype = self.dtype if self.dtype.startswith("fp8") else None
        if how == "tensors":
            return kvt.TransferLayout.from_tensors(self.k_buffer, self.v_buffer,
                                                   page_size=self.page_size, dtype=dtype)
        bufs = self.buffers()
        return kvt.TransferLayout.from_buf_infos(
            [b.data_ptr() for b in bufs], [b.numel() * b.element_size() for b in bufs],
            [b[0].numel() * b.element_size() * self.page_size for b in bufs],
            page_size=self.page_size, dtype=self.dtype, head_num=self.head_num,
            head_dim=self.head_dim, device=0,
            unit_lens=[b[0, 0].numel() * b.element_size() for b in bufs])


def _log(side: str, what: str) -> None:
    """Progress on stderr: a failing test's report shows how far each process got."""
    print(f"[{side}] {what}", file=sys.stderr, flush=True)


def room_bytes(torch: Any, room: str, buffer: int, num_pages: int, page_bytes: int) -> Any:
    """The bytes of a room's pages of one buffer, [num_pages, page_bytes] uint8 on cuda:0."""
    seed = (sum(ord(c) * 131 ** i for i, c in enumerate(room)) * 1000003 + buffer) % (2 ** 62)
    gen = torch.Generator(device="cuda:0")
    gen.manual_seed(seed)
    return torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, device="cuda:0",
                         generator=gen)


def _pick(torch: Any, seed: int, num_pages: int) -> list[int]:
    """Every page but the dummy page 0, in a random order."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    return [int(p) + 1 for p in torch.randperm(num_pages - 1, generator=gen)]


def prefill_main(cfg: dict, plan: list[dict], port_q, result_q) -> None:
    listening = False
    try:
        import torch

        pool = GpuPool(torch, **cfg["pool"])
        engine = kvt.TransferEngine("prefill", pool.layout(cfg["layout"]), name="gpu-prefill",
                                    backend=cfg["backend"], deadline=20)
        _log("prefill", f"engine up on port {engine.port}, backend {engine.backend}")
        port_q.put(engine.port)
        listening = True
        free = _pick(torch, 11, pool.num_pages)
        stream = torch.cuda.Stream()
        sleep = getattr(torch.cuda, "_sleep", None)  # a delay kernel (cycles)
        requests, events = [], []
        for item in plan:
            room, n = item["room"], item["pages"]
            pages = [free.pop() for _ in range(n)]
            index = torch.tensor(pages, dtype=torch.int64, device="cuda:0")
            request = engine.send(room, pages)
            with torch.cuda.stream(stream):
                for layer in range(pool.layer_num):
                    if sleep is not None:
                        sleep(2_000_000)  # ~1 ms: the copy must wait for the event, not race it
                    for b in (layer, pool.layer_num + layer):
                        pool.page_view(b).index_copy_(
                            0, index, room_bytes(torch, room, b, n, pool.page_bytes))
                    if item["mode"] == "layerwise":
                        event = torch.cuda.Event()
                        event.record(stream)
                        events.append(event)  # alive until the copy waited for it
                        engine.layers_ready(room, layer + 1, event=event)
            if item["mode"] == "whole":
                stream.synchronize()  # no event: the bytes are written when the call is made
                engine.layers_ready(room, pool.layer_num)
            requests.append(request)
            _log("prefill", f"room {room}: {n} pages sent, {item['mode']}")
        states = {r.room: int(r.wait(40)) for r in requests}
        _log("prefill", f"states {states}")
        failures = {r.room: str(r.failure_exception()) for r in requests
                    if r.poll() != kvt.KVPoll.Success}
        result_q.put(("ok", {"states": states, "failures": failures, "stats": engine.stats(),
                             "backend": engine.backend}))
        port_q.get(timeout=60)  # stay up until the decode side has checked its pool
        engine.close()
    except BaseException:  # noqa: BLE001 - report everything to the test
        result_q.put(("error", traceback.format_exc()))
        if not listening:  # the test waits for the port: tell it instead
            port_q.put(("error", traceback.format_exc()))


def decode_main(cfg: dict, plan: list[dict], port_q, result_q) -> None:
    try:
        import torch

        pool = GpuPool(torch, **cfg["pool"])
        num_buffers = 2 * pool.layer_num
        # Every page but the dummy page 0 starts with known bytes, to see untouched pages stay.
        initial = [room_bytes(torch, "initial", b, pool.num_pages, pool.page_bytes)
                   for b in range(num_buffers)]
        for b in range(num_buffers):
            pool.page_view(b)[1:] = initial[b][1:]
        torch.cuda.synchronize()
        engine = kvt.TransferEngine("decode", pool.layout(cfg["layout"]), name="gpu-decode",
                                    backend=cfg["backend"], deadline=20)
        peer = engine.connect("127.0.0.1", port_q.get(timeout=60))
        _log("decode", f"connected, backend {engine.backend}")
        free = _pick(torch, 22, pool.num_pages)
        requests, placed = [], []
        for item in plan:
            pages = [free.pop() for _ in range(item["pages"])]
            placed.append(pages)
            requests.append(engine.receive(item["room"], peer, pages))
        states = {r.room: int(r.wait(40)) for r in requests}
        _log("decode", f"states {states}")
        errors = []
        checked = 0
        for item, pages, request in zip(plan, placed, requests):
            room = item["room"]
            info = request.info()
            if info.state != kvt.KVPoll.Success:
                errors.append(f"{room}: {info.state.name} {info.reason}")
                continue
            index = torch.tensor(pages, dtype=torch.int64, device="cuda:0")
            for b in range(num_buffers):
                want = room_bytes(torch, room, b, len(pages), pool.page_bytes)
                got = pool.page_view(b).index_select(0, index)
                for i in range(len(pages)):  # every moved page on its own
                    checked += 1
                    if not torch.equal(got[i], want[i]):
                        errors.append(f"{room}: buffer {b} page {pages[i]} (#{i}) differs")
        used = {p for pages in placed for p in pages}
        untouched = torch.tensor([p for p in range(1, pool.num_pages) if p not in used],
                                 dtype=torch.int64, device="cuda:0")
        for b in range(num_buffers):
            view = pool.page_view(b)
            if not torch.equal(view.index_select(0, untouched), initial[b].index_select(0, untouched)):
                errors.append(f"buffer {b}: an untouched page changed")
            if bool(view[0].any()):
                errors.append(f"buffer {b}: the dummy page 0 was written")
        result_q.put(("ok", {"states": states, "errors": errors, "stats": engine.stats(),
                             "checked_pages": checked, "untouched_pages": int(untouched.numel()),
                             "backend": engine.backend}))
        engine.close()
    except BaseException:  # noqa: BLE001
        result_q.put(("error", traceback.format_exc()))
