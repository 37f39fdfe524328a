"""A KV pool laid out like the reference pool (per-layer K and V tensors of
[size + page_size, head_num, head_dim], page 0 the zero dummy page), with its buffer infos.

torch tensors when torch is importable, numpy arrays otherwise (numpy has no bf16: bf16 pools
are then stored as uint16 and fp8 pools, as in the reference, as uint8).
"""

from __future__ import annotations

import numpy as np

try:
    import torch
except ImportError:  # the tests run on numpy alone
    torch = None

# kvt dtype name -> (torch storage dtype name, numpy storage dtype)
_STORE = {
    "bf16": ("bfloat16", np.uint16),
    "fp16": ("float16", np.float16),
    "fp8_e4m3": ("uint8", np.uint8),  # fp8 pools store uint8 (store_dtype != dtype)
}


class ReferencePool:
    """MHA pool: layer_num K and V buffers, page p of a buffer = token rows
    [p * page_size, (p + 1) * page_size)."""

    def __init__(self, size: int, page_size: int, head_num: int, head_dim: int, layer_num: int,
                 dtype: str = "bf16", aux_slots: int = 0, aux_bytes: int = 64,
                 use_torch: bool = True):
        self.size, self.page_size = size, page_size
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, layer_num
        self.dtype = dtype
        self.torch = use_torch and torch is not None
        shape = (size + page_size, head_num, head_dim)
        if self.torch:
            store = getattr(torch, _STORE[dtype][0])
            self.k_buffer = [torch.zeros(shape, dtype=store) for _ in range(layer_num)]
            self.v_buffer = [torch.zeros(shape, dtype=store) for _ in range(layer_num)]
            self.aux = [torch.zeros((aux_slots, aux_bytes), dtype=torch.uint8)] if aux_slots else []
        else:
            store = _STORE[dtype][1]
            self.k_buffer = [np.zeros(shape, dtype=store) for _ in range(layer_num)]
            self.v_buffer = [np.zeros(shape, dtype=store) for _ in range(layer_num)]
            self.aux = [np.zeros((aux_slots, aux_bytes), dtype=np.uint8)] if aux_slots else []

    @property
    def num_pages(self) -> int:
        return (self.size + self.page_size) // self.page_size

    def buffers(self) -> list:
        """K of layers 0..L-1, then V (the buffer-info order)."""
        return self.k_buffer + self.v_buffer

    def _nbytes(self, t) -> int:
        return t.numel() * t.element_size() if self.torch else t.nbytes

    def _ptr(self, t) -> int:
        return t.data_ptr() if self.torch else t.ctypes.data

    def get_contiguous_buf_infos(self):
        """As the reference: (kv_data_ptrs, kv_data_lens, kv_item_lens)."""
        bufs = self.buffers()
        ptrs = [self._ptr(b) for b in bufs]
        lens = [self._nbytes(b) for b in bufs]
        item_lens = [self._nbytes(b[0]) * self.page_size for b in bufs]
        return ptrs, lens, item_lens

    def get_contiguous_buf_unit_lens(self):
        return [self._nbytes(b[0, 0]) for b in self.buffers()]

    def aux_infos(self):
        return ([self._ptr(a) for a in self.aux], [self._nbytes(a) for a in self.aux],
                [self._nbytes(a[0]) for a in self.aux])

    def page_view(self, buffer: int) -> np.ndarray:
        """Buffer `buffer` as a [num_pages, page_bytes] uint8 numpy view (shares memory)."""
        b = self.buffers()[buffer]
        flat = b.view(torch.uint8).numpy() if self.torch else b.view(np.uint8)
        return flat.reshape(self.num_pages, -1)

    def aux_view(self, i: int = 0) -> np.ndarray:
        a = self.aux[i]
        return a.numpy() if self.torch else a

    def equal_pages(self, buffer: int, pages, expected: np.ndarray) -> bool:
        """The pages' bytes equal `expected` (torch.equal on torch pools)."""
        got = self.page_view(buffer)[np.asarray(pages)]
        if self.torch:
            return torch.equal(torch.from_numpy(got), torch.from_numpy(expected))
        return np.array_equal(got, expected)


def page_bytes_for(room: str, buffer: int, num_pages: int, page_bytes: int) -> np.ndarray:
    """Deterministic random bytes of a room's pages of one buffer (both processes derive them)."""
    seed = (sum(ord(c) * 131 ** i for i, c in enumerate(room)) * 1000003 + buffer) % (2 ** 32)
    return np.random.default_rng(seed).integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)
