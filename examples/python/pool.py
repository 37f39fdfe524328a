"""The example engine's KV pool, laid out like the reference pool (tokenspeed's
MHATokenToKVPool), and the bytes its fake forward writes.

Per layer a K and a V tensor of [size + page_size, head_num, head_dim] bf16; page p is token rows
[p * page_size, (p + 1) * page_size) and page 0 is the dummy page, never handed out. torch
tensors when torch imports (on the CPU, or on a GPU with device "cuda" / "cuda:N"), numpy
arrays otherwise (numpy has no bf16: the elements are stored as uint16, the same two bytes).
Plus an aux buffer in host memory: one 64-byte slot per request for the first output token, as
SGLang's aux_data does."""

from __future__ import annotations

import zlib
from typing import Any, Optional

import numpy as np

import kvt

try:
    import torch
except ImportError:  # numpy pools then
    torch = None

AUX_SLOT_BYTES = 64  # the first output token (int32) and room for more per-request metadata


def check_device(device: str) -> Optional[str]:
    """None when ``device`` ("cpu", "cuda" or "cuda:N") can hold a pool here, else what is
    wrong and what to do."""
    if device == "cpu":
        return None
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        return f"--device {device}: expected cpu, cuda or cuda:N"
    if torch is None:
        return f"--device {device} needs torch with CUDA (pip install torch); or use --device cpu"
    if not torch.cuda.is_available():
        return (f"--device {device}: torch {torch.__version__} sees no CUDA device; use "
                "--device cpu")
    ordinal = int(device[5:]) if ":" in device else 0
    if ordinal >= torch.cuda.device_count():
        return (f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                f"0..{torch.cuda.device_count() - 1}")
    return None


class Pool:
    """The reference pool's layout plus a free-page list and a free aux-slot list. Not
    thread-safe: each process of the example uses its pool from one thread."""

    def __init__(self, size: int = 2048, page_size: int = 16, head_num: int = 8,
                 head_dim: int = 64, layer_num: int = 4, aux_slots: int = 16,
                 device: str = "cpu"):
        error = check_device(device)
        if error:
            raise ValueError(error)
        if size % page_size:
            raise ValueError(f"size = {size} tokens is not a multiple of page_size = "
                             f"{page_size}; round it to whole pages")
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim = head_num, head_dim
        self.device = device
        self.num_pages = size // page_size + 1  # page 0 included
        shape = (size + page_size, head_num, head_dim)
        if torch is not None:
            def make() -> Any:
                return torch.zeros(shape, dtype=torch.bfloat16, device=device)
        else:
            def make() -> Any:
                return np.zeros(shape, dtype=np.uint16)  # bf16 bits
        self.k_buffer = [make() for _ in range(layer_num)]
        self.v_buffer = [make() for _ in range(layer_num)]
        self.aux = np.zeros((aux_slots, AUX_SLOT_BYTES), dtype=np.uint8)  # host memory
        self.free_pages = list(range(self.num_pages - 1, 0, -1))  # never page 0
        self.free_slots = list(range(aux_slots - 1, -1, -1))

    # ---- what the reference pool offers a transfer backend ---------------------------------
    def buffers(self) -> list[Any]:
        """K of layers 0..L-1, then V of layers 0..L-1: the buffer-info order."""
        return self.k_buffer + self.v_buffer

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(kv_data_ptrs, kv_data_lens, kv_item_lens); an item is one page of one buffer."""
        bufs = self.buffers()
        return ([_ptr(b) for b in bufs], [_nbytes(b) for b in bufs],
                [_nbytes(b[0]) * self.page_size for b in bufs])

    def get_contiguous_buf_unit_lens(self) -> list[int]:
        """Bytes of one head of one token, per buffer."""
        return [_nbytes(b[0, 0]) for b in self.buffers()]

    def transfer_layout(self) -> kvt.TransferLayout:
        """The pool registered with kvt: its buffer infos, as a serving engine's KVArgs carry
        them, checked against the tensors themselves, plus the aux slots."""
        ptrs, lens, item_lens = self.get_contiguous_buf_infos()
        return kvt.TransferLayout.from_buf_infos(
            ptrs, lens, item_lens, page_size=self.page_size, dtype="bf16",
            head_num=self.head_num, head_dim=self.head_dim, device=self.cuda_ordinal(),
            unit_lens=self.get_contiguous_buf_unit_lens(), tensors=self.buffers(),
            aux_data_ptrs=[self.aux.ctypes.data], aux_data_lens=[self.aux.nbytes],
            aux_item_lens=[AUX_SLOT_BYTES], aux_tensors=[self.aux])

    def cuda_ordinal(self) -> int:
        """The pool's CUDA device, -1 for host memory."""
        if self.device == "cpu":
            return -1
        return int(self.device[5:]) if ":" in self.device else 0

    # ---- the engine's side -----------------------------------------------------------------
    def page_bytes(self) -> int:
        """Bytes of one page of one buffer."""
        return self.get_contiguous_buf_infos()[2][0]

    def alloc(self, n: int) -> list[int]:
        """n free pages (ids >= 1)."""
        if n > len(self.free_pages):
            raise RuntimeError(f"{n} pages asked, {len(self.free_pages)} free of "
                               f"{self.num_pages - 1}; make the pool larger (size) or the "
                               "request shorter")
        return [self.free_pages.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        """Returns pages to the free list."""
        self.free_pages.extend(pages)

    def write_pages(self, buffer: int, pages: list[int], data: np.ndarray) -> None:
        """Writes ``data`` ([len(pages), page_bytes] uint8) into the pages of one buffer."""
        view = self._page_view(buffer)
        if torch is not None:
            index = torch.tensor(pages, dtype=torch.long, device=view.device)
            view[index] = torch.from_numpy(data).to(view.device)
        else:
            view[pages] = data

    def read_pages(self, buffer: int) -> np.ndarray:
        """A host copy of one buffer as [num_pages, page_bytes] uint8."""
        view = self._page_view(buffer)
        return view.to("cpu", copy=True).numpy() if torch is not None else view.copy()

    def _page_view(self, buffer: int) -> Any:
        b = self.buffers()[buffer]
        flat = b.view(torch.uint8) if torch is not None else b.view(np.uint8)
        return flat.reshape(self.num_pages, -1)  # shares the buffer's memory


def forward_bytes(seed: int, buffer: int, n_pages: int, page_bytes: int) -> np.ndarray:
    """What the fake forward writes into a request's pages of one buffer: random bytes from the
    request's seed (the driver hands it to both processes, so the decode side can check every
    byte it receives)."""
    rng = np.random.default_rng([seed, buffer])
    return rng.integers(0, 256, (n_pages, page_bytes), dtype=np.uint8)


def first_token(seed: int) -> int:
    """The request's "first output token", which travels in its aux slot."""
    return zlib.crc32(seed.to_bytes(8, "little")) % 128000


def _ptr(b: Any) -> int:
    return b.data_ptr() if torch is not None else b.ctypes.data


def _nbytes(b: Any) -> int:
    return b.numel() * b.element_size() if torch is not None else b.nbytes
