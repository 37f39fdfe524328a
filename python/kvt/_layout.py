"""TransferLayout: the KV memory an engine moves, from buffer infos or from tensors."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

from . import _kvt

__all__ = ["TransferLayout", "dtype_name"]

IntArray = Union[int, Sequence[int], Any]  # an int, a list of ints, or a 1-D integer array

# torch / numpy dtype names -> kvt dtype names (kvt's parser takes these too, but the storage
# type uint8 of fp8 pools needs the caller to say which fp8).
_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}


def _torch() -> Any:
    """torch when the caller has imported it; kvt never imports it itself."""
    return sys.modules.get("torch")


def _is_torch_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(dtype: Any) -> str:
    """kvt's name ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2") of a dtype given as a
    string, a torch dtype or a numpy dtype. Unknown dtypes raise ValueError naming them."""
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, type):  # numpy scalar types (np.float16)
        name = dtype.__name__
    elif isinstance(getattr(dtype, "name", None), str):  # numpy dtypes
        name = dtype.name
    else:
        name = str(dtype)
        if name.startswith("torch."):
            name = name[len("torch."):]
    name = _DTYPE_ALIASES.get(name, name)
    if name == "uint8":
        raise ValueError(
            "dtype uint8 is the storage type of fp8 pools, not a KV dtype: pass "
            "dtype='fp8_e4m3' or dtype='fp8_e5m2'")
    return _kvt.dtype_name(name)


def _describe_tensor(x: Any) -> tuple[int, int, tuple[int, ...], str, int, bool]:
    """(data pointer, bytes, shape, dtype name, device ordinal or -1, contiguous)."""
    if _is_torch_tensor(x):
        device = x.device.index if x.device.type == "cuda" else -1
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor on device {x.device} cannot be registered; use CPU or CUDA")
        if x.device.type == "cuda" and device is None:
            device = _torch().cuda.current_device()
        return (x.data_ptr(), x.numel() * x.element_size(), tuple(x.shape),
                str(x.dtype).replace("torch.", ""), device, x.is_contiguous())
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return (x.ctypes.data, x.nbytes, tuple(x.shape), str(x.dtype), -1,
                bool(x.flags["C_CONTIGUOUS"]))
    raise TypeError(f"expected a torch tensor or a numpy array, got {type(x).__name__}")


class TransferLayout:
    """The KV memory a :class:`kvt.TransferEngine` registers and moves.

    The reference pool's layout: buffer ``i`` holds pages of ``item_lens[i]`` bytes, page ``p``
    at ``ptrs[i] + p * item_lens[i]``, K of layers 0..L-1 then V of layers 0..L-1 (or one latent
    buffer per layer); page 0 is the pool's dummy page. Optional aux buffers hold per-request
    slots (host memory). Build one with :meth:`from_buf_infos` or :meth:`from_tensors`; both
    validate the description against the process's memory.

    The caller owns the memory and keeps it alive for as long as an engine uses the layout;
    a layout made by :meth:`from_tensors` keeps references to its tensors.
    """

    def __init__(self, native: Any, keepalive: Sequence[Any] = ()):
        """Internal: use :meth:`from_buf_infos` or :meth:`from_tensors`."""
        self._native = native
        self._keepalive = tuple(keepalive)

    @classmethod
    def from_buf_infos(
        cls,
        kv_data_ptrs: IntArray,
        kv_data_lens: IntArray,
        kv_item_lens: IntArray,
        *,
        page_size: int,
        dtype: Any,
        head_num: int,
        head_dim: int,
        device: int = -1,
        unit_lens: Optional[IntArray] = None,
        target_buffers: int = 0,
        draft_head_num: int = 0,
        draft_head_dim: int = 0,
        aux_data_ptrs: Optional[IntArray] = None,
        aux_data_lens: Optional[IntArray] = None,
        aux_item_lens: Optional[IntArray] = None,
        latent: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int = 0,
    ) -> "TransferLayout":
        """A layout from ``get_contiguous_buf_infos()`` (ints, lists or numpy arrays).

        Args:
            kv_data_ptrs, kv_data_lens, kv_item_lens: the buffer infos (K of every layer,
                then V; draft models' buffers appended after ``target_buffers``).
            page_size: tokens per page.
            dtype: the KV element type ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", or a
                torch / numpy dtype).
            head_num, head_dim: KV heads of this rank and elements per head.
            device: CUDA ordinal of every KV buffer; -1 for host memory.
            unit_lens: ``get_contiguous_buf_unit_lens()``, checked when given.
            target_buffers: buffers [0, target_buffers) are the target model's, the rest one
                draft model's (0: all the target's); ``draft_head_num`` / ``draft_head_dim``
                when the draft's differ.
            aux_data_ptrs, aux_data_lens, aux_item_lens: per-request aux slots (host memory).
            latent: one buffer per layer (MLA-style pools) instead of K and V.
            tp_rank, tp_size, total_kv_heads: tensor-parallel placement.

        Raises:
            ValueError: the description is wrong (overlapping buffers, a length that is not a
                multiple of its item length, an unknown dtype, ...), naming the buffer and value.
        """
        native = _kvt.Layout.from_buf_infos(
            kv_data_ptrs, kv_data_lens, kv_item_lens, int(page_size), dtype_name(dtype),
            int(head_num), int(head_dim), bool(latent), int(device), unit_lens,
            int(target_buffers), int(draft_head_num), int(draft_head_dim), int(tp_rank),
            int(tp_size), int(total_kv_heads), aux_data_ptrs, aux_data_lens, aux_item_lens)
        return cls(native)

    @classmethod
    def from_tensors(
        cls,
        k_tensors: Sequence[Any],
        v_tensors: Optional[Sequence[Any]] = None,
        *,
        page_size: int,
        dtype: Any = None,
        aux: Optional[Sequence[Any]] = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int = 0,
    ) -> "TransferLayout":
        """A layout from per-layer K and V tensors (torch on CPU or CUDA, or numpy arrays).

        Each KV tensor is ``[size + page_size, head_num, head_dim]`` (the reference pool) or
        ``[pages, page_size, head_num, head_dim]``, C-contiguous, all of one shape and dtype.
        ``v_tensors=None`` registers ``k_tensors`` as latent buffers (one per layer).
        ``dtype`` defaults to the tensors' dtype; fp8 pools stored as uint8 must pass
        ``dtype='fp8_e4m3'`` or ``'fp8_e5m2'``. ``aux``: per-request aux buffers (host memory),
        slot ``s`` of each being its row ``s``. torch is never imported by kvt: tensors are
        recognised only when the caller has imported torch.

        Raises:
            ValueError: a tensor is not contiguous, has another shape, dtype or device than
                the first, or its rows are no multiple of ``page_size`` (the tensor is named).
            TypeError: an element is neither a torch tensor nor a numpy array.
        """
        groups = [("k_tensors", list(k_tensors))]
        if v_tensors is not None:
            groups.append(("v_tensors", list(v_tensors)))
            if len(groups[1][1]) != len(groups[0][1]):
                raise ValueError(
                    f"len(k_tensors) = {len(groups[0][1])} but len(v_tensors) = "
                    f"{len(groups[1][1])}: give one K and one V tensor per layer")
        if not groups[0][1]:
            raise ValueError("k_tensors is empty: give one tensor per layer")
        page_size = int(page_size)
        if page_size <= 0:
            raise ValueError(f"page_size = {page_size}: must be >= 1")
        ptrs: list[int] = []
        lens: list[int] = []
        item_lens: list[int] = []
        first: Optional[tuple[str, tuple[int, ...], str, int]] = None
        keepalive: list[Any] = []
        for label, tensors in groups:
            for i, t in enumerate(tensors):
                name = f"{label}[{i}]"
                try:
                    ptr, nbytes, shape, tdtype, device, contiguous = _describe_tensor(t)
                except TypeError as e:
                    raise TypeError(f"{name}: {e}") from None
                if not contiguous:
                    raise ValueError(
                        f"{name} is not contiguous (shape {list(shape)}): kvt moves whole "
                        "pages of contiguous memory; pass tensor.contiguous() kept alive by "
                        "the pool, or allocate the pool contiguously")
                if len(shape) not in (3, 4):
                    raise ValueError(
                        f"{name} has shape {list(shape)}: expected [size + page_size, "
                        "head_num, head_dim] or [pages, page_size, head_num, head_dim]")
                if first is None:
                    first = (name, shape, tdtype, device)
                elif (shape, tdtype, device) != first[1:]:
                    raise ValueError(
                        f"{name} is {list(shape)} {tdtype} on device {device} but {first[0]} "
                        f"is {list(first[1])} {first[2]} on device {first[3]}: every KV "
                        "tensor must have one shape, dtype and device")
                rows = shape[0] * (shape[1] if len(shape) == 4 else 1)
                if len(shape) == 4 and shape[1] != page_size:
                    raise ValueError(
                        f"{name} has shape {list(shape)}: its page dimension {shape[1]} is "
                        f"not page_size = {page_size}")
                if rows % page_size != 0:
                    raise ValueError(
                        f"{name} has {rows} token rows, not a multiple of page_size = "
                        f"{page_size}: allocate [size + page_size, ...] with size a multiple "
                        "of page_size")
                ptrs.append(ptr)
                lens.append(nbytes)
                item_lens.append(nbytes // rows * page_size)
                keepalive.append(t)
        assert first is not None
        shape = first[1]
        head_num, head_dim = shape[-2], shape[-1]
        if dtype is None:
            dtype = first[2]
        kv_dtype = dtype_name(dtype)
        aux_ptrs: list[int] = []
        aux_lens: list[int] = []
        aux_items: list[int] = []
        for i, a in enumerate(aux or ()):
            name = f"aux[{i}]"
            try:
                ptr, nbytes, ashape, _, device, contiguous = _describe_tensor(a)
            except TypeError as e:
                raise TypeError(f"{name}: {e}") from None
            if not contiguous:
                raise ValueError(f"{name} is not contiguous (shape {list(ashape)})")
            if device != -1:
                raise ValueError(f"{name} is on CUDA device {device}: aux buffers are host memory")
            if not ashape or ashape[0] == 0:
                raise ValueError(f"{name} has shape {list(ashape)}: expected [slots, ...]")
            aux_ptrs.append(ptr)
            aux_lens.append(nbytes)
            aux_items.append(nbytes // ashape[0])
            keepalive.append(a)
        native = _kvt.Layout.from_buf_infos(
            ptrs, lens, item_lens, page_size, kv_dtype, int(head_num), int(head_dim),
            v_tensors is None, int(first[3]), None, 0, 0, 0, int(tp_rank), int(tp_size),
            int(total_kv_heads), aux_ptrs or None, aux_lens or None, aux_items or None)
        return cls(native, keepalive)

    def describe(self) -> str:
        """The model description (everything but pointers) on one line."""
        return self._native.describe()

    def summary(self) -> dict[str, Any]:
        """page_size, num_layers, num_buffers, num_pages (the dummy page included),
        num_aux_slots, device, tp placement and the groups (shape, layers, heads, dtype)."""
        return self._native.summary()

    @property
    def num_pages(self) -> int:
        """Pages every KV buffer holds, the dummy page 0 included (valid ids: 1..num_pages-1)."""
        return int(self.summary()["num_pages"])

    @property
    def num_layers(self) -> int:
        """Transfer layers (every group's layers)."""
        return int(self.summary()["num_layers"])

    def __repr__(self) -> str:
        return f"TransferLayout({self.describe()})"
