"""A killed prefill process: the decode side's request fails with the reason."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

import kvt
from conftest import layout_of, make_pool


# busy_poll > 0: both engines poll, so their control messages go through a shared-memory lane;
# the socket's end still tells the decode side that the peer is gone.
@pytest.mark.parametrize("busy_poll", [0.0, 0.002])
def test_killed_peer_fails_the_request_with_its_reason(busy_poll) -> None:
    import transfer_worker

    cfg = {"size": 32 * 4, "page_size": 4, "head_num": 2, "head_dim": 16, "layer_num": 2,
           "dtype": "fp16", "use_torch": False}
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    prefill = ctx.Process(target=transfer_worker.idle_prefill_main, args=(cfg, port_q, busy_poll))
    prefill.start()
    try:
        port = port_q.get(timeout=60)
        pool = make_pool()
        with kvt.TransferEngine("decode", layout_of(pool), deadline=60,
                                control_busy_poll=busy_poll) as decode:
            peer = decode.connect("127.0.0.1", port)
            req = decode.receive("doomed", peer, [1, 2, 3])
            prefill.kill()
            prefill.join(10)
            assert req.wait(30) == kvt.KVPoll.Failed
            exc = req.failure_exception()
            assert isinstance(exc, kvt.TransferError) and exc.room == "doomed"
            assert exc.code == "Unavailable", exc
            assert "lost" in exc.reason or "closed" in exc.reason, exc.reason
            assert decode.stats()["requests_failed"] == 1
            # The peer's process is known to be gone on this host: its pages may be reused.
            end = time.monotonic() + 15
            while not req.info().pages_reusable and time.monotonic() < end:
                time.sleep(0.05)
            assert req.info().pages_reusable
    finally:
        if prefill.is_alive():
            prefill.kill()
        prefill.join(10)
