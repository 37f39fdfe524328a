"""The target process of test_compat_mooncake.py: an engine whose registered host buffers a peer
writes into. Commands arrive on a queue; answers go back on another (spawned process)."""

from __future__ import annotations

import traceback

import numpy as np

from kvt.compat.mooncake import TransferEngine

FILL = 0xEE  # what untouched bytes hold


class _Buffers:
    """Host (numpy) or CUDA (torch, cuda:0) byte buffers filled with FILL."""

    def __init__(self, device: str):
        self.device = device

    def make(self, n: int):
        if self.device == "cuda":
            import torch

            return torch.full((n,), FILL, dtype=torch.uint8, device="cuda")
        return np.full(n, FILL, dtype=np.uint8)

    def ptr(self, b) -> int:
        return b.data_ptr() if self.device == "cuda" else b.ctypes.data

    def nbytes(self, b) -> int:
        return b.numel() if self.device == "cuda" else b.nbytes

    def copy(self, b) -> np.ndarray:
        return b.cpu().numpy() if self.device == "cuda" else b.copy()


def target_main(sizes: list[int], options: dict, commands, answers, device: str = "host"
                ) -> None:
    """Registers one buffer per size (host memory, or CUDA memory with device="cuda"),
    answers ("ready", session id, pointers), then serves ("dump",) -> the buffers' bytes,
    ("register", sizes) -> new pointers, ("deregister", ptr) -> the call's result, ("exit",)."""
    try:
        engine = TransferEngine("127.0.0.1", raise_errors=True, **options)
        mem = _Buffers(device)
        buffers = [mem.make(n) for n in sizes]
        for b in buffers:
            engine.register(mem.ptr(b), mem.nbytes(b))
        answers.put(("ready", engine.get_session_id(), [mem.ptr(b) for b in buffers]))
        while True:
            command = commands.get(timeout=120)
            if command[0] == "dump":
                answers.put(("ok", [mem.copy(b) for b in buffers]))
            elif command[0] == "register":
                more = [mem.make(n) for n in command[1]]
                for b in more:
                    engine.register(mem.ptr(b), mem.nbytes(b))
                buffers.extend(more)
                answers.put(("ok", [mem.ptr(b) for b in more]))
            elif command[0] == "deregister":
                answers.put(("ok", engine.deregister(command[1])))
            else:
                engine.close()
                answers.put(("ok", None))
                return
    except BaseException:  # the test reads the trace instead of waiting for its timeout
        answers.put(("error", traceback.format_exc()))
