"""The engine from Python in one process: requests, states, errors, aborts, deadlines, threads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvt
from conftest import LAYERS

try:
    import torch
except ImportError:
    torch = None


def test_kvpoll_numbers_match_sglang() -> None:
    assert [(s.name, int(s)) for s in kvt.KVPoll] == [
        ("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2), ("Transferring", 3),
        ("Success", 4)]


def test_send_receive_states_info_and_stats(pair) -> None:
    req = pair.decode.receive("r1", pair.peer, [5, 6, 7])
    assert req.poll() in (kvt.KVPoll.Bootstrapping, kvt.KVPoll.WaitingForInput)
    sent = pair.prefill.send("r1", np.array([9, 10, 11], dtype=np.int32))
    pair.prefill.layers_ready("r1", LAYERS)
    assert req.wait(10) == kvt.KVPoll.Success
    assert sent.wait(10) == kvt.KVPoll.Success
    assert pair.moved([9, 10, 11], [5, 6, 7])
    info = req.info()
    assert info.state == kvt.KVPoll.Success and info.pages_reusable and info.code == "OK"
    assert info.bytes == 3 * 2 * LAYERS * pair.d_pool.page_view(0).shape[1]
    assert info.created <= info.request_sent <= info.finished <= time.monotonic()
    p_info = sent.info()
    assert p_info.request_seen is not None and p_info.last_post is not None
    assert req.failure_exception() is None
    assert pair.decode.stats()["requests_succeeded"] == 1
    assert pair.prefill.stats()["bytes"] == info.bytes
    req.forget()
    with pytest.raises(KeyError, match="r1"):
        req.poll()


@pytest.mark.skipif(torch is None, reason="torch is not importable")
def test_torch_page_tensors(pair) -> None:
    req = pair.decode.receive(7, pair.peer, torch.tensor([3, 4], dtype=torch.int64))
    pair.prefill.send(7, torch.tensor([1, 2], dtype=torch.int32))
    pair.prefill.layers_ready(7, LAYERS)
    assert req.wait(10) == kvt.KVPoll.Success
    assert pair.moved([1, 2], [3, 4])
    with pytest.raises(ValueError, match="float32"):
        pair.decode.receive("f", pair.peer, torch.tensor([1.0, 2.0]))


def test_layerwise_and_aux(pair) -> None:
    pair.p_pool.aux_view()[1] = np.arange(64, dtype=np.uint8)
    req = pair.decode.receive("lw", pair.peer, [20, 21], aux_slot=3)
    pair.prefill.send("lw", [30, 31], aux_slot=1)
    pair.prefill.layers_ready("lw", 1)
    pair.prefill.layers_ready("lw", LAYERS)
    assert req.wait(10) == kvt.KVPoll.Success
    assert pair.moved([30, 31], [20, 21])
    assert np.array_equal(pair.d_pool.aux_view()[3], np.arange(64, dtype=np.uint8))


@pytest.mark.parametrize("pages, match", [
    ([0], r"dst_pages\[0\] = 0"),
    ([3, -2], r"dst_pages\[1\] = -2"),
    ([1, 2, 10_000], "10000"),
    (np.array([1.5]), "float64"),
    (np.zeros((2, 2), dtype=np.int32), "one-dimensional"),
    ([2 ** 40], r"dst_pages\[0\] = 1099511627776"),
])
def test_bad_page_ids_name_the_value(pair, pages, match) -> None:
    with pytest.raises(ValueError, match=match):
        pair.decode.receive("bad", pair.peer, pages)


def test_page_past_the_end_is_out_of_range(pair) -> None:
    with pytest.raises(kvt.OutOfRangeError) as e:
        pair.prefill.send("oob", [pair.p_pool.num_pages])
    assert isinstance(e.value, IndexError) and isinstance(e.value, ValueError)
    assert str(pair.p_pool.num_pages) in str(e.value)


def test_unknown_room_and_peer(pair) -> None:
    with pytest.raises(KeyError, match="nope"):
        pair.decode.request("nope")
    with pytest.raises(KeyError):
        pair.decode.abort("nope")
    with pytest.raises(kvt.TransferError, match="12345") as e:
        pair.decode.receive("r", 12345, [1])
    assert e.value.room == "r" and e.value.code in ("FailedPrecondition", "Unavailable")


def test_abort_from_decode(pair) -> None:
    req = pair.decode.receive("ab-d", pair.peer, [1, 2])
    sent = pair.prefill.send("ab-d", [3, 4])
    req.abort("decode changed its mind")
    assert req.poll() == kvt.KVPoll.Failed
    exc = req.failure_exception()
    assert isinstance(exc, kvt.TransferError)
    assert exc.room == "ab-d" and "decode changed its mind" in exc.reason and exc.code == "Aborted"
    assert sent.wait(10) == kvt.KVPoll.Failed
    assert "decode changed its mind" in sent.failure_exception().reason


def test_abort_from_prefill(pair) -> None:
    req = pair.decode.receive("ab-p", pair.peer, [1, 2])
    sent = pair.prefill.send("ab-p", [3, 4])
    end = time.monotonic() + 10  # abort once the prefill side has the decode side's request
    while sent.poll() == kvt.KVPoll.Bootstrapping and time.monotonic() < end:
        time.sleep(0.005)
    assert sent.poll() == kvt.KVPoll.WaitingForInput
    pair.prefill.abort("ab-p", "prefill ran out of memory")
    assert sent.poll() == kvt.KVPoll.Failed
    assert req.wait(10) == kvt.KVPoll.Failed
    exc = req.failure_exception()
    assert isinstance(exc, kvt.TransferError) and "prefill ran out of memory" in exc.reason
    with pytest.raises(kvt.TransferError):
        raise exc


def test_deadline(pair) -> None:
    req = pair.decode.receive("late", pair.peer, [1], deadline=0.3)
    assert req.wait(10) == kvt.KVPoll.Failed
    exc = req.failure_exception()
    assert isinstance(exc, kvt.TransferTimeoutError) and isinstance(exc, TimeoutError)
    assert exc.code == "DeadlineExceeded" and exc.room == "late"


def test_wait_timeout_raises(pair) -> None:
    req = pair.decode.receive("slow", pair.peer, [1])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="slow"):
        req.wait(0.2)
    assert time.monotonic() - t0 >= 0.19
    req.abort()


def test_a_second_thread_progresses_while_one_waits(pair) -> None:
    req = pair.decode.receive("gil", pair.peer, [8, 9])
    result = {}

    def waiter() -> None:
        result["state"] = req.wait(20)

    t = threading.Thread(target=waiter)
    t.start()
    # While the waiter blocks in C++ this thread runs Python code and drives the prefill side.
    counter, end = 0, time.monotonic() + 0.3
    while time.monotonic() < end:
        counter += 1
    assert t.is_alive() and counter > 10_000
    pair.prefill.send("gil", [1, 2])
    pair.prefill.layers_ready("gil", LAYERS)
    t.join(20)
    assert result["state"] == kvt.KVPoll.Success
    assert pair.moved([1, 2], [8, 9])


def _start_waiting(req, result: dict) -> threading.Thread:
    """A thread in req.wait(20): its state, or the ValueError a close() ends it with."""

    def waiter() -> None:
        try:
            result["state"] = req.wait(20)
        except ValueError as e:
            result["error"] = str(e)

    t = threading.Thread(target=waiter)
    t.start()
    return t


def test_closing_the_engine_while_another_thread_waits_ends_the_wait() -> None:
    # The waiter holds the native engine through close(): close() ends its wait (it raises,
    # saying why) and destroys the engine only after the waiter has let go of it.
    from conftest import Pair
    p = Pair()
    try:
        req = p.decode.receive("waits", p.peer, [5])
        result = {}
        t = _start_waiting(req, result)
        time.sleep(0.2)
        t0 = time.monotonic()
        p.decode.close()
        closed_in = time.monotonic() - t0
        t.join(20)
        assert not t.is_alive()
        # Ended by close() inside the wait, or (on a machine slow enough that the waiter had not
        # entered it after 0.2 s) refused by the engine closed before it.
        assert result in ({"error": "the engine was closed while waiting for room 'waits'"},
                          {"error": "the engine is closed; create a new TransferEngine"}), result
        assert closed_in < 10, f"close() waited {closed_in:.1f} s for the 20 s wait"
        with pytest.raises(ValueError, match="the engine is closed"):
            req.poll()
    finally:
        p.close()


@pytest.mark.parametrize("lanes", [True, False])
def test_busy_polling_engines_move_requests_and_time_out(lanes) -> None:
    from conftest import Pair
    busy = Pair(control_busy_poll=0.002, control_lanes=lanes)
    try:
        for r in range(8):
            dst, src = [10 + r, 20 + r], [1 + r, 30 - r]
            req = busy.decode.receive(f"busy-{r}", busy.peer, dst)
            busy.prefill.send(f"busy-{r}", src)
            busy.prefill.layers_ready(f"busy-{r}", LAYERS)
            assert req.wait(10) == kvt.KVPoll.Success
            assert busy.moved(src, dst)
        for engine in (busy.decode, busy.prefill):
            assert engine.stats()["control_lanes"] == (1 if lanes else 0)
            # Host copies are not watched on a device: the poller never stays hot for them.
            assert engine.stats()["poller_hot_spins"] == 0
        # A room that ends after the polling window: the waiter sleeps, and is woken.
        late = busy.decode.receive("late", busy.peer, [31])
        timer = threading.Timer(0.05, lambda: (busy.prefill.send("late", [32]),
                                               busy.prefill.layers_ready("late", LAYERS)))
        timer.start()
        assert late.wait(10) == kvt.KVPoll.Success
        timer.join()
        assert busy.moved([32], [31])
        slow = busy.decode.receive("slow", busy.peer, [9])
        with pytest.raises(TimeoutError, match="slow"):
            slow.wait(0.001)
        slow.abort()
    finally:
        busy.close()


@pytest.mark.parametrize("value", [-0.001, 2.0, float("inf"), float("nan")])
def test_bad_busy_poll_window_names_the_value(pair, value) -> None:
    with pytest.raises(ValueError, match="control_busy_poll"):
        kvt.TransferEngine("decode", pair.decode.layout, control_busy_poll=value)


def test_engine_options_and_close(pair) -> None:
    with pytest.raises(ValueError, match="role"):
        kvt.TransferEngine("middle", pair.prefill.layout)
    with pytest.raises(ValueError, match="unknown_backend|backend"):
        kvt.TransferEngine("decode", pair.decode.layout, backend="unknown_backend")
    assert "ucx" in kvt.backend_names()
    assert pair.prefill.backend == "ucx" and pair.prefill.port > 0
    pair.decode.close()
    assert pair.decode.closed
    with pytest.raises(ValueError, match="closed"):
        pair.decode.receive("x", pair.peer, [1])


def test_layers_ready_event_forms_with_a_stand_in_for_torch_cuda_event(pair) -> None:
    """How ``event`` becomes the native handle (kvt._engine._event_handle): None is 0, an int is
    itself, an object's ``cuda_event`` int is taken (the attribute torch.cuda.Event exposes its
    cudaEvent_t as; the object here is a stand-in, since a torch.cuda.Event needs a CUDA build
    of torch and a device), a 0 handle is refused on a CUDA layout only, anything else is a
    TypeError; then a host pool's request with no event completes. That the GPU copy waits on a
    real recorded event is test_gpu.py's, on a machine with a GPU."""
    from kvt._engine import _event_handle

    class FakeTorchEvent:  # carries cuda_event as torch.cuda.Event does; nothing else of it
        cuda_event = 0x1234

    assert _event_handle(None, True) == 0 and _event_handle(77, True) == 77
    assert _event_handle(FakeTorchEvent(), True) == 0x1234
    # An unrecorded torch event has no handle yet: on a CUDA pool it would mean "no wait".
    unrecorded = FakeTorchEvent()
    unrecorded.cuda_event = 0
    assert _event_handle(unrecorded, False) == 0
    with pytest.raises(ValueError, match="call event.record"):
        _event_handle(unrecorded, True)
    with pytest.raises(TypeError, match="torch.cuda.Event"):
        pair.prefill.layers_ready("r", 1, event="not an event")
    # A host pool with no event: the layers go out.
    req = pair.decode.receive("ev", pair.peer, [12])
    pair.prefill.send("ev", [13])
    pair.prefill.layers_ready("ev", LAYERS, event=None)
    assert req.wait() == kvt.KVPoll.Success and "Success" in repr(req)


