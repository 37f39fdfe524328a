"""TransferLayout: the KV memory an engine moves, from buffer infos or from tensors."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

from . import _kvt
from ._args import index as _index

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


def _named_arrays(tensors: Sequence[Any], label: str) -> list[tuple[str, Any]]:
    """The numpy arrays among ``tensors`` with their names (``label[i]``): a decode engine
    writes into its layout's memory, so it refuses those that are read-only when it starts."""
    np = sys.modules.get("numpy")
    if np is None:
        return []
    return [(f"{label}[{i}]", t) for i, t in enumerate(tensors) if isinstance(t, np.ndarray)]


def _ints(values: IntArray, what: str) -> list[int]:
    """An int, a list of ints or a 1-D integer array as Python ints (one per buffer); a bool or
    another value that is no int raises TypeError naming ``what[i]``."""
    np = sys.modules.get("numpy")
    if isinstance(values, int) or (np is not None and isinstance(values, np.integer)):
        return [_index(values, f"{what}[0]")]
    if np is not None and isinstance(values, np.ndarray):
        values = values.reshape(-1).tolist()
    return [_index(v, f"{what}[{i}]") for i, v in enumerate(values)]


def _check_tensors(tensors: Sequence[Any], ptrs: list[int], lens: list[int], device: int,
                   names: tuple[str, str, str]) -> None:
    """Every buffer info equals its tensor: pointer = data_ptr(), length = bytes, device."""
    label, ptr_name, len_name = names
    if len(tensors) != len(ptrs):
        raise ValueError(
            f"{len(tensors)} {label} for {len(ptrs)} {ptr_name}: give one tensor per buffer, in "
            "the buffer infos' order (K of every layer, then V, then a draft model's buffers)")
    for i, t in enumerate(tensors):
        name = f"{label}[{i}]"
        try:
            ptr, nbytes, shape, _, tdevice, contiguous = _describe_tensor(t)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
        if ptr != ptrs[i]:
            raise ValueError(
                f"{ptr_name}[{i}] = {ptrs[i]:#x} but {name}.data_ptr() = {ptr:#x}: the buffer "
                "infos and the tensors name different memory; pass both from the same pool, in "
                "the same order")
        if i < len(lens) and nbytes != lens[i]:
            raise ValueError(
                f"{len_name}[{i}] = {lens[i]} but {name} has {nbytes} bytes (shape "
                f"{list(shape)}): pass the tensor's whole length, numel() * element_size()")
        if not contiguous:
            raise ValueError(
                f"{name} is not contiguous (shape {list(shape)}): its bytes are not the "
                f"{nbytes} bytes from {ptr:#x} that the buffer infos describe")
        if tdevice != device:
            where = "host memory" if tdevice == -1 else f"CUDA device {tdevice}"
            raise ValueError(
                f"{name} is in {where} but device = {device}: pass device={tdevice}, or tensors "
                "from the pool whose buffer infos these are")


