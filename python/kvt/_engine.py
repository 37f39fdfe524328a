"""TransferEngine, its requests, and their states (numbered like SGLang's KVPoll)."""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Any, Optional, Union

from . import _kvt
from ._args import index as _index
from ._args import int_in as _int_in
from ._errors import TransferError, from_status
from ._layout import TransferLayout, _is_torch_tensor

__all__ = ["KVPoll", "Peer", "Request", "RequestInfo", "TransferEngine"]


class KVPoll(enum.IntEnum):
    """A request's state, numbered like SGLang's ``KVPoll``: ranks may all-reduce the MIN.

    States only move forward: Bootstrapping -> WaitingForInput -> Transferring -> Success, or
    to Failed from any of them.
    """

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


# kvt's RequestState (kBootstrapping=0 .. kSuccess=3, kFailed=4) -> KVPoll.
_POLL = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success,
         KVPoll.Failed)


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    """One request's state, bytes and timeline.

    Times are seconds on :func:`time.monotonic`'s clock (one clock for every process of a
    host), ``None`` where the point was not reached. Decode: ``request_sent`` (the request went
    to the prefill engine), ``finished`` (the data is in the pool). Prefill: ``request_seen``,
    ``source_ready`` (request, send and layers all in), ``first_post`` / ``last_post`` (writes
    accepted by the backend), ``finished`` (every write visible at the peer).
    """

    room: str
    state: KVPoll
    code: str  # "OK", or the failure's status code name
    reason: str  # why it failed ("" otherwise)
    bytes: int  # written (prefill) / delivered (decode)
    layers_posted: int
    pages_reusable: bool  # decode: no write into the request's pages can land any more
    created: Optional[float]
    finished: Optional[float]
    request_sent: Optional[float]
    request_seen: Optional[float]
    source_ready: Optional[float]
    first_post: Optional[float]
    last_post: Optional[float]

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "RequestInfo":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in fields}
        values["state"] = _POLL[d["state"]]
        return cls(**values)

    @property
    def elapsed(self) -> Optional[float]:
        """Seconds from creation to the final state (None while not final)."""
        if self.created is None or self.finished is None:
            return None
        return self.finished - self.created


@dataclasses.dataclass(frozen=True)
class Peer:
    """A prefill engine a decode engine is connected to (from :meth:`TransferEngine.connect`)."""

    handle: int
    host: str
    port: int


def _pages(pages: Any, what: str) -> Any:
    """Page lists as the native layer takes them: torch CPU tensors become numpy views."""
    if _is_torch_tensor(pages):
        if pages.device.type != "cpu":
            raise ValueError(f"{what} is on {pages.device}: page lists must be CPU tensors; "
                             "pass pages.cpu()")
        name = str(pages.dtype).replace("torch.", "")
        if name not in ("int32", "int64"):
            raise ValueError(f"{what} has dtype {name}: page lists must be int32 or int64")
        return pages.detach().contiguous().numpy()
    return pages


# The longest duration the engine takes (the wire carries deadlines as 32-bit milliseconds).
_MAX_SECONDS = 4294967.0


def _seconds(value: Optional[float], what: str) -> float:
    if value is None:
        return 0.0
    if not value >= 0:
        raise ValueError(f"{what} = {value}: must be >= 0 seconds (None: the engine's default)")
    if not value <= _MAX_SECONDS:
        raise ValueError(f"{what} = {value}: at most {_MAX_SECONDS:.0f} seconds (49.7 days) "
                         "is taken; pass None for the engine's default")
    return float(value)


def _room(room: Any) -> str:
    """A room id from a str or an int-like value; anything else (None, bytes, a float) is
    refused."""
    if isinstance(room, str):
        return room
    return str(_index(room, "room (a str or an int)"))


