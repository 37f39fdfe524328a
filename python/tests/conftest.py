"""Shared fixtures: small host pools and a connected prefill/decode engine pair in one process."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # refpool, transfer_worker

import kvt  # noqa: E402
from refpool import ReferencePool  # noqa: E402

LAYERS = 2


def make_pool(**kw) -> ReferencePool:
    cfg = dict(size=32 * 4, page_size=4, head_num=2, head_dim=16, layer_num=LAYERS,
               dtype="fp16", use_torch=False)
    cfg.update(kw)
    return ReferencePool(**cfg)


def layout_of(pool: ReferencePool) -> kvt.TransferLayout:
    return kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer,
                                           page_size=pool.page_size, aux=pool.aux or None)


class Pair:
    def __init__(self, deadline: float = 10.0, **engine_options):
        self.p_pool, self.d_pool = make_pool(aux_slots=4), make_pool(aux_slots=4)
        rng = np.random.default_rng(5)
        for b in range(2 * LAYERS):
            view = self.p_pool.page_view(b)
            view[1:] = rng.integers(0, 256, view[1:].shape, dtype=np.uint8)
        self.prefill = kvt.TransferEngine("prefill", layout_of(self.p_pool), name="p",
                                          deadline=deadline, **engine_options)
        self.decode = kvt.TransferEngine("decode", layout_of(self.d_pool), name="d",
                                         deadline=deadline, **engine_options)
        self.peer = self.decode.connect("127.0.0.1", self.prefill.port)

    def moved(self, src, dst) -> bool:
        return all(np.array_equal(self.d_pool.page_view(b)[dst], self.p_pool.page_view(b)[src])
                   for b in range(2 * LAYERS))

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()
