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