# The largest int32 and int64: layer counts are int32, aux slots int64 (the engine's types).
_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def _aux_slot(value: Any) -> int:
    """The native aux slot: -1 for None or -1 (no aux data, SGLang's sentinel), else a slot
    >= 0; other negative values are refused, and so are slots past int64."""
    if value is None:
        return -1
    slot = _index(value, "aux_slot (an int or None)")
    if slot < -1:
        raise ValueError(f"aux_slot = {slot}: must be >= 0 (None or -1: no aux data)")
    if slot > _INT64_MAX:
        raise ValueError(f"aux_slot = {slot} is out of range [-1, {_INT64_MAX}]: pass a slot of "
                         "the layout's aux buffers")
    return slot


def _layer_range(layers: Union[None, int, tuple[int, int], range]) -> tuple[int, int]:
    """(begin, end) for the native receive: (0, -1) for every layer."""
    if layers is None:
        return 0, -1
    hint = "layers are counted from 0, as int32"
    if isinstance(layers, range):
        if layers.step != 1:
            raise ValueError(f"layers = {layers!r}: a range of step {layers.step}; kvt moves "
                             "consecutive layers, pass range(begin, end)")
        begin, end = layers.start, layers.stop
    elif isinstance(layers, tuple):
        if len(layers) != 2:
            raise ValueError(f"layers = {layers!r}: expected (begin, end)")
        begin, end = layers
    else:
        return 0, _int_in(layers, "layers", 1, _INT32_MAX,
                          "layers=n moves layers [0, n) (int32); None: every layer")
    return (_int_in(begin, "layers (begin)", 0, _INT32_MAX, hint),
            _int_in(end, "layers (end)", -1, _INT32_MAX, hint + "; -1: to the last layer"))


def _event_handle(event: Any, cuda_layout: bool) -> int:
    if event is None:
        return 0
    if isinstance(event, bool):
        raise TypeError(f"event = {event}: pass a torch.cuda.Event, a raw cudaEvent_t handle "
                        "(int) or None")
    if isinstance(event, int):
        return _int_in(event, "event", 0, 2**64 - 1, "a raw cudaEvent_t handle (0: none)")
    handle = getattr(event, "cuda_event", None)  # torch.cuda.Event
    if isinstance(handle, int) and not isinstance(handle, bool):
        if handle == 0 and cuda_layout:
            # torch creates an event's CUDA handle when it is first recorded: an unrecorded
            # event would silently mean "no event", and the copy would not wait for the
            # producer.
            raise ValueError("the event has no CUDA handle (cuda_event = 0): a torch.cuda.Event "
                             "is created when first recorded; call event.record(stream) after "
                             "the producer's work, then layers_ready")
        return handle
    raise TypeError(f"event must be a torch.cuda.Event, a raw cudaEvent_t handle (int) or None, "
                    f"got {type(event).__name__}")


class Request:
    """One room on one engine: a decode request from :meth:`TransferEngine.receive`, or a
    prefill room from :meth:`TransferEngine.send`. Cheap handle; thread-safe."""

    def __init__(self, engine: "TransferEngine", room: str):
        self._engine = engine
        self.room = room

    def info(self) -> RequestInfo:
        """State, bytes and timeline (KeyError when the engine forgot the room)."""
        return RequestInfo._from_dict(self._engine._native_engine().get(self.room))

    def poll(self) -> KVPoll:
        """The current state (KeyError when the engine forgot the room)."""
        return _POLL[self._engine._native_engine().get(self.room)["state"]]

    def failure_exception(self) -> Optional[TransferError]:
        """The failure as an exception to raise (a TransferError with ``room`` and ``reason``;
        a TransferTimeoutError for a deadline), or None when the request has not failed."""
        d = self._engine._native_engine().get(self.room)
        if _POLL[d["state"]] != KVPoll.Failed:
            return None
        exc = from_status(d["code"], d["reason"], self.room)
        if not isinstance(exc, TransferError):
            exc = TransferError(str(exc), room=self.room, reason=d["reason"], code=d["code"])
        return exc

    def wait(self, timeout: Optional[float] = None) -> KVPoll:
        """Waits until the request is final (without holding the GIL) and returns
        KVPoll.Success or KVPoll.Failed. ``timeout`` in seconds (None: no limit).

        Raises:
            TimeoutError: ``timeout`` passed first.
            KeyError: the engine does not know the room.
        """
        native = self._engine._native_engine()
        if timeout is None or timeout == float("inf"):
            while True:
                d = native.wait(self.room, 3600.0)
                if d is not None:
                    break
        else:
            d = native.wait(self.room, _seconds(timeout, "timeout"))
            if d is None:
                try:
                    state = self.poll().name
                except (KeyError, ValueError):  # forgotten, or the engine closed, meanwhile
                    state = "unknown"
                raise TimeoutError(f"room {self.room!r} is not final after {timeout} s "
                                   f"(state {state})")
        self._engine._release_event(self.room)
        return _POLL[d["state"]]

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Fails the room with Aborted and tells the peer. No effect when already final."""
        self._engine._native_engine().abort(self.room, reason)

    def forget(self) -> None:
        """Drops the final room's record now (TransferError while it is not final, and on a
        decode engine while a failed room's pages may still be written: ``pages_reusable``)."""
        self._engine._native_engine().forget(self.room)
        self._engine._release_event(self.room)

    def __repr__(self) -> str:
        try:
            state = self.poll().name
        except Exception:  # noqa: BLE001 - repr must not raise
            state = "unknown"
        return f"Request(room={self.room!r}, state={state})"