class _Event:
    """A stand-in for torch.cuda.Event, which needs a CUDA build of torch and a device: only its
    ``cuda_event`` attribute, 0 (no CUDA handle: what a host pool takes). Tests using it check
    the Python references the engine keeps, not anything CUDA does with an event."""

    cuda_event = 0


def test_layers_ready_holds_the_event_object_until_the_room_is_final(pair) -> None:
    """The object given as ``event`` stays referenced by the engine after the caller drops it,
    while the room is not final (the native engine may wait on its handle when it posts, which
    may be after layers_ready returns), and is let go once the room is final. Checked with a
    stand-in object (:class:`_Event`): the references are the same for a torch.cuda.Event."""
    import gc
    import weakref

    event = _Event()
    alive = weakref.ref(event)
    sent = pair.prefill.send("ev", [1])
    pair.prefill.layers_ready("ev", LAYERS, event=event)  # before the decode side asks
    del event
    gc.collect()
    assert alive() is not None, "the engine may still wait on the event: it must stay alive"
    req = pair.decode.receive("ev", pair.peer, [3])
    assert req.wait(10) == kvt.KVPoll.Success
    assert sent.wait(10) == kvt.KVPoll.Success
    gc.collect()
    assert alive() is None, "a final room's event is released"


def test_every_event_object_of_a_room_is_held_until_the_room_is_final(pair) -> None:
    """The engine keeps one event per chunk (and per posted write): each object given for a
    chunked room stays referenced, not only the latest, until the room is final. Checked with
    stand-in objects (:class:`_Event`), as above."""
    import gc
    import weakref

    first, second = _Event(), _Event()
    alive = [weakref.ref(first), weakref.ref(second)]
    sent = pair.prefill.send("chunks", [1], is_last=False)
    pair.prefill.layers_ready("chunks", LAYERS, event=first)
    pair.prefill.send("chunks", [2], is_last=True)
    pair.prefill.layers_ready("chunks", LAYERS, event=second)
    del first, second
    gc.collect()
    assert [a() is not None for a in alive] == [True, True]
    req = pair.decode.receive("chunks", pair.peer, [3, 4])
    assert req.wait(10) == kvt.KVPoll.Success
    assert sent.wait(10) == kvt.KVPoll.Success
    assert pair.moved([1, 2], [3, 4])
    gc.collect()
    assert [a() is None for a in alive] == [True, True]