def _check_layer_offsets(layer_offsets: Any, num_buffers: int, target: int,
                         per_layer: int) -> None:
    """``layer_offsets`` against the order kvt registers (the reference order, a draft model's
    buffers from ``target`` on); raises ValueError naming the first layer that differs."""
    import numpy as np  # a dependency of the package; imported only where it is needed

    try:
        arr = np.asarray(layer_offsets)
    except ValueError:  # ragged rows (numpy >= 1.24)
        arr = None
    if arr is None or arr.dtype == object:
        rows = [np.atleast_1d(np.asarray(r)) for r in layer_offsets]
        for layer, row in enumerate(rows):
            if len(row) != len(rows[0]):
                raise ValueError(
                    f"layer_offsets[{layer}] = {row.tolist()} lists {len(row)} buffers but "
                    f"layer_offsets[0] = {rows[0].tolist()} lists {len(rows[0])}: kvt moves the "
                    "same buffers for every layer (K and V, or one latent buffer); pools with "
                    "other buffers on some layers (indexer or compressor state) cannot be "
                    "registered yet")
        arr = np.asarray(rows)
    if arr.ndim == 0:
        arr = arr.reshape(1, 1)
    elif arr.ndim == 1:
        arr = arr.reshape(-1, 1)
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(
            f"layer_offsets has shape {list(arr.shape)}: pass per layer the list of its buffer "
            "indices, as get_layerwise_buf_info_offsets() returns them")
    if arr.dtype.kind not in "iu":
        raise ValueError(
            f"layer_offsets has dtype {arr.dtype}: buffer indices are integers")
    width = arr.shape[1]
    if width != per_layer:
        first = arr[0].tolist()
        if width == 1:
            todo = ("one buffer per layer is the order of MLA-style pools: pass latent=True "
                    "to register one latent buffer per layer")
        elif width == 2:
            todo = "two buffers per layer are K and V: drop latent=True (one buffer per layer)"
        else:
            todo = ("kvt moves K and V (2) or one latent buffer (1) per layer; pools with more "
                    "buffers per layer (quantization scales, indexer or compressor state) "
                    "cannot be registered yet")
        raise ValueError(
            f"layer_offsets[0] = {first} lists {width} buffer(s) per layer but the layout "
            f"registers {per_layer}: {todo}")
    if target % per_layer or (num_buffers - target) % per_layer:
        return  # an odd buffer count: the layout's own check names it
    target_layers = target // per_layer
    draft_layers = (num_buffers - target) // per_layer

    def expected_for(split: int) -> Any:
        t_layers, d_layers = split // per_layer, (num_buffers - split) // per_layer
        exp = np.empty((t_layers + d_layers, per_layer), dtype=np.int64)
        exp[:t_layers, 0] = np.arange(t_layers)
        exp[t_layers:, 0] = split + np.arange(d_layers)
        if per_layer == 2:
            exp[:t_layers, 1] = t_layers + np.arange(t_layers)
            exp[t_layers:, 1] = split + d_layers + np.arange(d_layers)
        return exp

    order = (f"K of target layer l at buffer l and V at {target_layers} + l"
             if per_layer == 2 else "target layer l at buffer l")
    if draft_layers:
        order += (f", the draft model's {draft_layers} layers in the same order from "
                  f"draft_start = {target} on")
    if arr.shape[0] != target_layers + draft_layers:
        held = f"{target_layers} target layers" + (
            f" and {draft_layers} draft layers" if draft_layers else "")
        raise ValueError(
            f"layer_offsets lists {arr.shape[0]} layers but the {num_buffers} buffer infos hold "
            f"{held} ({per_layer} buffer(s) per layer): pass the target pool's "
            "get_layerwise_buf_info_offsets() followed by the draft pool's "
            "get_layerwise_buf_info_offsets(draft_start), with draft_start the draft's first "
            "buffer")
    expected = expected_for(target)
    bad = np.nonzero((arr != expected).any(axis=1))[0]
    if bad.size == 0:
        return
    layer = int(bad[0])
    got, want = arr[layer].tolist(), expected[layer].tolist()
    which = (f"target layer {layer}" if layer < target_layers else
             f"draft layer {layer - target_layers} (transfer layer {layer})")
    hint = ""
    if per_layer == 2 and draft_layers == 0:
        split = 2 * int(arr[0, 1] - arr[0, 0])
        if 0 < split < num_buffers and np.array_equal(arr, expected_for(split)):
            hint = (f"; these offsets put a draft model's buffers from {split} on: pass "
                    f"draft_start={split}")
    elif layer >= target_layers and np.array_equal(arr[target_layers:] + target,
                                                   expected[target_layers:]):
        hint = (f"; the draft's offsets start at 0: take them from the draft pool's "
                f"get_layerwise_buf_info_offsets({target})")
    raise ValueError(
        f"layer_offsets[{layer}] = {got} but kvt reads {which} from buffers {want} ({order}); "
        f"kvt cannot move buffers in another order: list the buffer infos in this order{hint}")


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

    def __init__(self, native: Any, keepalive: Sequence[Any] = (),
                 arrays: Sequence[tuple[str, Any]] = ()):
        """Internal: use :meth:`from_buf_infos` or :meth:`from_tensors`."""
        self._native = native
        self._keepalive = tuple(keepalive)
        self._arrays = tuple(arrays)  # the numpy arrays it was made from, with their names

    def _read_only(self) -> list[str]:
        """Names of the numpy arrays of the layout that are read-only now."""
        return [name for name, a in self._arrays if not a.flags.writeable]

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
        layer_offsets: Optional[Any] = None,
        target_buffers: int = 0,
        draft_start: Optional[int] = None,
        draft_head_num: int = 0,
        draft_head_dim: int = 0,
        aux_data_ptrs: Optional[IntArray] = None,
        aux_data_lens: Optional[IntArray] = None,
        aux_item_lens: Optional[IntArray] = None,
        latent: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        total_kv_heads: int = 0,
        tensors: Optional[Sequence[Any]] = None,
        aux_tensors: Optional[Sequence[Any]] = None,
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
            layer_offsets: ``get_layerwise_buf_info_offsets()`` (per layer its buffer indices;
                a draft's from ``get_layerwise_buf_info_offsets(draft_start)`` appended), a
                list of lists or a 2-D integer array (1-D: one buffer per layer); checked
                against the order kvt moves, which is the only order it can move.
            target_buffers: buffers [0, target_buffers) are the target model's, the rest one
                draft model's (0: all the target's); ``draft_head_num`` / ``draft_head_dim``
                when the draft's differ.
            draft_start: the index of the draft model's first buffer (the ``start_idx`` of its
                offsets), instead of ``target_buffers``; ``len(kv_data_ptrs)``: no draft.
            aux_data_ptrs, aux_data_lens, aux_item_lens: per-request aux slots (host memory).
            latent: one buffer per layer (MLA-style pools) instead of K and V.
            tp_rank, tp_size, total_kv_heads: tensor-parallel placement.
            tensors, aux_tensors: the pool's tensors in buffer-info order (torch or numpy);
                each pointer and length must equal its tensor's ``data_ptr()`` and bytes. The
                layout keeps references to them.

        Raises:
            ValueError: the description is wrong (overlapping buffers, a length that is not a
                multiple of its item length, an unknown dtype, layer offsets in another order,
                a pointer that is not its tensor's, ...), naming the buffer and value.
        """
        checks = draft_start is not None or tensors is not None or layer_offsets is not None
        ptrs = _ints(kv_data_ptrs, "kv_data_ptrs") if checks else []
        target = _index(target_buffers, "target_buffers")
        if draft_start is not None:
            start = _index(draft_start, "draft_start")
            if not 0 < start <= len(ptrs):
                raise ValueError(
                    f"draft_start = {start}: the draft model's first buffer must be in "
                    f"1..{len(ptrs)} (len(kv_data_ptrs) for no draft model); it is the "
                    "start_idx given to the draft pool's get_layerwise_buf_info_offsets")
            if target not in (0, start):
                raise ValueError(
                    f"target_buffers = {target} but draft_start = {start}: both say where the "
                    "draft model's buffers begin; pass one of them")
            target = start
        keepalive: list[Any] = []
        arrays: list[tuple[str, Any]] = []
        if tensors is not None:
            tensors = list(tensors)
            _check_tensors(tensors, ptrs, _ints(kv_data_lens, "kv_data_lens"),
                           _index(device, "device"),
                           ("tensors", "kv_data_ptrs", "kv_data_lens"))
            keepalive += tensors
            arrays += _named_arrays(tensors, "tensors")
        if aux_tensors is not None:
            aux_tensors = list(aux_tensors)
            _check_tensors(aux_tensors,
                           [] if aux_data_ptrs is None else _ints(aux_data_ptrs, "aux_data_ptrs"),
                           [] if aux_data_lens is None else _ints(aux_data_lens, "aux_data_lens"),
                           -1,
                           ("aux_tensors", "aux_data_ptrs", "aux_data_lens"))
            keepalive += aux_tensors
            arrays += _named_arrays(aux_tensors, "aux_tensors")
        if layer_offsets is not None:
            _check_layer_offsets(layer_offsets, len(ptrs), target or len(ptrs),
                                 1 if latent else 2)
        # The native layer checks every int (a bool or a value out of its range is refused
        # naming the argument).
        native = _kvt.Layout.from_buf_infos(
            kv_data_ptrs, kv_data_lens, kv_item_lens, page_size, dtype_name(dtype), head_num,
            head_dim, bool(latent), device, unit_lens, target, draft_head_num, draft_head_dim,
            tp_rank, tp_size, total_kv_heads, aux_data_ptrs, aux_data_lens, aux_item_lens)
        return cls(native, keepalive, arrays)

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
        page_size = _index(page_size, "page_size")
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
                        "pages of contiguous memory; register the contiguous tensor the pool "
                        "allocated (not a view of it), or allocate the pool contiguously. "
                        "tensor.contiguous() would be a copy the model never writes: its pages "
                        "would move stale")
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
                if rows == 0 or nbytes == 0:
                    raise ValueError(
                        f"{name} has shape {list(shape)}: it holds no token rows (or no "
                        "bytes); every KV tensor needs at least the dummy page")
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
            v_tensors is None, int(first[3]), None, 0, 0, 0, tp_rank, tp_size, total_kv_heads,
            aux_ptrs or None, aux_lens or None, aux_items or None)
        arrays = [a for label, tensors in groups for a in _named_arrays(tensors, label)]
        return cls(native, keepalive, arrays + _named_arrays(list(aux or ()), "aux"))

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
