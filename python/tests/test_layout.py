"""TransferLayout from buffer infos and from tensors, and the errors that name the bad value."""

from __future__ import annotations

import numpy as np
import pytest

import kvt
from conftest import make_pool

try:
    import torch
except ImportError:
    torch = None


def test_buf_infos_as_lists_and_numpy_give_one_layout() -> None:
    pool = make_pool()
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    a = kvt.TransferLayout.from_buf_infos(ptrs, lens, items, page_size=4, dtype="fp16",
                                          head_num=2, head_dim=16,
                                          unit_lens=pool.get_contiguous_buf_unit_lens())
    b = kvt.TransferLayout.from_buf_infos(np.array(ptrs, dtype=np.uint64),
                                          np.array(lens), np.array(items, dtype=np.int32),
                                          page_size=4, dtype=np.float16, head_num=2, head_dim=16)
    c = kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer, page_size=4)
    assert a.describe() == b.describe() == c.describe()
    s = a.summary()
    assert s["num_layers"] == 2 and s["num_buffers"] == 4 and a.num_pages == pool.num_pages
    assert s["groups"][0]["dtype"] == "fp16" and s["groups"][0]["page_bytes"] == items[0]


def test_single_ints_and_latent() -> None:
    buf = np.zeros((8 * 4, 1, 32), dtype=np.float16)
    layout = kvt.TransferLayout.from_buf_infos(buf.ctypes.data, buf.nbytes, 4 * 64,
                                               page_size=4, dtype="fp16", head_num=1,
                                               head_dim=32, latent=True)
    assert layout.summary()["groups"][0]["shape"] == "latent"
    assert kvt.TransferLayout.from_tensors([buf], page_size=4).describe() == layout.describe()


def test_overlapping_buffers() -> None:
    pool = make_pool()
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    ptrs[3] = ptrs[2] + items[2]
    with pytest.raises(ValueError, match="overlap"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, page_size=4, dtype="fp16",
                                          head_num=2, head_dim=16)


def test_length_not_a_multiple_of_item_len() -> None:
    pool = make_pool()
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    lens[1] -= 10
    with pytest.raises(ValueError, match=str(lens[1])):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, page_size=4, dtype="fp16",
                                          head_num=2, head_dim=16)


def test_wrong_unit_lens_and_negative_values() -> None:
    pool = make_pool()
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    with pytest.raises(ValueError):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, page_size=4, dtype="fp16",
                                          head_num=2, head_dim=16, unit_lens=[3] * 4)
    with pytest.raises(ValueError, match=r"kv_data_lens\[0\] = -1"):
        kvt.TransferLayout.from_buf_infos(ptrs, [-1] + lens[1:], items, page_size=4,
                                          dtype="fp16", head_num=2, head_dim=16)


def test_unknown_dtype_is_named() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="int4"):
        kvt.TransferLayout.from_buf_infos(*pool.get_contiguous_buf_infos(), page_size=4,
                                          dtype="int4", head_num=2, head_dim=16)
    with pytest.raises(ValueError, match="fp8_e4m3"):
        kvt.dtype_name("uint8")


def test_non_contiguous_tensor_is_named() -> None:
    pool = make_pool()
    k = list(pool.k_buffer)
    k[1] = np.zeros((16 * 2, 2, 16), dtype=np.float16)[::2]
    with pytest.raises(ValueError, match=r"k_tensors\[1\] is not contiguous"):
        kvt.TransferLayout.from_tensors(k, pool.v_buffer, page_size=4)


def test_mismatched_tensors_are_named() -> None:
    pool = make_pool()
    v = list(pool.v_buffer)
    v[0] = np.zeros((pool.size + 4, 2, 8), dtype=np.float16)
    with pytest.raises(ValueError, match=r"v_tensors\[0\]"):
        kvt.TransferLayout.from_tensors(pool.k_buffer, v, page_size=4)
    with pytest.raises(ValueError, match="page_size = 5"):
        kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer, page_size=5)
    with pytest.raises(TypeError, match=r"k_tensors\[0\]"):
        kvt.TransferLayout.from_tensors([[1, 2]], page_size=4)
    empty = np.zeros((0, 2, 16), dtype=np.float16)
    with pytest.raises(ValueError, match=r"k_tensors\[0\] has shape \[0, 2, 16\]: it holds no"):
        kvt.TransferLayout.from_tensors([empty], [empty], page_size=4)