def test_the_native_engine_keeps_the_layout_until_it_is_destroyed() -> None:
    # Whatever order Python frees an engine's attributes in, the memory the layout holds
    # outlives the native engine that registered it.
    import gc
    import weakref
    from conftest import layout_of, make_pool

    layout = layout_of(make_pool())
    alive = weakref.ref(layout)
    engine = kvt.TransferEngine("decode", layout, name="keeps")
    native = engine._native_engine()
    del layout, engine
    gc.collect()
    assert alive() is not None, "the layout went while the native engine still has it"
    native.close()
    gc.collect()
    assert alive() is None


def test_a_second_close_returns_once_the_first_has_finished() -> None:
    from conftest import Pair
    p = Pair()
    try:
        req = p.decode.receive("waits", p.peer, [5])
        done = {}

        def closer() -> None:
            p.decode._native_engine().close()
            done["first"] = time.monotonic()

        w = _start_waiting(req, {})
        time.sleep(0.2)
        first = threading.Thread(target=closer)
        first.start()
        # The first close has begun once the engine reads closed (it lets go of the engine at
        # once, then waits for the waiter without the GIL).
        give_up = time.monotonic() + 10
        while time.monotonic() < give_up:
            try:
                req.poll()
            except ValueError:
                break
            time.sleep(0.001)
        p.decode.close()  # finds the engine closing: waits for the first close
        second = time.monotonic()
        first.join(20)
        w.join(20)
        assert second >= done["first"] - 0.05, (
            f"the second close returned {done['first'] - second:.3f} s before the first ended")
    finally:
        p.close()


