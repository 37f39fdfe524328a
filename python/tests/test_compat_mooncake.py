"""kvt.compat.mooncake.TransferEngine: Mooncake-style pushes between two processes, byte-exact,
and every refusal naming what was wrong."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import struct
import threading

import numpy as np
import pytest

import kvt
from kvt.compat.mooncake import TransferEngine
from mooncake_worker import FILL

LAYERS = 4
PAGES = 64
ITEM = 1024  # page bytes of every K / V buffer
AUX_SLOTS, AUX_ITEM = 8, 96
SIZES = [PAGES * ITEM] * (2 * LAYERS) + [AUX_SLOTS * AUX_ITEM]


class Target:
    """The peer process: registered buffers (filled with FILL) and a session id."""

    def __init__(self, sizes: list[int], device: str = "host", **options):
        import mooncake_worker

        ctx = mp.get_context("spawn")
        self.commands, self.answers = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=mooncake_worker.target_main,
                                args=(sizes, options, self.commands, self.answers, device))
        self.proc.start()
        status, *rest = self.answers.get(timeout=60)
        assert status == "ready", rest
        self.session, self.ptrs = rest

    def ask(self, *command):
        self.commands.put(command)
        status, value = self.answers.get(timeout=60)
        assert status == "ok", value
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            self.commands.put(("exit",))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture
def target():
    t = Target(SIZES)
    yield t
    t.close()


def _source(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in SIZES]


def _ptrs(buffers: list[np.ndarray]) -> list[int]:
    return [b.ctypes.data for b in buffers]


def _descriptors(src_ptrs: list[int], dst_ptrs: list[int], src_pages, dst_pages, aux=None):
    """tokenspeed's shape: one descriptor per page per buffer (K of every layer, then V), then
    the aux slot; built without a Python loop over pages."""
    sp, dp = np.asarray(src_pages, np.uint64), np.asarray(dst_pages, np.uint64)
    s = [np.uint64(p) + sp * np.uint64(ITEM) for p in src_ptrs[:2 * LAYERS]]
    d = [np.uint64(p) + dp * np.uint64(ITEM) for p in dst_ptrs[:2 * LAYERS]]
    buffers, peers = np.concatenate(s), np.concatenate(d)
    lengths = np.full(buffers.size, ITEM, np.uint64)
    if aux is not None:
        a_src, a_dst = aux
        buffers = np.append(buffers, np.uint64(src_ptrs[-1] + a_src * AUX_ITEM))
        peers = np.append(peers, np.uint64(dst_ptrs[-1] + a_dst * AUX_ITEM))
        lengths = np.append(lengths, np.uint64(AUX_ITEM))
    return buffers, peers, lengths


def _expect(src: list[np.ndarray], moves: list[tuple]) -> list[np.ndarray]:
    want = [np.full(n, FILL, np.uint8) for n in SIZES]
    for src_pages, dst_pages, aux in moves:
        for b in range(2 * LAYERS):
            w, s = want[b].reshape(PAGES, ITEM), src[b].reshape(PAGES, ITEM)
            w[np.asarray(dst_pages)] = s[np.asarray(src_pages)]
        if aux is not None:
            want[-1].reshape(AUX_SLOTS, AUX_ITEM)[aux[1]] = \
                src[-1].reshape(AUX_SLOTS, AUX_ITEM)[aux[0]]
    return want


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for b, (g, w) in enumerate(zip(got, want)):
        bad = np.flatnonzero(g != w)
        assert bad.size == 0, f"buffer {b}: {bad.size} bytes differ, first at {bad[0]}"


@pytest.mark.parametrize("ucx_tls", ["", "tcp"])
def test_two_processes_move_random_requests_byte_exact(target: Target, ucx_tls: str) -> None:
    src = _source(3)
    rng = np.random.default_rng(4)
    engine = TransferEngine("127.0.0.1", ucx_tls=ucx_tls, raise_errors=True)
    try:
        for b in src:
            assert engine.register(b.ctypes.data, b.nbytes) == 0
        # Destinations never overlap: small requests on scattered pages of 1..19, large ones
        # on contiguous ranges (their descriptors coalesce into one run per buffer).
        scattered = list(rng.permutation(np.arange(1, 20)))
        moves = []
        for n_pages, aux, first in [(1, (0, 3), None), (5, None, None), (17, (2, 2), 20),
                                    (20, (7, 0), 40)]:
            if first is None:
                src_pages = rng.choice(np.arange(1, PAGES), n_pages, replace=False)
                dst_pages = np.array([scattered.pop() for _ in range(n_pages)])
            else:
                src_pages = np.arange(1, 1 + n_pages)
                dst_pages = np.arange(first, first + n_pages)
            moves.append((src_pages, dst_pages, aux))
            buffers, peers, lengths = _descriptors(_ptrs(src), target.ptrs, src_pages,
                                                   dst_pages, aux)
            before = engine.stats()
            assert engine.batch_transfer_sync(target.session, buffers, peers, lengths) == 0
            after = engine.stats()
            assert after["descriptors"] - before["descriptors"] == buffers.size
            assert after["bytes"] - before["bytes"] == int(lengths.sum())
            if first is not None:  # one run per buffer, plus the aux slot
                assert after["runs"] - before["runs"] == 2 * LAYERS + 1
        _assert_same(target.ask("dump"), _expect(src, moves))
    finally:
        engine.close()


def test_lists_and_single_descriptors_as_mooncake_passes_them(target: Target) -> None:
    src = _source(5)
    with TransferEngine("127.0.0.1", raise_errors=True) as engine:
        for b in src:
            assert engine.register_memory(b.ctypes.data, b.nbytes) == 0
        buffers, peers, lengths = _descriptors(_ptrs(src), target.ptrs, [3, 4], [9, 10])
        assert engine.batch_transfer_sync_write(target.session, buffers.tolist(), peers.tolist(),
                                                lengths.tolist()) == 0
        assert engine.transfer_sync_write(target.session, src[0].ctypes.data + 5 * ITEM,
                                          target.ptrs[0] + 30 * ITEM, ITEM) == 0
        want = _expect(src, [([3, 4], [9, 10], None), ([5], [30], None)])
        want[0].reshape(PAGES, ITEM)[30] = src[0].reshape(PAGES, ITEM)[5]
        for b in range(1, 2 * LAYERS):
            want[b].reshape(PAGES, ITEM)[30] = FILL
        _assert_same(target.ask("dump"), want)


def test_refusals_name_the_value_and_move_nothing(target: Target) -> None:
    src = _source(6)
    engine = TransferEngine("127.0.0.1")
    try:
        for b in src:
            engine.register(b.ctypes.data, b.nbytes)
        base, peer = src[0].ctypes.data, target.ptrs[0]

        def refused(session, buffers, peers, lengths, *words):
            assert engine.batch_transfer_sync(session, buffers, peers, lengths) == -1
            for word in words:
                assert word in engine.last_error, (word, engine.last_error)

        stray = np.zeros(ITEM, np.uint8)  # never registered
        refused(target.session, [base, stray.ctypes.data], [peer, peer + ITEM], [ITEM, ITEM],
                "descriptor 1", str(stray.ctypes.data), "register the buffer first")
        refused(target.session, [base], [peer + PAGES * ITEM - 10], [ITEM],
                "descriptor 0", str(peer + PAGES * ITEM - 10), "not inside a region")
        refused(target.session, [base, base + ITEM], [peer, peer + 10], [ITEM, ITEM],
                "descriptors 0 and 1", "overlapping")
        refused(target.session, [base, base], [peer], [ITEM], "2 buffers, 1 peer addresses")
        refused(target.session, [-5], [peer], [ITEM], "buffers[0] = -5")
        # Bools would read as 0 and 1, ints past 64 bits as numpy objects: both named.
        refused(target.session, [base], [peer], [True], "lengths[0] = True: a bool")
        refused(target.session, (base, base + ITEM), [peer, peer + ITEM], [ITEM, False],
                "lengths[1] = False: a bool")
        refused(target.session, [base], [2**64 + 3], [ITEM],
                "peer_buffer_addresses[0] = 18446744073709551619 is out of range [0, "
                "18446744073709551615]")
        refused(target.session, [2**64 - 1, -1], [peer, peer], [ITEM, ITEM],
                "buffers[1] = -1 is out of range")
        refused("no-port", [base], [peer], [ITEM], "'no-port'", "host:port")
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        refused(dead, [base], [peer], [ITEM], dead, "cannot read its registrations")
        assert engine.stats()["bytes"] == 0
        _assert_same(target.ask("dump"), [np.full(n, FILL, np.uint8) for n in SIZES])

        # Registration: overlaps and bad values are refused naming them.
        assert engine.register(base + 8, 16) == -1 and str(base + 8) in engine.last_error
        assert engine.register(0, 16) == -1 and "ptr=0" in engine.last_error
        assert engine.deregister(12345) == -1 and "12345" in engine.last_error
        assert engine.register(True, 16) == -1
        assert "ptr: expected an int, got bool (True)" in engine.last_error
        assert engine.register(base, 2**64) == -1
        assert "length = 18446744073709551616 is out of range" in engine.last_error
        assert engine.deregister(np.bool_(True)) == -1 and "got bool_" in engine.last_error

        # raise_errors: the same refusals as exceptions.
        engine.raise_errors = True
        with pytest.raises(ValueError, match="register the buffer first"):
            engine.batch_transfer_sync(target.session, [stray.ctypes.data], [peer], [ITEM])
        with pytest.raises(kvt.TransferError, match="cannot read its registrations"):
            engine.batch_transfer_sync(dead, [base], [peer], [ITEM])
        with pytest.raises(TypeError, match="a bool is not an address or a length"):
            engine.batch_transfer_sync(target.session, [base], [peer], [True])
        with pytest.raises(TypeError, match="ptr: expected an int, got bool"):
            engine.register(False, 16)
        # And the engine still works.
        assert engine.batch_transfer_sync(target.session, [base], [peer], [ITEM]) == 0
    finally:
        engine.close()



def test_unmapped_host_memory_is_refused_when_sealed_and_can_be_deregistered(
        target: Target) -> None:
    src = _source(8)
    engine = TransferEngine("127.0.0.1")
    try:
        for b in src:
            engine.register(b.ctypes.data, b.nbytes)
        # The first page above 0 is never mapped (Linux keeps vm.mmap_min_addr unmappable).
        assert engine.register(4096, 16 * ITEM) == 0  # registrations are sealed at first use
        base, peer = src[0].ctypes.data, target.ptrs[0]
        assert engine.batch_transfer_sync(target.session, [base], [peer], [ITEM]) == -1
        assert "not mapped host memory of this process" in engine.last_error, engine.last_error
        assert "0x1000" in engine.last_error, engine.last_error
        assert engine.stats()["bytes"] == 0
        assert engine.deregister(4096) == 0
        assert engine.batch_transfer_sync(target.session, [base], [peer], [ITEM]) == 0
        want = _expect(src, [])
        want[0].reshape(PAGES, ITEM)[0] = src[0].reshape(PAGES, ITEM)[0]
        _assert_same(target.ask("dump"), want)
    finally:
        engine.close()

def test_regions_registered_later_and_deregistered(target: Target) -> None:
    src = _source(7)
    with TransferEngine("127.0.0.1", raise_errors=True) as engine:
        for b in src:
            engine.register(b.ctypes.data, b.nbytes)
        assert engine.batch_transfer_sync(target.session, [src[0].ctypes.data],
                                          [target.ptrs[0]], [ITEM]) == 0
        # The peer registers a buffer after we read its registrations: we read them again.
        (late,) = target.ask("register", [4 * ITEM])
        # A source registered after first use: a second registration here.
        extra = np.arange(4 * ITEM, dtype=np.uint32).astype(np.uint8)
        engine.register(extra.ctypes.data, extra.nbytes)
        assert engine.batch_transfer_sync(
            target.session, [extra.ctypes.data, src[1].ctypes.data + ITEM],
            [late + ITEM, target.ptrs[1] + 2 * ITEM], [2 * ITEM, ITEM]) == 0
        got = target.ask("dump")
        assert np.array_equal(got[0][:ITEM], src[0][:ITEM])
        assert np.array_equal(got[-1][ITEM:3 * ITEM], extra[:2 * ITEM])
        assert (got[-1][:ITEM] == FILL).all() and (got[-1][3 * ITEM:] == FILL).all()
        assert np.array_equal(got[1][2 * ITEM:3 * ITEM], src[1][ITEM:2 * ITEM])

        # The peer deregisters: engines that read its registrations from then on refuse
        # writes into that region (an engine holding the older list learns it on its next
        # unknown address or failed write; as with Mooncake, peers stop writing first).
        assert target.ask("deregister", late) == 0
        with TransferEngine("127.0.0.1", raise_errors=True) as fresh:
            fresh.register(extra.ctypes.data, extra.nbytes)
            with pytest.raises(ValueError, match=f"peer address \\[{late}"):
                fresh.batch_transfer_sync(target.session, [extra.ctypes.data], [late], [ITEM])
        assert engine.deregister(extra.ctypes.data) == 0
        with pytest.raises(ValueError, match="register the buffer first"):
            engine.batch_transfer_sync(target.session, [extra.ctypes.data],
                                       [target.ptrs[2]], [ITEM])
        assert engine.batch_transfer_sync(target.session, [src[2].ctypes.data],
                                          [target.ptrs[2]], [ITEM]) == 0


def test_any_source_region_writes_any_peer_region_in_one_process() -> None:
    """Loopback (one process): region lists of different lengths, crossed indices."""
    a = [np.random.default_rng(i).integers(0, 256, 8 * ITEM, dtype=np.uint8) for i in range(3)]
    b = [np.full(8 * ITEM, FILL, np.uint8) for _ in range(5)]
    with TransferEngine("127.0.0.1", host_backend="loopback", raise_errors=True) as src, \
            TransferEngine("127.0.0.1", host_backend="loopback", raise_errors=True) as dst:
        for x in a:
            src.register(x.ctypes.data, x.nbytes)
        for y in b:
            dst.register(y.ctypes.data, y.nbytes)
        assert src.batch_transfer_sync(
            dst.get_session_id(),
            [a[2].ctypes.data, a[2].ctypes.data + ITEM, a[0].ctypes.data + 3 * ITEM],
            [b[4].ctypes.data + 2 * ITEM, b[4].ctypes.data + 3 * ITEM, b[1].ctypes.data],
            [ITEM, ITEM, 2 * ITEM]) == 0
        assert src.stats()["runs"] == 2  # the first two coalesced
        assert np.array_equal(b[4][2 * ITEM:4 * ITEM], a[2][:2 * ITEM])
        assert np.array_equal(b[1][:2 * ITEM], a[0][3 * ITEM:5 * ITEM])
        assert (b[0] == FILL).all() and (b[2] == FILL).all() and (b[3] == FILL).all()


class _HostilePort:
    """A session port that answers with what a broken or lying peer might send."""

    def __init__(self, reply: bytes):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.session = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(10)
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(4096)
            conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()
        self.thread.join(5)


def _frame(body: bytes, magic: bytes = b"KVTM", version: int = 1, length=None) -> bytes:
    return struct.pack("!4sHI", magic, version, len(body) if length is None else length) + body


@pytest.mark.parametrize("reply, words", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", ["not a kvt session port"]),
    (_frame(b"{}", version=9), ["version 9"]),
    (_frame(b"", length=1 << 30), ["announces 1073741824 bytes"]),
    (_frame(b"[1, 2]"), ["not an object"]),
    (_frame(b"not json"), ["Expecting value"]),
    (_frame(json.dumps({"registrations": []}).encode()), ["malformed", "'instance'"]),
    (_frame(json.dumps({"instance": "i", "registrations": [{"id": 0}]}).encode()),
     ["malformed", "'kind'"]),
    (_frame(json.dumps({"instance": "i", "registrations": [{"id": 0, "kind": "host",
                                                            "backend": "ucx", "address": "!!",
                                                            "regions": []}]}).encode()),
     ["malformed"]),
    (_frame(json.dumps({"instance": "i", "registrations": [{"id": 0, "kind": "host",
                                                            "backend": "ucx", "address": "",
                                                            "regions": [[0, 5, "", True]]}]})
            .encode()), ["region 0 of registration 0 is [0, +5)"]),
    (_frame(json.dumps({"instance": "i", "registrations": [
        {"id": 3, "kind": "host", "backend": "ucx", "address": "", "regions": []},
        {"id": 3, "kind": "host", "backend": "ucx", "address": "", "regions": []}]}).encode()),
     ["registration 3 is listed twice"]),
    (_frame(json.dumps({"error": "no"}).encode()), ["refused the exchange: no"]),
])
def test_hostile_session_ports_are_refused_naming_what_was_wrong(reply: bytes, words) -> None:
    src = np.zeros(ITEM, np.uint8)
    port = _HostilePort(reply)
    with TransferEngine("127.0.0.1") as engine:
        engine.register(src.ctypes.data, src.nbytes)
        assert engine.batch_transfer_sync(port.session, [src.ctypes.data], [1 << 40], [8]) == -1
        for word in words:
            assert word in engine.last_error, (word, engine.last_error)
    port.close()


def test_a_peer_whose_keys_lie_is_refused_by_the_backend() -> None:
    """A well-formed description whose UCX address is garbage: the backend's own checks
    refuse it before UCX reads it."""
    src = np.zeros(ITEM, np.uint8)
    body = {"instance": "i", "registrations": [{"id": 0, "kind": "host", "backend": "ucx",
                               "address": "AAAAAAAA", "regions": [[1 << 40, 4096, "AAAA", True]]}]}
    port = _HostilePort(_frame(json.dumps(body).encode()))
    with TransferEngine("127.0.0.1") as engine:
        engine.register(src.ctypes.data, src.nbytes)
        assert engine.batch_transfer_sync(port.session, [src.ctypes.data], [1 << 40], [8]) == -1
        assert engine.last_error, "the refusal says why"
        assert engine.stats()["bytes"] == 0
    port.close()


def _cuda_or_skip():
    try:
        import torch
    except ImportError:
        pytest.skip("CUDA test: torch is not installed (the GPU machine's python3 has it)")
    if not torch.cuda.is_available():
        pytest.skip("CUDA test: no CUDA device visible to torch")
    return torch


def test_cuda_memory_between_two_processes_over_cuda_ipc_byte_exact() -> None:
    """CUDA memory (torch tensors, pieces of the caching allocator's blocks): each batch goes
    over CUDA IPC as one copy program."""
    torch = _cuda_or_skip()
    target = Target(SIZES, device="cuda")
    try:
        rng = np.random.default_rng(9)
        host_src = _source(9)
        src = [torch.from_numpy(b).cuda() for b in host_src]
        with TransferEngine("127.0.0.1", raise_errors=True) as engine:
            for t in src:
                assert engine.register(t.data_ptr(), t.numel()) == 0
            moves = []
            for n_pages, first, aux in [(1, None, (1, 4)), (7, None, None), (30, 30, (6, 1))]:
                if first is None:
                    src_pages = rng.choice(np.arange(1, PAGES), n_pages, replace=False)
                    dst_pages = np.arange(1 + 8 * len(moves), 1 + 8 * len(moves) + n_pages)
                    rng.shuffle(dst_pages)
                else:
                    src_pages = np.arange(2, 2 + n_pages)
                    dst_pages = np.arange(first, first + n_pages)
                moves.append((src_pages, dst_pages, aux))
                buffers, peers, lengths = _descriptors([t.data_ptr() for t in src], target.ptrs,
                                                       src_pages, dst_pages, aux)
                assert engine.batch_transfer_sync(target.session, buffers, peers, lengths) == 0
            stats = engine.stats()
            assert stats["runs"] < stats["descriptors"]  # the contiguous request coalesced
            _assert_same(target.ask("dump"), _expect(host_src, moves))
    finally:
        target.close()


def test_a_closed_peer_is_refused_and_a_replacement_read_again() -> None:
    """The session connection stays open while a writer may write: when the peer's engine
    closes, the next write re-reads (and fails at once); an engine opened again on the same
    port is read afresh, and nothing goes to the memory the first one published."""
    src = np.random.default_rng(12).integers(0, 256, 4 * ITEM, dtype=np.uint8)
    first = np.full(4 * ITEM, FILL, np.uint8)
    second = np.full(4 * ITEM, FILL, np.uint8)
    with TransferEngine("127.0.0.1", host_backend="loopback") as writer:
        writer.register(src.ctypes.data, src.nbytes)
        peer = TransferEngine("127.0.0.1", host_backend="loopback")
        port = peer.port
        peer.register(first.ctypes.data, first.nbytes)
        session = peer.get_session_id()
        assert writer.batch_transfer_sync(session, [src.ctypes.data], [first.ctypes.data],
                                          [ITEM]) == 0
        peer.close()
        assert writer.batch_transfer_sync(session, [src.ctypes.data + ITEM],
                                          [first.ctypes.data + ITEM], [ITEM]) == -1
        assert "cannot read its registrations" in writer.last_error
        assert (first[ITEM:] == FILL).all()

        with TransferEngine("127.0.0.1", port=port, host_backend="loopback") as again:
            again.register(second.ctypes.data, second.nbytes)
            assert again.get_session_id() == session
            # The old engine's memory is not the new one's: refused, nothing written.
            assert writer.batch_transfer_sync(session, [src.ctypes.data],
                                              [first.ctypes.data + 2 * ITEM], [ITEM]) == -1
            assert "not inside a region" in writer.last_error
            assert writer.batch_transfer_sync(session, [src.ctypes.data + ITEM],
                                              [second.ctypes.data + 3 * ITEM], [ITEM]) == 0
        assert np.array_equal(first[:ITEM], src[:ITEM]) and (first[ITEM:] == FILL).all()
        assert np.array_equal(second[3 * ITEM:], src[ITEM:2 * ITEM])
        assert (second[:3 * ITEM] == FILL).all()


def test_threads_writing_to_one_peer_at_once() -> None:
    """Batches from several threads share the session and its connections; each lands whole."""
    src = np.random.default_rng(13).integers(0, 256, 64 * ITEM, dtype=np.uint8)
    dst = np.full(64 * ITEM, FILL, np.uint8)
    errors: list[str] = []
    with TransferEngine("127.0.0.1", host_backend="loopback") as writer, \
            TransferEngine("127.0.0.1", host_backend="loopback") as peer:
        writer.register(src.ctypes.data, src.nbytes)
        peer.register(dst.ctypes.data, dst.nbytes)
        session = peer.get_session_id()

        def work(t: int) -> None:
            for i in range(16):
                page = 16 * t + i  # each thread its own pages
                if writer.batch_transfer_sync(session, [src.ctypes.data + page * ITEM],
                                              [dst.ctypes.data + page * ITEM], [ITEM]) != 0:
                    errors.append(writer.last_error)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert np.array_equal(dst, src)
        assert writer.stats()["batches"] == 64