@pytest.mark.skipif(torch is None, reason="torch is not importable")
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_torch_tensors(dtype: str) -> None:
    pool = make_pool(dtype=dtype, use_torch=True)
    layout = kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer, page_size=4,
                                             dtype=None if dtype == "bf16" else dtype)
    assert layout.summary()["groups"][0]["dtype"] == dtype
    ref = kvt.TransferLayout.from_buf_infos(*pool.get_contiguous_buf_infos(), page_size=4,
                                            dtype=dtype, head_num=2, head_dim=16)
    assert ref.describe() == layout.describe()
    if dtype == "fp8_e4m3":
        with pytest.raises(ValueError, match="uint8"):
            kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer, page_size=4)
    k = list(pool.k_buffer)
    k[0] = k[0].transpose(1, 2)
    with pytest.raises(ValueError, match=r"k_tensors\[0\] is not contiguous"):
        kvt.TransferLayout.from_tensors(k, pool.v_buffer, page_size=4)


def _draft_pool_infos(target_pool, draft_pool):
    """Target then draft buffer infos, as an engine with a draft model hands them over."""
    ptrs, lens, items = target_pool.get_contiguous_buf_infos()
    d_ptrs, d_lens, d_items = draft_pool.get_contiguous_buf_infos()
    return ptrs + d_ptrs, lens + d_lens, items + d_items


def _offsets(layers: int, start: int = 0, per_layer: int = 2) -> list[list[int]]:
    """What the reference pool's get_layerwise_buf_info_offsets(start) returns."""
    if per_layer == 1:
        return [[start + layer] for layer in range(layers)]
    return [[start + layer, start + layers + layer] for layer in range(layers)]


def test_layer_offsets_in_the_reference_order_are_accepted() -> None:
    pool = make_pool()
    infos = pool.get_contiguous_buf_infos()
    plain = kvt.TransferLayout.from_buf_infos(*infos, page_size=4, dtype="fp16", head_num=2,
                                              head_dim=16)
    for offsets in (_offsets(2), np.array(_offsets(2), dtype=np.int64),
                    [tuple(row) for row in _offsets(2)]):
        layout = kvt.TransferLayout.from_buf_infos(*infos, page_size=4, dtype="fp16",
                                                   head_num=2, head_dim=16,
                                                   layer_offsets=offsets)
        assert layout.describe() == plain.describe()
    buf = np.zeros((3, 8 * 4, 1, 32), dtype=np.float16)
    latent = [int(buf[i].ctypes.data) for i in range(3)]
    layout = kvt.TransferLayout.from_buf_infos(latent, [buf[0].nbytes] * 3, [4 * 64] * 3,
                                               page_size=4, dtype="fp16", head_num=1,
                                               head_dim=32, latent=True,
                                               layer_offsets=np.arange(3))
    assert layout.num_layers == 3