def test_durations_and_events_are_checked(pair) -> None:
    import math
    req = pair.decode.receive("inf", pair.peer, [6])
    threading.Timer(0.2, lambda: (pair.prefill.send("inf", [7]),
                                  pair.prefill.layers_ready("inf", LAYERS))).start()
    assert req.wait(math.inf) == kvt.KVPoll.Success
    with pytest.raises(ValueError, match="deadline = 10000000000.0: at most 4294967 seconds"):
        pair.decode.receive("long", pair.peer, [8], deadline=1e10)
    with pytest.raises(ValueError, match="timeout = nan"):
        req.wait(math.nan)
    pair.prefill.send("ev-bool", [9])
    with pytest.raises(TypeError, match="event = True"):
        pair.prefill.layers_ready("ev-bool", LAYERS, event=True)


def test_room_ids_and_aux_slots_are_checked(pair) -> None:
    with pytest.raises(TypeError, match=r"room \(a str or an int\): expected an int, got NoneType"):
        pair.decode.receive(None, pair.peer, [1])
    with pytest.raises(TypeError, match=r"room \(a str or an int\): expected an int, got float"):
        pair.prefill.send(1.5, [1])
    with pytest.raises(ValueError, match=r"aux_slot = -2: must be >= 0 \(None or -1: no aux"):
        pair.decode.receive("aux", pair.peer, [1], aux_slot=-2)
    with pytest.raises(TypeError, match=r"aux_slot \(an int or None\): expected an int, got str"):
        pair.prefill.send("aux", [1], aux_slot="0")
    with pytest.raises(TypeError, match=r"expected an int, got bool"):
        pair.prefill.send("aux", [1], aux_slot=True)
    with pytest.raises(ValueError, match=r"port = 70000: must be 1\.\.65535"):
        pair.decode.connect("127.0.0.1", 70000)
    with pytest.raises(ValueError, match=r"peer = -3: not a peer"):
        pair.decode.receive("aux", -3, [1])
    # Nothing was started by the refused calls; an int-like room id is its decimal text, and
    # -1 (SGLang's sentinel) means no aux data, as None does.
    with pytest.raises(KeyError):
        pair.decode.request("aux")
    req = pair.decode.receive(np.int64(7), pair.peer, [2], aux_slot=np.int64(1))
    assert req.room == "7"
    req.abort()
    req = pair.decode.receive("no-aux", pair.peer, [3], aux_slot=-1)
    req.abort()
    if torch is not None:
        req = pair.decode.receive(torch.tensor(8), pair.peer, [4], aux_slot=torch.tensor(2))
        assert req.room == "8"
        req.abort()


