"""A Mooncake-style transfer engine on kvt: register memory, push writes into a peer's memory.

tokenspeed's and SGLang's PD code drive their transfer engine object through four calls::

    engine = TransferEngine(hostname, gpu_id, ib_device)
    engine.register(ptr, length)                      # every KV / aux buffer, once
    session = engine.get_session_id()                 # "host:port", published to peers
    ret = engine.batch_transfer_sync(peer_session, src_addrs, dst_addrs, lengths)  # 0 = OK

This class implements that surface on kvt's backends, so such an engine can swap kvt in. A write
is one-sided: the peer's process only has to keep its engine open. Descriptors are coalesced
into runs (adjacent source and destination addresses merge), grouped per registration, and each
group is one backend write: CUDA memory moves over CUDA IPC (one copy kernel per batch, NVLink
or PCIe within a node), host memory over UCX (shared memory, TCP or RDMA).

How regions work: the regions registered before first use (the first write, or a peer asking
for them) are registered with the backend together, as one registration; regions registered
later form a new one, so the descriptions peers already hold stay valid. A peer learns our
registrations from a small TCP exchange on the session port (length-prefixed JSON, checked on
receipt; the backend checks the keys again before using them) and keeps that connection open:
it reads them again when a write names an address they do not cover, when a write to them
failed, and when the connection closed (this engine closed or died; one opened again on the
same port has another instance id, and every connection to the old one is dropped). ``deregister`` hides a
region from every peer that reads our registrations afterwards; its registration is released
when all its regions are gone (a peer still writing into it then fails). As with Mooncake,
deregister and free a region's memory only after peers stopped writing into it.

Errors: the Mooncake calls return 0 or -1 and keep the message in :attr:`last_error` (also
logged on the ``kvt.compat.mooncake`` logger); with ``raise_errors=True`` they raise kvt's
exceptions instead (ValueError for bad arguments, :class:`kvt.TransferError` for failed
transfers, :class:`kvt.TransferTimeoutError` for timeouts).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import select
import socket
import struct
import threading
from typing import Any, Optional, Sequence, Union

import numpy as np

from .. import _args, _kvt
from .._errors import TransferError

__all__ = ["TransferEngine"]

_log = logging.getLogger("kvt.compat.mooncake")

_MAGIC = b"KVTM"
_VERSION = 1
_HEADER = struct.Struct("!4sHI")  # magic, version, body bytes
_MAX_BODY = 64 << 20  # descriptions of thousands of regions are a few hundred KiB
_IO_TIMEOUT = 10.0  # seconds for one exchange on the session port
_MAX_CONNECTIONS = 1024  # session-port connections served at once

Addresses = Union[int, Sequence[int], Any]  # an int, a list of ints or a 1-D integer array


class _Refused(Exception):
    """A bad argument or a failed exchange, turned into -1 (or raised) by the public calls."""

    def __init__(self, message: str, exc_type: type = ValueError):
        super().__init__(message)
        self.exc_type = exc_type


@dataclasses.dataclass
class _Registration:
    """One backend registration: regions registered together on one RegionWriter."""

    id: int
    kind: str  # "host" or "cuda:<device>"
    writer: Any  # _kvt.RegionWriter
    backend: str
    address: bytes
    bases: list[int]
    lengths: list[int]
    keys: list[bytes]
    live: list[bool]


@dataclasses.dataclass
class _Table:
    """Regions sorted by base: where an address range lies (registration, index in it)."""

    base: np.ndarray
    end: np.ndarray
    reg: np.ndarray
    idx: np.ndarray

    @classmethod
    def build(cls, rows: list[tuple[int, int, int, int]]) -> "_Table":
        rows = sorted(rows)
        a = np.array(rows, dtype=np.uint64).reshape(-1, 4)
        return cls(a[:, 0].copy(), a[:, 0] + a[:, 1], a[:, 2].astype(np.int64),
                   a[:, 3].astype(np.int64))

    def find(self, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per range, its row in the table and whether the row holds the whole range."""
        if self.base.size == 0:
            return np.zeros(addr.shape, np.int64), np.zeros(addr.shape, bool)
        row = np.searchsorted(self.base, addr, side="right").astype(np.int64) - 1
        found = row >= 0
        row = np.maximum(row, 0)
        inside = found & (addr + length <= self.end[row]) & (addr + length >= addr)
        return row, inside


