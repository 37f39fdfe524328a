"""A KV pool laid out like the reference pool (tokenspeed's MHATokenToKVPool): per layer a K and
a V tensor of [size + page_size, head_num, head_dim], page p at rows [p * page_size, (p + 1) *
page_size), page 0 a dummy page never handed out. torch tensors when torch imports (on the CPU,
or CUDA with device="cuda"), numpy arrays otherwise. Plus an aux buffer: one slot per request
for the first output token, as SGLang's aux_data does."""

from __future__ import annotations

import zlib

import numpy as np

try:
    import torch
except ImportError:  # numpy pools then
    torch = None

AUX_SLOT_BYTES = 64  # first output token (int32) and room for more metadata


class Pool:
    def __init__(self, layers: int = 4, pages: int = 128, page_size: int = 16, head_num: int = 8,
                 head_dim: int = 64, device: str = "cpu", aux_slots: int = 16):
        self.layers, self.pages, self.page_size = layers, pages, page_size
        self.head_num, self.head_dim = head_num, head_dim
        shape = (pages * page_size + page_size, head_num, head_dim)
        if torch is not None:
            make = lambda: torch.zeros(shape, dtype=torch.bfloat16, device=device)  # noqa: E731
        elif device != "cpu":
            raise SystemExit(f"device={device} needs torch; install python3-torch")
        else:
            make = lambda: np.zeros(shape, dtype=np.float16)  # noqa: E731
        self.k = [make() for _ in range(layers)]
        self.v = [make() for _ in range(layers)]
        self.aux = np.zeros((aux_slots, AUX_SLOT_BYTES), dtype=np.uint8)
        self.free = list(range(pages - 1, 0, -1))  # page 0 is the dummy page
        self.free_slots = list(range(aux_slots - 1, -1, -1))

    # The reference pool's buffer infos: K of layers 0..L-1, then V of layers 0..L-1.
    def buffers(self) -> list:
        return self.k + self.v

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        ptrs = [_ptr(b) for b in self.buffers()]
        lens = [_nbytes(b) for b in self.buffers()]
        item_lens = [n // (self.pages + 1) for n in lens]  # bytes of one page
        return ptrs, lens, item_lens

    def get_contiguous_buf_unit_lens(self) -> list[int]:
        return [self.head_dim * 2] * len(self.buffers())  # head_dim x 2-byte elements

    def page_bytes(self, buffer: int) -> np.ndarray:
        """Buffer `buffer` as [pages + 1, page bytes] uint8 (host copy for CUDA tensors)."""
        b = self.buffers()[buffer]
        flat = b.view(torch.uint8).cpu().numpy() if torch is not None else b.view(np.uint8)
        return flat.reshape(self.pages + 1, -1)

    def write_pages(self, buffer: int, pages: list[int], data: np.ndarray) -> None:
        b = self.buffers()[buffer]
        rows = np.concatenate([np.arange(p * self.page_size, (p + 1) * self.page_size)
                               for p in pages])
        if torch is not None:
            src = torch.from_numpy(data).view(torch.bfloat16).reshape(
                len(rows), self.head_num, self.head_dim).to(b.device)
            b[torch.from_numpy(rows).to(b.device)] = src
        else:
            b[rows] = data.view(np.float16).reshape(len(rows), self.head_num, self.head_dim)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"{n} pages asked, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)


def layer_bytes(room: str, buffer: int, n_pages: int, page_bytes: int) -> np.ndarray:
    """What the fake forward writes into a request's pages of one buffer: bytes both processes
    derive from the room and the buffer, so the decode side can check every one."""
    seed = zlib.crc32(f"{room}/{buffer}".encode())
    return np.random.default_rng(seed).integers(0, 256, n_pages * page_bytes, dtype=np.uint8)


def first_token(room: str) -> int:
    return zlib.crc32(room.encode()) % 128000


def _ptr(b) -> int:
    return b.data_ptr() if torch is not None else b.ctypes.data


def _nbytes(b) -> int:
    return b.numel() * b.element_size() if torch is not None else b.nbytes