def test_a_signal_handler_runs_while_the_main_thread_waits(pair) -> None:
    import signal

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop()

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        req = pair.decode.receive("signalled", pair.peer, [4])
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        with pytest.raises(Stop):
            timer.start()
            t0 = time.monotonic()
            req.wait()  # no timeout: the engine's wait is sliced; the handler runs between slices
        assert time.monotonic() - t0 < 5
        timer.join()
        req.abort()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_python_code_that_closes_the_engine_during_a_call_does_not_hang() -> None:
    # Python code may run on the thread of a call while the call converts its arguments or
    # builds what it returns (a finaliser the collector runs, a sequence's __getitem__), and may
    # close the engine; the close waits for every reference to the engine, so no call may hold
    # one then. Here the page list closes it as numpy reads it. Run in a child process: a hang
    # ends at the timeout instead of stalling the suite.
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from conftest import Pair
p = Pair()
native = p.decode._native_engine()
class Pages:
    def __len__(self):
        return 1
    def __getitem__(self, i):
        if i >= 1:
            raise IndexError(i)
        native.close()
        return 3
try:
    native.receive("r", p.peer.handle, Pages(), 0.0, 0, -1, -1)
except ValueError as e:
    print("refused:", e)
p.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: the engine is closed" in done.stdout, done.stdout