def test_layer_offsets_in_another_order_name_the_layer_and_indices() -> None:
    pool = make_pool(layer_num=3)
    infos = pool.get_contiguous_buf_infos()
    kw = dict(page_size=4, dtype="fp16", head_num=2, head_dim=16)
    interleaved = [[2 * layer, 2 * layer + 1] for layer in range(3)]  # K0 V0 K1 V1 ...
    with pytest.raises(ValueError, match=r"layer_offsets\[0\] = \[0, 1\] but kvt reads target "
                                         r"layer 0 from buffers \[0, 3\]"):
        kvt.TransferLayout.from_buf_infos(*infos, layer_offsets=interleaved, **kw)
    with pytest.raises(ValueError, match=r"layer_offsets\[1\] = \[4, 1\] but kvt reads target "
                                         r"layer 1 from buffers \[1, 4\]"):
        kvt.TransferLayout.from_buf_infos(*infos, layer_offsets=np.array([[0, 3], [4, 1], [2, 5]]),
                                          **kw)
    with pytest.raises(ValueError, match=r"layer_offsets lists 2 layers but the 6 buffer infos "
                                         r"hold 3 target layers"):
        kvt.TransferLayout.from_buf_infos(*infos, layer_offsets=_offsets(2), **kw)
    with pytest.raises(ValueError, match=r"layer_offsets\[0\] = \[0\] lists 1 buffer\(s\) per "
                                         r"layer but the layout registers 2: .*latent=True"):
        kvt.TransferLayout.from_buf_infos(*infos, layer_offsets=_offsets(6, per_layer=1), **kw)
    with pytest.raises(ValueError, match=r"layer_offsets\[0\] = \[0, 2, 4\] lists 3 buffer\(s\) "
                                         r"per layer .*scales"):
        kvt.TransferLayout.from_buf_infos(*infos, layer_offsets=[[0, 2, 4], [1, 3, 5]], **kw)
    with pytest.raises(ValueError, match=r"layer_offsets\[1\] = \[1, 2, 3\] lists 3 buffers but "
                                         r"layer_offsets\[0\] = \[0\] lists 1"):
        kvt.TransferLayout.from_buf_infos(*infos, layer_offsets=[[0], [1, 2, 3], [4, 5]], **kw)
    with pytest.raises(ValueError, match="dtype float64"):
        kvt.TransferLayout.from_buf_infos(*infos, layer_offsets=np.zeros((3, 2)), **kw)


def test_draft_start_and_draft_offsets() -> None:
    target, draft = make_pool(), make_pool(head_num=1, head_dim=16)
    ptrs, lens, items = _draft_pool_infos(target, draft)
    kw = dict(page_size=4, dtype="fp16", head_num=2, head_dim=16, draft_head_num=1)
    offsets = _offsets(2) + _offsets(2, start=4)
    by_start = kvt.TransferLayout.from_buf_infos(ptrs, lens, items, draft_start=4,
                                                 layer_offsets=offsets, **kw)
    by_count = kvt.TransferLayout.from_buf_infos(np.array(ptrs, dtype=np.uint64), lens, items,
                                                 target_buffers=4, **kw)
    assert by_start.describe() == by_count.describe()
    assert len(by_start.summary()["groups"]) == 2 and by_start.num_layers == 4
    # The draft's offsets taken with start_idx 0.
    with pytest.raises(ValueError, match=r"layer_offsets\[2\] = \[0, 2\] but kvt reads draft "
                                         r"layer 0 \(transfer layer 2\) from buffers \[4, 6\].*"
                                         r"get_layerwise_buf_info_offsets\(4\)"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, draft_start=4,
                                          layer_offsets=_offsets(2) + _offsets(2), **kw)
    # Target and draft offsets without saying where the draft begins.
    with pytest.raises(ValueError, match=r"layer_offsets\[0\] = \[0, 2\] .*\[0, 4\].*"
                                         r"pass draft_start=4"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, layer_offsets=offsets,
                                          page_size=4, dtype="fp16", head_num=2, head_dim=16)
    with pytest.raises(ValueError, match=r"target_buffers = 2 but draft_start = 4"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, draft_start=4, target_buffers=2,
                                          **kw)
    with pytest.raises(ValueError, match=r"draft_start = 9: .* 1\.\.8"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, draft_start=9, **kw)
    with pytest.raises(ValueError, match=r"draft_start = 0"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, draft_start=0, **kw)
    whole = kvt.TransferLayout.from_buf_infos(*target.get_contiguous_buf_infos(), draft_start=4,
                                              page_size=4, dtype="fp16", head_num=2,
                                              head_dim=16)
    assert len(whole.summary()["groups"]) == 1