@dataclasses.dataclass
class _PeerRegistration:
    id: int
    kind: str
    backend: str
    address: bytes
    regions: list[tuple[int, int, bytes]]


@dataclasses.dataclass
class _Session:
    """What a peer published: its registrations and the table of its live regions, and the
    connection to its session port, kept open: when it closes, the peer's engine is gone (or
    was replaced) and nothing it published may be written any more."""

    host: str
    port: int
    instance: str
    registrations: dict[int, _PeerRegistration]
    table: _Table
    sock: socket.socket

    def alive(self) -> bool:
        # A zero-timeout poll, not a non-blocking socket: threads writing to one peer ask at
        # once, and one restoring the socket's timeout would leave another's peek blocked.
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return True  # open, nothing to read
            self.sock.recv(1, socket.MSG_PEEK)  # readable: returns at once; b"": closed
        except OSError:
            return False
        return False  # closed, or bytes nobody asked for: not a kvt session port any more


_U64_MAX = 2**64 - 1


def _address(value: Any, what: str) -> int:
    """One address or length: an int-like value in [0, 2**64 - 1] (a bool is refused, as it
    would read as 0 or 1)."""
    try:
        return _args.int_in(value, what, 0, _U64_MAX, "addresses and lengths are 64-bit")
    except TypeError as e:
        raise _Refused(str(e), TypeError) from None
    except ValueError as e:
        raise _Refused(str(e)) from None


def _u64(values: Addresses, what: str) -> np.ndarray:
    """Addresses or lengths as uint64, from ints, lists or integer arrays (no Python loop for
    arrays; lists and tuples are checked element by element for bools, which numpy would turn
    into 0 and 1)."""
    if hasattr(values, "detach") and hasattr(values, "numpy"):  # torch CPU tensor
        values = values.detach().cpu().numpy()
    if isinstance(values, (list, tuple)):
        for i, v in enumerate(values):
            if _args.is_bool(v):
                raise _Refused(f"{what}[{i}] = {v!r}: a bool is not an address or a length; pass "
                               "ints", TypeError)
    elif _args.is_bool(values) and np.ndim(values) == 0:
        raise _Refused(f"{what} = {values!r}: a bool is not an address or a length; pass ints",
                       TypeError)
    a = np.asarray(values)
    if a.size and (a.dtype == object or (isinstance(values, (list, tuple)) and
                                         a.dtype.kind not in "iu")):
        # Python ints past 64 bits, or ints of both signs past int64 (which numpy turns into
        # floats), or other objects: each converted exactly, or the first bad one named.
        items = list(values) if isinstance(values, (list, tuple)) else a.reshape(-1).tolist()
        a = np.asarray([_address(v, f"{what}[{i}]") for i, v in enumerate(items)],
                       dtype=np.uint64).reshape(a.shape)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise _Refused(f"{what} must be one-dimensional, got shape {a.shape}; pass one "
                       "value per descriptor")
    if a.size and a.dtype.kind not in "iu":
        raise _Refused(f"{what} must be integers, got dtype {a.dtype}; pass ints "
                       "(tensor.data_ptr() values and byte counts)")
    if a.size and a.dtype.kind == "i" and a.min() < 0:
        i = int(np.argmin(a))
        raise _Refused(f"{what}[{i}] = {int(a[i])}: addresses and lengths are >= 0")
    return a.astype(np.uint64, copy=False)


def _parse_session(session_id: str) -> tuple[str, int]:
    host, sep, port = str(session_id).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _Refused(f"session id {session_id!r} is not 'host:port' (what the peer's "
                       "get_session_id() returned)")
    return host.strip("[]"), int(port)