class TransferEngine:
    """Moves KV pages of a :class:`TransferLayout` between a prefill and a decode engine.

    A prefill engine listens on a control port (``port``; 0: any free port) and writes pages;
    a decode engine connects to prefill engines and receives into its pages::

        decode:  peer = engine.connect(host, port)
                 req = engine.receive(room, peer, dst_pages)
        prefill: req = engine.send(room, src_pages)
                 engine.layers_ready(room, n)   # as layers are written, or once with all
        both:    req.poll() / req.wait(timeout) / req.abort(reason)

    Thread safety: every method may be called from any thread; calls that can block or copy
    release the GIL. Use as a context manager or call :meth:`close` to stop it (a prefill
    engine fails its open rooms and quiesces their writes first).

    Args:
        role: "prefill" or "decode".
        layout: the memory to register (kept alive by the engine).
        backend: "ucx" (host and device memory), "cuda_ipc" (CUDA memory on one host),
            "nccl" or "loopback" (one process); see :func:`kvt.backend_names`.
        name: the agent name used in hellos.
        port, bind: the prefill engine's control port and bind address.
        cluster_token: shared secret of the cluster ("" for none).
        deadline: default request deadline in seconds.
        ucx_tls: UCX transports for backend="ucx" (UCX_TLS syntax, e.g. "tcp"; "": UCX's).
        hello_timeout, peer_timeout, heartbeat_interval, retention: seconds; see the C++
            EngineOptions (retention: how long final rooms are remembered).
        control_busy_poll: seconds, at most 1; 0 (the default): the control threads sleep
            between messages. > 0: while requests are in flight, and this long after, they
            poll their sockets (a CPU core each) and :meth:`Request.wait` polls for up to this
            long before it sleeps, and on CUDA pools a prefill engine's poller stays hot
            that long after each copy it watched, so a small request's messages and copies
            cost microseconds, not a thread wake-up each. E.g. 0.001 on a machine with cores
            to spare.
        control_lanes: with control_busy_poll, a peer on this host (same shared-memory
            namespace and user) that polls too exchanges control messages through a
            shared-memory lane instead of the socket; False keeps the socket.

    Raises:
        ValueError: a bad option or layout (naming it); TransferError: the backend or the
            control server could not start (e.g. the port is taken).
    """

    def __init__(
        self,
        role: str,
        layout: TransferLayout,
        *,
        backend: str = "ucx",
        name: str = "kvt",
        port: int = 0,
        bind: str = "127.0.0.1",
        cluster_token: str = "",
        deadline: float = 30.0,
        ucx_tls: str = "",
        hello_timeout: float = 10.0,
        peer_timeout: float = 10.0,
        heartbeat_interval: float = 1.0,
        retention: float = 120.0,
        control_busy_poll: float = 0.0,
        control_lanes: bool = True,
    ):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role={role!r}: use 'prefill' or 'decode'")
        if not isinstance(layout, TransferLayout):
            raise TypeError(f"layout must be a kvt.TransferLayout, got {type(layout).__name__}")
        read_only = layout._read_only() if role == "decode" else []
        if read_only:
            raise ValueError(
                f"{read_only[0]} of the layout is a read-only numpy array "
                "(flags.writeable is False), but a decode engine writes the pages and aux bytes "
                "it receives into its layout's memory: pass writable arrays (a copy, or "
                "numpy.require(a, requirements='W')), or use this layout on a prefill engine")
        self.role = role
        self.layout = layout
        # room -> every torch.cuda.Event given to layers_ready for it, kept alive until the room
        # is final: the engine keeps one per chunk and one per posted write and waits on them
        # when it posts, which may be later. The native engine holds this dict and the layout
        # and lets go of them only after it is destroyed, whatever order Python frees the
        # attributes of this object in.
        self._events: dict[str, list[Any]] = {}
        self._events_lock = threading.Lock()
        self._prune_events_at = 64
        self._cuda_layout = int(layout.summary()["device"]) >= 0
        self._engine = _kvt.Engine(
            layout._native, role == "prefill", backend, ucx_tls, name, bind,
            _int_in(port, "port", 0, 65535, "0: any free port"),
            cluster_token, _seconds(deadline, "deadline"),
            _seconds(hello_timeout, "hello_timeout"), _seconds(peer_timeout, "peer_timeout"),
            _seconds(heartbeat_interval, "heartbeat_interval"), _seconds(retention, "retention"),
            _seconds(control_busy_poll, "control_busy_poll"), bool(control_lanes),
            (layout, self._events))

    def _native_engine(self) -> Any:
        return self._engine

    @property
    def port(self) -> int:
        """The prefill engine's bound control port."""
        return self._engine.port

    @property
    def backend(self) -> str:
        """The backend's name."""
        return self._engine.backend_name

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._engine.closed

    # ---- decode side ---------------------------------------------------------------------
    def connect(self, host: str, port: int) -> Peer:
        """Connects to the prefill engine at host:port (layouts are compared in the hello; a
        mismatch raises TransferError naming both sides' values). Connecting again to a live
        address returns the same peer."""
        port = _index(port, "port")
        if not 0 < port <= 65535:
            raise ValueError(f"port = {port}: must be 1..65535 (the prefill engine's "
                             "engine.port)")
        return Peer(self._engine.connect(host, port), host, port)

    def receive(
        self,
        room: Union[str, int],
        peer: Union[Peer, int],
        dst_pages: Any,
        aux_slot: Optional[int] = None,
        deadline: Optional[float] = None,
        layers: Union[None, int, tuple[int, int], range] = None,
    ) -> Request:
        """Asks ``peer`` for the room's KV into ``dst_pages`` (token order; ids >= 1; a numpy
        int32/int64 array, a list, or a CPU torch int32/int64 tensor).

        Args:
            aux_slot: this engine's aux slot that receives the prefill slot's bytes.
            deadline: seconds (None: the engine's default).
            layers: None (every layer), n >= 1 (layers [0, n)), (begin, end) (end -1: to the
                last layer) or a range of step 1.

        Raises:
            ValueError: a bad page id (naming its position and value) or an argument out of
                its range (naming it, its value and the range).
            TypeError: an id or count that is no int (a bool, a float, a str), naming it.
            OutOfRangeError: a page id past the pool's end.
            TransferError: an unknown or lost peer (code "FailedPrecondition" /
                "Unavailable").
        """
        begin, end = _layer_range(layers)
        handle = peer.handle if isinstance(peer, Peer) else _index(peer, "peer")
        if not 0 <= handle < 2**64:
            raise ValueError(f"peer = {handle}: not a peer; pass what connect() returned")
        room = _room(room)
        self._engine.receive(room, handle, _pages(dst_pages, "dst_pages"),
                             _seconds(deadline, "deadline"), begin, end, _aux_slot(aux_slot))
        return Request(self, room)

    # ---- prefill side --------------------------------------------------------------------
    def send(
        self,
        room: Union[str, int],
        src_pages: Any,
        aux_slot: Optional[int] = None,
        is_last: bool = True,
        deadline: Optional[float] = None,
    ) -> Request:
        """Declares the room's source pages (a chunk of them with ``is_last=False``); the
        transfer starts when the decode side's request is known too and layers are ready
        (:meth:`layers_ready`). ``aux_slot``: this engine's aux slot whose bytes go with the
        request (write them before ``layers_ready`` with the layer count: they are read once every
        layer is ready, even when the decode side asked for fewer)."""
        room = _room(room)
        self._engine.send(room, _pages(src_pages, "src_pages"), _seconds(deadline, "deadline"),
                          bool(is_last), _aux_slot(aux_slot))
        return Request(self, room)

    def layers_ready(self, room: Union[str, int], n: int, event: Any = None) -> None:
        """Layers [0, n) of the room's latest chunk are written; their pages may go out.

        ``event``: for CUDA pools, a ``torch.cuda.Event`` (or a raw cudaEvent_t as an int)
        recorded after those layers were written; the copy waits for it on the GPU, possibly
        after this call returns (when the decode side's request comes later). The engine keeps
        a ``torch.cuda.Event`` alive until the room is final; a raw handle is the caller's to
        keep valid until then."""
        room = _room(room)
        n = _int_in(n, "n", 0, _INT32_MAX, "layers [0, n) of the room's latest chunk are written")
        handle = _event_handle(event, self._cuda_layout)
        if event is not None and not isinstance(event, int):
            self._keep_event(room, event)
        self._engine.layers_ready(room, n, handle)

    def _keep_event(self, room: str, event: Any) -> None:
        with self._events_lock:
            self._events.setdefault(room, []).append(event)
            if len(self._events) < self._prune_events_at:
                return
            # Drop the events of rooms that are final (or forgotten); amortised over calls.
            for r in list(self._events):
                try:
                    final = _POLL[self._engine.get(r)["state"]] in (KVPoll.Success,
                                                                     KVPoll.Failed)
                except KeyError:
                    final = True
                if final and r != room:
                    del self._events[r]
            self._prune_events_at = max(64, 2 * len(self._events))

    def _release_event(self, room: str) -> None:
        with self._events_lock:
            self._events.pop(room, None)

    # ---- both sides ----------------------------------------------------------------------
    def request(self, room: Union[str, int]) -> Request:
        """The handle of a room this engine knows (KeyError otherwise)."""
        room = _room(room)
        self._engine.get(room)
        return Request(self, room)

    def abort(self, room: Union[str, int], reason: str = "aborted by the caller") -> None:
        """Fails the room with Aborted and tells the peer (KeyError when unknown)."""
        self._engine.abort(_room(room), reason)

    def stats(self) -> dict[str, int]:
        """requests_succeeded, requests_failed, bytes (of successful requests), writes_posted,
        runs_posted (coalesced copy runs), control_lanes (control connections through a
        shared-memory lane now), poller_hot_spins (times a busy-polling prefill engine's poller
        stayed hot after it watched a device copy)."""
        return dict(self._engine.stats())

    def close(self) -> None:
        """Stops the engine (waits for its threads without holding the GIL). Idempotent.
        Calls on other threads finish first: a ``wait`` there, and a ``connect`` waiting for
        the prefill engine's answer to its hello, end at once, raising ValueError, and later
        calls raise ValueError (the engine is closed). A second close returns once the first
        has finished."""
        self._engine.close()
        with self._events_lock:
            self._events.clear()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"TransferEngine(role={self.role!r}, closed)"
        port = f", port={self.port}" if self.role == "prefill" else ""
        return f"TransferEngine(role={self.role!r}, backend={self.backend!r}{port})"