def test_a_signal_handler_that_closes_the_engine_ends_the_wait() -> None:
    # A SIGTERM-style handler that closes the engine runs between two slices of a wait on the
    # main thread; the wait holds no reference to the engine then, so the close completes and
    # the wait ends saying so. In a child process: a hang ends at the timeout.
    code = f"""
import os, signal, sys, threading
sys.path.insert(0, {os.path.dirname(__file__)!r})
from conftest import Pair
p = Pair()
req = p.decode.receive("r", p.peer, [3])
signal.signal(signal.SIGUSR1, lambda signum, frame: p.decode.close())
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
try:
    req.wait()
except ValueError as e:
    print("ended:", e)
p.prefill.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ended: the engine was closed while waiting for room 'r'" in done.stdout, done.stdout


# An id or count too large (or too small) for the engine's integer types: each is refused with a
# ValueError naming the argument, the value and the range, before pybind11's own conversion
# (whose TypeError names neither).
@pytest.mark.parametrize("call, match", [
    (lambda p: p.decode.receive("big", p.peer, [2**64]),
     r"dst_pages\[0\] = 18446744073709551616 is out of range \[1, 2147483647\]: page ids"),
    (lambda p: p.decode.receive("big", p.peer, [5, 2**63, -1]),
     r"dst_pages\[1\] = 9223372036854775808 is out of range \[1, 2147483647\]"),
    (lambda p: p.prefill.send("big", 2**40),
     r"src_pages\[0\] = 1099511627776 is out of range \[1, 2147483647\]"),
    (lambda p: p.decode.receive("big", p.peer, [1], layers=2**31),
     r"layers = 2147483648 is out of range \[1, 2147483647\]"),
    (lambda p: p.decode.receive("big", p.peer, [1], layers=(0, 2**40)),
     r"layers \(end\) = 1099511627776 is out of range \[-1, 2147483647\]"),
    (lambda p: p.decode.receive("big", p.peer, [1], layers=-3),
     r"layers = -3 is out of range \[1, 2147483647\]"),
    (lambda p: p.decode.receive("big", 2**64, [1]),
     r"peer = 18446744073709551616: not a peer; pass what connect\(\) returned"),
    (lambda p: p.decode.receive("big", p.peer, [1], aux_slot=2**63),
     r"aux_slot = 9223372036854775808 is out of range \[-1, 9223372036854775807\]"),
    (lambda p: p.prefill.layers_ready("big", 2**31),
     r"n = 2147483648 is out of range \[0, 2147483647\]"),
    (lambda p: p.prefill.layers_ready("big", -1),
     r"n = -1 is out of range \[0, 2147483647\]"),
    (lambda p: p.prefill.layers_ready("big", 1, event=-1),
     r"event = -1 is out of range \[0, 18446744073709551615\]"),
    (lambda p: p.prefill.layers_ready("big", 1, event=2**64),
     r"event = 18446744073709551616 is out of range \[0, 18446744073709551615\]"),
    (lambda p: kvt.TransferEngine("decode", p.decode.layout, port=70000),
     r"port = 70000 is out of range \[0, 65535\]"),
    (lambda p: p.decode.connect("127.0.0.1", 2**70),
     r"port = 1180591620717411303424: must be 1\.\.65535"),
])
def test_out_of_range_ints_name_the_argument_the_value_and_the_range(pair, call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(pair)


# The native layer, which the package calls, applies the same rule: no value reaches
# pybind11's argument conversion.
@pytest.mark.parametrize("call, match", [
    (lambda p: p.decode._native_engine().receive("n", 2**64, [1], 0.0, 0, -1, -1),
     r"peer = 18446744073709551616 is out of range \[0, 18446744073709551615\]"),
    (lambda p: p.decode._native_engine().receive("n", p.peer.handle, [1], 0.0, 0, 2**31, -1),
     r"layers \(end\) = 2147483648 is out of range \[-1, 2147483647\]"),
    (lambda p: p.decode._native_engine().receive("n", p.peer.handle, [1], 0.0, 0, -1, 2**63),
     r"aux_slot = 9223372036854775808 is out of range"),
    (lambda p: p.prefill._native_engine().send("n", [1], 0.0, True, -2),
     r"aux_slot = -2 is out of range \[-1, 9223372036854775807\]"),
    (lambda p: p.prefill._native_engine().layers_ready("n", 2**31, 0),
     r"n = 2147483648 is out of range \[0, 2147483647\]"),
    (lambda p: p.prefill._native_engine().layers_ready("n", 1, -1),
     r"event = -1 is out of range \[0, 18446744073709551615\]"),
    (lambda p: p.decode._native_engine().connect("127.0.0.1", 65536),
     r"port = 65536 is out of range \[1, 65535\]"),
    (lambda p: kvt._kvt.pointer_device(-1),
     r"pointer = -1 is out of range \[0, 18446744073709551615\]"),
    (lambda p: kvt._kvt.registry_lookup("127.0.0.1", 1, "t", "", 1.0, "", "any", 2**32),
     r"tp_rank = 4294967296 is out of range \[0, 4294967295\]"),
])
def test_the_native_layer_refuses_out_of_range_ints_naming_them(pair, call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(pair)


def _bool_calls():
    from conftest import make_pool
    pool = make_pool()
    calls = [
        ("dst_pages[0]", lambda p: p.decode.receive("b", p.peer, [True])),
        ("dst_pages[0]", lambda p: p.decode.receive("b", p.peer, True)),
        ("dst_pages[1]", lambda p: p.decode.receive("b", p.peer, [2, False, 3])),
        ("dst_pages[0]", lambda p: p.decode.receive("b", p.peer, [np.True_])),
        ("dst_pages[0]", lambda p: p.decode.receive("b", p.peer, np.True_)),
        ("src_pages[0]", lambda p: p.prefill.send("b", [True])),
        ("layers", lambda p: p.decode.receive("b", p.peer, [1], layers=True)),
        ("layers (end)", lambda p: p.decode.receive("b", p.peer, [1], layers=(0, True))),
        ("peer", lambda p: p.decode.receive("b", True, [1])),
        ("aux_slot (an int or None)",
         lambda p: p.decode.receive("b", p.peer, [1], aux_slot=np.True_)),
        ("n", lambda p: p.prefill.layers_ready("b", True)),
        ("port", lambda p: p.decode.connect("127.0.0.1", True)),
        ("port", lambda p: kvt.TransferEngine("decode", p.decode.layout, port=True)),
        ("page_size", lambda p: kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer,
                                                                page_size=True)),
        ("tp_rank", lambda p: kvt.TransferLayout.from_tensors(pool.k_buffer, pool.v_buffer,
                                                              page_size=4, tp_rank=True)),
        ("tp_rank", lambda p: kvt.RegistryClient("127.0.0.1", 1).lookup(tp_rank=True)),
        ("tp_size", lambda p: kvt.RegistryClient("127.0.0.1", 1).announce(
            "b", "prefill", "127.0.0.1:1", tp_size=True)),
        ("port", lambda p: kvt.RegistryClient("127.0.0.1", True)),
        ("n", lambda p: p.prefill._native_engine().layers_ready("b", True, 0)),
        ("dst_pages[0]", lambda p: p.decode._native_engine().receive(
            "b", p.peer.handle, [True], 0.0, 0, -1, -1)),
    ]
    if torch is not None:
        calls.append(("n", lambda p: p.prefill.layers_ready("b", torch.tensor(True))))
    return calls


# True and False are ints to Python (True == 1) but never an id or a count here: refused with
# TypeError naming the argument and the value, and nothing is started.
@pytest.mark.parametrize("what, call", _bool_calls())
def test_booleans_are_refused_as_ids_and_counts(pair, what, call) -> None:
    with pytest.raises(TypeError,
                       match=re.escape(what) + r": expected an int, got (bool_?|Tensor) \("):
        call(pair)
    with pytest.raises(KeyError):
        pair.decode.request("b")
    with pytest.raises(KeyError):
        pair.prefill.request("b")