def _send_frame(sock: socket.socket, body: dict[str, Any]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(_MAGIC, _VERSION, len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the connection closed {n - left} bytes into a {n}-byte read")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, first: bytes = b"") -> dict[str, Any]:
    """One frame; `first`: its first bytes when the caller read them already."""
    magic, version, length = _HEADER.unpack(first + _recv_exact(sock, _HEADER.size - len(first)))
    if magic != _MAGIC:
        raise ValueError(f"frame starts with {magic!r}, not {_MAGIC!r}: not a kvt session port")
    if version != _VERSION:
        raise ValueError(f"frame version {version}, this side speaks {_VERSION}; run the same "
                         "kvt on both sides")
    if length > _MAX_BODY:
        raise ValueError(f"frame announces {length} bytes, more than the {_MAX_BODY} allowed")
    body = json.loads(_recv_exact(sock, length))
    if not isinstance(body, dict):
        raise ValueError(f"frame body is a {type(body).__name__}, not an object")
    return body


class TransferEngine:
    """Mooncake's transfer engine surface (as tokenspeed and SGLang call it), on kvt.

    Args:
        hostname: the address peers reach this process at; the session id is
            ``"hostname:port"``.
        gpu_id: the CUDA device the caller's KV memory is on (informational: kvt reads each
            region's device from its pointer).
        ib_device: accepted for signature compatibility; UCX picks the network devices (set
            ``UCX_NET_DEVICES`` to pin one).
        port: the session port (0: any free one). bind: the address it listens on (default:
            ``hostname``).
        host_backend / cuda_backend: the kvt backends for host and CUDA memory ("ucx" and
            "cuda_ipc"; "loopback" moves host memory within one process, for tests).
        ucx_tls: UCX transports for host memory ("" = UCX's choice; "tcp", "posix,cma", ...).
        timeout: seconds one batch may take before it fails.
        raise_errors: raise exceptions instead of returning -1.
    """

    def __init__(self, hostname: str = "127.0.0.1", gpu_id: int = 0,
                 ib_device: Optional[str] = None, *, port: int = 0, bind: Optional[str] = None,
                 host_backend: str = "ucx", cuda_backend: str = "cuda_ipc", ucx_tls: str = "",
                 timeout: float = 60.0, raise_errors: bool = False):
        if timeout <= 0:
            raise ValueError(f"timeout = {timeout}: must be > 0 seconds")
        self.hostname = hostname
        self.gpu_id = gpu_id
        self.ib_device = ib_device
        self.raise_errors = raise_errors
        self.last_error = ""
        self._host_backend = host_backend
        self._cuda_backend = cuda_backend
        self._ucx_tls = ucx_tls
        self._timeout = float(timeout)
        self._lock = threading.RLock()
        self._fetch_lock = threading.Lock()
        self._pending: list[tuple[int, int, int]] = []  # (base, length, device) not yet sealed
        self._registrations: dict[int, _Registration] = {}
        self._next_registration = 0
        self._local: _Table = _Table.build([])
        self._sessions: dict[str, _Session] = {}
        self._peers: dict[tuple[str, int, int], int] = {}  # (session, theirs, ours) -> peer id
        self._stats = {"batches": 0, "descriptors": 0, "runs": 0, "bytes": 0, "failed": 0}
        self._closing = threading.Event()
        self._instance = os.urandom(8).hex()  # tells peers this engine from a later one
        self._connections: set[socket.socket] = set()
        self._listener = socket.create_server((bind or hostname, port))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._server = threading.Thread(target=self._serve, name="kvt-mooncake-session",
                                        daemon=True)
        self._server.start()

    # ---- the Mooncake surface --------------------------------------------------------------

    def get_session_id(self) -> str:
        """``"host:port"``: what peers pass to :meth:`batch_transfer_sync` to write here."""
        return f"{self.hostname}:{self.port}"

    def get_rpc_port(self) -> int:
        """The session port (Mooncake's name for it)."""
        return self.port

    def register(self, ptr: int, length: int) -> int:
        """Registers ``length`` bytes at ``ptr`` (host memory or CUDA memory) for transfers
        from and into it. 0 on success, -1 (or an exception) when refused."""
        return self._call(lambda: self._register(_address(ptr, "ptr"), _address(length, "length")))

    def register_memory(self, addr: int, capacity: int) -> int:
        """Mooncake's name for :meth:`register`."""
        return self.register(addr, capacity)

    def batch_register(self, ptrs: Addresses, lengths: Addresses) -> int:
        """Registers several regions; 0 when all were registered, else -1 and none was."""
        def run() -> None:
            p, n = _u64(ptrs, "ptrs"), _u64(lengths, "lengths")
            if p.size != n.size:
                raise _Refused(f"{p.size} pointers but {n.size} lengths; pass one per region")
            with self._lock:
                for base, length in zip(p.tolist(), n.tolist()):
                    self._check_new(base, length)
                for base, length in zip(p.tolist(), n.tolist()):
                    self._register(base, length)
        return self._call(run)

    def deregister(self, ptr: int) -> int:
        """Removes the region registered at ``ptr``; peers can no longer write into it."""
        return self._call(lambda: self._deregister(_address(ptr, "ptr")))

    def unregister_memory(self, addr: int) -> int:
        """Mooncake's name for :meth:`deregister`."""
        return self.deregister(addr)

    def batch_transfer_sync(self, session_id: str, buffers: Addresses,
                            peer_buffer_addresses: Addresses, lengths: Addresses) -> int:
        """Writes ``lengths[i]`` bytes from local ``buffers[i]`` to ``peer_buffer_addresses[i]``
        in the peer's registered memory, for every i; returns 0 once every byte is visible at
        the peer, -1 (or an exception) when refused or failed. Adjacent descriptors are
        coalesced into runs; nothing is written when an address is not registered."""
        return self._call(self._transfer, session_id, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_sync_write(self, target: str, buffers: Addresses, peer_addrs: Addresses,
                                  lengths: Addresses) -> int:
        """Mooncake's name for :meth:`batch_transfer_sync`."""
        return self.batch_transfer_sync(target, buffers, peer_addrs, lengths)

    def transfer_sync_write(self, target: str, buffer: int, peer_addr: int, length: int) -> int:
        """One descriptor."""
        return self.batch_transfer_sync(target, [buffer], [peer_addr], [length])

    # ---- beyond Mooncake ---------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Batches, descriptors, runs (after coalescing), bytes written, failed batches."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Stops the session port and releases every registration (peers' writes then fail)."""
        self._closing.set()
        self._listener.close()
        if self._server.is_alive():
            self._server.join(timeout=5)
        with self._lock:
            registrations = list(self._registrations.values())
            sessions = list(self._sessions.values())
            connections = list(self._connections)
            self._registrations.clear()
            self._peers.clear()
            self._sessions.clear()
            self._local = _Table.build([])
        for conn in connections:  # peers see their session close: our regions are gone
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for session in sessions:
            session.sock.close()
        for reg in registrations:
            reg.writer.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_closing") and not self._closing.is_set():
            self.close()

    # ---- internals ---------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> int:
        try:
            fn(*args)
        except _Refused as e:
            return self._fail(str(e), e.exc_type)
        except TransferError as e:
            return self._fail(str(e), type(e), e)
        except (TimeoutError, KeyError, ValueError) as e:
            return self._fail(str(e), type(e), e)
        self.last_error = ""
        return 0

    def _fail(self, message: str, exc_type: type, original: Optional[BaseException] = None
              ) -> int:
        self.last_error = message
        _log.error("%s", message)
        if self.raise_errors:
            if original is not None:
                raise original
            raise exc_type(message)
        return -1

    def _check_new(self, base: int, length: int) -> None:
        if base <= 0 or length <= 0:
            raise _Refused(f"register(ptr={base}, length={length}): pointer and length must be "
                           "> 0")
        end = base + length
        live = ((int(b), int(e) - int(b)) for b, e in zip(self._local.base, self._local.end))
        for b, n in [(b, n) for b, n, _ in self._pending] + list(live):
            if b < end and base < b + n:
                raise _Refused(f"register(ptr={base}, length={length}) overlaps the region "
                               f"[{b}, +{n}) already registered; register each buffer once")

    def _register(self, base: int, length: int) -> None:
        with self._lock:
            self._check_new(base, length)
            device = _kvt.pointer_device(base)
            if device >= 0 and _kvt.pointer_device(base + length - 1) != device:
                raise _Refused(f"register(ptr={base}, length={length}): the region's last byte "
                               "is not CUDA memory of the same device; pass the buffer's length")
            self._pending.append((base, length, device))

    def _deregister(self, ptr: int) -> None:
        with self._lock:
            for i, (b, _, _) in enumerate(self._pending):
                if b == ptr:
                    del self._pending[i]
                    return
            for reg in self._registrations.values():
                for i, b in enumerate(reg.bases):
                    if b == ptr and reg.live[i]:
                        reg.live[i] = False
                        if not any(reg.live):
                            del self._registrations[reg.id]
                            self._peers = {k: v for k, v in self._peers.items() if k[2] != reg.id}
                            reg.writer.close()
                        self._rebuild_local()
                        return
            raise _Refused(f"deregister(ptr={ptr}): no region registered at that address; "
                           "pass the ptr given to register()", KeyError)

    def _rebuild_local(self) -> None:
        rows = [(b, n, reg.id, i) for reg in self._registrations.values()
                for i, (b, n) in enumerate(zip(reg.bases, reg.lengths)) if reg.live[i]]
        self._local = _Table.build(rows)

    def _seal(self) -> None:
        """Registers the pending regions with the backends: one registration per memory kind."""
        with self._lock:
            if not self._pending:
                return
            groups: dict[int, list[tuple[int, int, int]]] = {}
            for region in self._pending:
                groups.setdefault(region[2], []).append(region)
            made = []
            try:
                for device, regions in sorted(groups.items()):
                    backend = self._host_backend if device < 0 else self._cuda_backend
                    writer = _kvt.RegionWriter(backend, self._ucx_tls if backend == "ucx" else "")
                    try:
                        name, address, published = writer.register(
                            [r[0] for r in regions], [r[1] for r in regions],
                            [r[2] for r in regions])
                    except BaseException:
                        writer.close()
                        raise
                    made.append(_Registration(
                        self._next_registration + len(made),
                        "host" if device < 0 else f"cuda:{device}", writer, name, address,
                        [r[0] for r in regions], [r[1] for r in regions],
                        [p[2] for p in published], [True] * len(regions)))
            except BaseException:
                for reg in made:
                    reg.writer.close()
                raise
            for reg in made:
                self._registrations[reg.id] = reg
            self._next_registration += len(made)
            self._pending.clear()
            self._rebuild_local()

    def _describe(self) -> dict[str, Any]:
        self._seal()
        with self._lock:
            return {"engine": "kvt", "instance": self._instance, "registrations": [
                {"id": reg.id, "kind": reg.kind, "backend": reg.backend,
                 "address": base64.b64encode(reg.address).decode(),
                 "regions": [[b, n, base64.b64encode(k).decode(), live] for b, n, k, live in
                             zip(reg.bases, reg.lengths, reg.keys, reg.live)]}
                for reg in self._registrations.values()]}

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                if len(self._connections) >= _MAX_CONNECTIONS:
                    _log.warning("session port: %d connections open; refusing another",
                                 len(self._connections))
                    conn.close()
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        """Answers a peer's requests until it closes the connection (a writer keeps it open
        for as long as it may write here, so that it learns when this engine goes away)."""
        try:
            with conn:
                while not self._closing.is_set():
                    conn.settimeout(None)  # idle between requests, for as long as the peer likes
                    first = conn.recv(1)
                    if not first:
                        return  # the peer closed it
                    conn.settimeout(_IO_TIMEOUT)
                    try:
                        request = _recv_frame(conn, first)
                        if request.get("op") != "describe":
                            _send_frame(conn, {"error": f"unknown op {request.get('op')!r}; "
                                                        "this session port answers 'describe'"})
                            return
                        _send_frame(conn, self._describe())
                    except Exception as e:  # a bad peer concerns its own connection only
                        _log.warning("session port: %s", e)
                        try:
                            _send_frame(conn, {"error": str(e)})
                        except OSError:
                            pass
                        return
        except OSError:
            return  # reset by the peer, or shut down by close()
        finally:
            with self._lock:
                self._connections.discard(conn)

    def _fetch(self, session_id: str, old: Optional[_Session]) -> _Session:
        """Reads the peer's registrations, on the open connection of `old` while it is open."""
        host, port = _parse_session(session_id)
        sock = old.sock if old is not None and old.alive() else None
        try:
            if sock is None:
                sock = socket.create_connection((host, port), timeout=_IO_TIMEOUT)
            sock.settimeout(_IO_TIMEOUT)
            _send_frame(sock, {"op": "describe"})
            reply = _recv_frame(sock)
        except (OSError, ValueError) as e:
            if sock is not None:
                sock.close()
            raise _Refused(f"session {session_id}: cannot read its registrations ({e}); is the "
                           "peer's engine open at that address?", TransferError) from None
        try:
            return self._parse_description(session_id, host, port, reply, sock)
        except _Refused:
            sock.close()
            raise

    def _parse_description(self, session_id: str, host: str, port: int, reply: dict[str, Any],
                           sock: socket.socket) -> _Session:
        if "error" in reply:
            raise _Refused(f"session {session_id} refused the exchange: {reply['error']}",
                           TransferError)
        try:
            instance = str(reply["instance"])
            registrations: dict[int, _PeerRegistration] = {}
            rows = []
            for r in reply["registrations"]:
                reg = _PeerRegistration(int(r["id"]), str(r["kind"]), str(r["backend"]),
                                        base64.b64decode(r["address"], validate=True), [])
                if reg.id in registrations:
                    raise ValueError(f"registration {reg.id} is listed twice")
                for i, (b, n, key, live) in enumerate(r["regions"]):
                    b, n = int(b), int(n)
                    if b <= 0 or n <= 0 or b + n >= 1 << 64:
                        raise ValueError(f"region {i} of registration {reg.id} is "
                                         f"[{b}, +{n})")
                    reg.regions.append((b, n, base64.b64decode(key, validate=True)))
                    if live:
                        rows.append((b, n, reg.id, i))
                registrations[reg.id] = reg
        except (KeyError, TypeError, ValueError) as e:
            raise _Refused(f"session {session_id} sent a malformed description ({e!r}); is it a "
                           "kvt engine of the same version?", TransferError) from None
        return _Session(host, port, instance, registrations, _Table.build(rows), sock)

    def _session(self, session_id: str, refresh: bool = False) -> _Session:
        """The peer's registrations: cached while its session connection stays open; read
        again when it closed (the peer's engine is gone or was replaced) or on `refresh`."""
        with self._lock:
            old = self._sessions.get(session_id)
        if old is not None and not refresh and old.alive():
            return old
        with self._fetch_lock:  # one exchange at a time on a session's connection
            with self._lock:
                current = self._sessions.get(session_id)
            if current is not old and current is not None and current.alive():
                return current  # another thread read it meanwhile
            return self._refetch(session_id, current)

    def _refetch(self, session_id: str, old: Optional[_Session]) -> _Session:
        try:
            session = self._fetch(session_id, old)
        except _Refused:
            self._forget_session(session_id)
            raise
        with self._lock:
            self._sessions[session_id] = session
            if old is not None and old.sock is not session.sock:
                old.sock.close()
            replaced = old is None or old.instance != session.instance
            # Connections to registrations the peer released, or to an earlier engine, go.
            for key in [k for k in self._peers if k[0] == session_id and
                        (replaced or k[1] not in session.registrations)]:
                del self._peers[key]
        return session

    def _forget_session(self, session_id: str) -> None:
        with self._lock:
            old = self._sessions.pop(session_id, None)
            for key in [k for k in self._peers if k[0] == session_id]:
                del self._peers[key]
        if old is not None:
            old.sock.close()

    def _connection(self, session_id: str, session: _Session, theirs: int, ours: int) -> int:
        key = (session_id, theirs, ours)
        with self._lock:
            peer = self._peers.get(key)
            if peer is not None:
                return peer
            local = self._registrations[ours]
        remote = session.registrations[theirs]
        if remote.backend != local.backend:
            raise _Refused(f"session {session_id}: its registration {theirs} ({remote.kind}) "
                           f"uses backend '{remote.backend}' but the source memory here "
                           f"({local.kind}) uses '{local.backend}'; host memory goes to host "
                           "memory and CUDA memory to CUDA memory")
        peer = local.writer.connect(remote.backend, remote.address, remote.regions)
        with self._lock:
            self._peers[key] = peer
        return peer

    def _transfer(self, session_id: str, buffers: Addresses, peer_addrs: Addresses,
                  lengths: Addresses) -> None:
        src, dst, n = _u64(buffers, "buffers"), _u64(peer_addrs, "peer_buffer_addresses"), \
            _u64(lengths, "lengths")
        if not src.size == dst.size == n.size:
            raise _Refused(f"{src.size} buffers, {dst.size} peer addresses and {n.size} lengths; "
                           "pass one of each per descriptor")
        keep = n > 0
        if not keep.all():
            src, dst, n = src[keep], dst[keep], n[keep]
        with self._lock:
            self._stats["batches"] += 1
            self._stats["descriptors"] += int(src.size)
        if src.size == 0:
            return
        self._seal()
        with self._lock:
            local = self._local
        lrow, ok = local.find(src, n)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise _Refused(f"descriptor {i}: [{int(src[i])}, +{int(n[i])}) is not inside a "
                           "region registered here; register the buffer first")
        session = self._session(session_id)
        rrow, ok = session.table.find(dst, n)
        if not ok.all():  # the peer may have registered more since we asked
            session = self._session(session_id, refresh=True)
            rrow, ok = session.table.find(dst, n)
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                raise _Refused(f"descriptor {i}: peer address [{int(dst[i])}, +{int(n[i])}) is "
                               f"not inside a region session {session_id} registered; pass "
                               "an address inside a buffer the peer registered (its "
                               "get_session_id() engine)")
        lreg, lidx = local.reg[lrow], local.idx[lrow]
        rreg, ridx = session.table.reg[rrow], session.table.idx[rrow]
        src_off = src - local.base[lrow]
        dst_off = dst - session.table.base[rrow]
        # Destinations must not overlap: which write would win is undefined.
        order = np.lexsort((dst, rreg))
        d_s, e_s, g_s = dst[order], (dst + n)[order], rreg[order]
        clash = (g_s[1:] == g_s[:-1]) & (d_s[1:] < e_s[:-1])
        if clash.any():
            k = int(np.flatnonzero(clash)[0])
            a, b = sorted((int(order[k]), int(order[k + 1])))
            raise _Refused(f"descriptors {a} and {b} write overlapping peer bytes "
                           f"([{int(dst[a])}, +{int(n[a])}) and [{int(dst[b])}, +{int(n[b])})); "
                           "each peer byte may be written once per batch")
        # Coalesce: sorted by (our registration, theirs, our region, their region, source),
        # a descriptor continuing the previous one in both memories extends its run.
        order = np.lexsort((src, ridx, lidx, rreg, lreg))
        lreg, rreg, lidx, ridx = lreg[order], rreg[order], lidx[order], ridx[order]
        so, do, n = src_off[order], dst_off[order], n[order]
        cont = ((lreg[1:] == lreg[:-1]) & (rreg[1:] == rreg[:-1]) & (lidx[1:] == lidx[:-1]) &
                (ridx[1:] == ridx[:-1]) & (so[:-1] + n[:-1] == so[1:]) &
                (do[:-1] + n[:-1] == do[1:]))
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        runs = np.stack([lidx[starts].astype(np.uint64), ridx[starts].astype(np.uint64),
                         so[starts], do[starts], np.add.reduceat(n, starts)], axis=1)
        pair = np.stack([lreg[starts], rreg[starts]], axis=1)
        bounds = np.flatnonzero(np.concatenate(([True], (pair[1:] != pair[:-1]).any(axis=1),
                                                [True])))
        for a, b in zip(bounds[:-1], bounds[1:]):
            ours, theirs = int(pair[a, 0]), int(pair[a, 1])
            peer = self._connection(session_id, session, theirs, ours)
            with self._lock:
                local_reg = self._registrations.get(ours)
            if local_reg is None:
                raise _Refused(f"a source region was deregistered during the transfer to "
                               f"{session_id}; deregister a region only after the transfers "
                               "from it returned")
            try:
                local_reg.writer.write(peer, runs[a:b], self._timeout)
            except BaseException:
                self._forget_session(session_id)  # reconnect (and re-read the peer) next time
                with self._lock:
                    self._stats["failed"] += 1
                raise
        with self._lock:
            self._stats["runs"] += int(runs.shape[0])
            self._stats["bytes"] += int(runs[:, 4].sum())
