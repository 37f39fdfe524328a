"""kvt: move KV-cache pages between a prefill and a decode engine's pools.

The package wraps kvt's C++ transfer engine::

    import kvt
    layout = kvt.TransferLayout.from_tensors(k_buffers, v_buffers, page_size=16)
    prefill = kvt.TransferEngine("prefill", layout)                  # listens on prefill.port
    decode = kvt.TransferEngine("decode", layout_d)
    peer = decode.connect("127.0.0.1", prefill.port)
    req = decode.receive("room-1", peer, dst_pages)
    prefill.send("room-1", src_pages); prefill.layers_ready("room-1", num_layers)
    assert req.wait(10) == kvt.KVPoll.Success

Public names: TransferLayout, TransferEngine, Request, RequestInfo, Peer, KVPoll,
TransferError, TransferTimeoutError, OutOfRangeError, RegistryClient, AgentEntry,
Announcement, Bootstrap, start_bootstrap, find_bootstrap, backend_names, dtype_name.
See docs/python.md.
"""

from __future__ import annotations

from . import _kvt
from ._engine import KVPoll, Peer, Request, RequestInfo, TransferEngine
from ._errors import OutOfRangeError, TransferError, TransferTimeoutError
from ._layout import TransferLayout, dtype_name
from ._registry import (AgentEntry, Announcement, Bootstrap, RegistryClient, find_bootstrap,
                        start_bootstrap)

__version__ = "0.1.0"

__all__ = [
    "AgentEntry", "Announcement", "Bootstrap", "KVPoll", "OutOfRangeError", "Peer",
    "RegistryClient", "Request", "RequestInfo", "TransferEngine", "TransferError",
    "TransferLayout", "TransferTimeoutError", "backend_names", "dtype_name", "find_bootstrap",
    "start_bootstrap",
]


def backend_names() -> list[str]:
    """The backends this build has, in priority order ("ucx", "cuda_ipc", "nccl",
    "loopback")."""
    return list(_kvt.backend_names())