def test_buf_infos_checked_against_tensors() -> None:
    pool = make_pool(aux_slots=4)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    aux_ptrs, aux_lens, aux_items = pool.aux_infos()
    kw = dict(page_size=4, dtype="fp16", head_num=2, head_dim=16)
    layout = kvt.TransferLayout.from_buf_infos(
        np.array(ptrs, dtype=np.uint64), np.array(lens), items, tensors=pool.buffers(),
        aux_data_ptrs=aux_ptrs, aux_data_lens=aux_lens, aux_item_lens=aux_items,
        aux_tensors=pool.aux, **kw)
    assert layout.describe() == kvt.TransferLayout.from_tensors(
        pool.k_buffer, pool.v_buffer, page_size=4, aux=pool.aux).describe()
    swapped = pool.buffers()
    swapped[1], swapped[2] = swapped[2], swapped[1]
    with pytest.raises(ValueError, match=rf"kv_data_ptrs\[1\] = {ptrs[1]:#x} but "
                                         rf"tensors\[1\]\.data_ptr\(\) = {ptrs[2]:#x}"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, tensors=swapped, **kw)
    short = list(lens)
    short[3] -= items[3]
    with pytest.raises(ValueError, match=rf"kv_data_lens\[3\] = {short[3]} but tensors\[3\] "
                                         rf"has {lens[3]} bytes"):
        kvt.TransferLayout.from_buf_infos(ptrs, short, items, tensors=pool.buffers(), **kw)
    with pytest.raises(ValueError, match=r"3 tensors for 4 kv_data_ptrs"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, tensors=pool.buffers()[:3], **kw)
    with pytest.raises(ValueError, match=r"tensors\[0\] is in host memory but device = 0"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, tensors=pool.buffers(), device=0,
                                          **kw)
    with pytest.raises(ValueError, match=rf"aux_data_lens\[0\] = 8 but aux_tensors\[0\] has "
                                         rf"{aux_lens[0]} bytes"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, aux_data_ptrs=aux_ptrs,
                                          aux_data_lens=[8], aux_item_lens=[8],
                                          aux_tensors=pool.aux, **kw)
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        kvt.TransferLayout.from_buf_infos(ptrs[:1], lens[:1], items[:1], tensors=[[1, 2]], **kw)


@pytest.mark.skipif(torch is None, reason="torch is not importable")
def test_buf_infos_checked_against_torch_tensors() -> None:
    pool = make_pool(use_torch=True)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    layout = kvt.TransferLayout.from_buf_infos(ptrs, lens, items, page_size=4, dtype="fp16",
                                               head_num=2, head_dim=16, tensors=pool.buffers(),
                                               layer_offsets=torch.tensor(_offsets(2)).numpy())
    assert layout.num_layers == 2
    other = [t.clone() for t in pool.buffers()]
    with pytest.raises(ValueError, match=rf"kv_data_ptrs\[0\] = {ptrs[0]:#x} but "
                                         rf"tensors\[0\]\.data_ptr\(\) = {other[0].data_ptr():#x}"):
        kvt.TransferLayout.from_buf_infos(ptrs, lens, items, page_size=4, dtype="fp16",
                                          head_num=2, head_dim=16, tensors=other)


def test_read_only_arrays_serve_a_prefill_engine_but_not_a_decode_engine() -> None:
    pool = make_pool(aux_slots=4)
    pool.v_buffer[1].flags.writeable = False
    by_tensors = kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer, page_size=4,
                                                 aux=pool.aux)
    with pytest.raises(ValueError, match=r"v_tensors\[1\] of the layout is a read-only numpy "
                                         r"array .* a decode engine writes"):
        kvt.TransferEngine("decode", by_tensors)
    prefill = kvt.TransferEngine("prefill", by_tensors)
    prefill.close()

    pool.v_buffer[1].flags.writeable = True
    pool.aux[0].flags.writeable = False
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    aux_ptrs, aux_lens, aux_items = pool.aux_infos()
    by_infos = kvt.TransferLayout.from_buf_infos(
        ptrs, lens, items, page_size=4, dtype="fp16", head_num=2, head_dim=16,
        tensors=pool.buffers(), aux_data_ptrs=aux_ptrs, aux_data_lens=aux_lens,
        aux_item_lens=aux_items, aux_tensors=pool.aux)
    with pytest.raises(ValueError, match=r"aux_tensors\[0\] of the layout is a read-only"):
        kvt.TransferEngine("decode", by_infos)
    pool.aux[0].flags.writeable = True  # writable again: the same layout serves a decode engine
    kvt.TransferEngine("decode", by_infos).close()
