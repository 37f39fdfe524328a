"""The bootstrap registry from Python: look-ups, announcements, and a kvt-bootstrap process."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from . import _kvt
from ._args import int_in as _int_in

__all__ = ["AgentEntry", "Announcement", "Bootstrap", "RegistryClient", "find_bootstrap",
           "start_bootstrap"]


@dataclasses.dataclass(frozen=True)
class AgentEntry:
    """One agent (a TP rank of a prefill or decode instance) as the registry knows it.
    ``layout`` summarises its pool (num_layers, page_size, dtype, head_num, head_dim,
    num_pages, aux_slots) or is None."""

    name: str
    role: str
    tp_rank: int
    tp_size: int
    control_address: str  # "host:port" of its engine's control server
    host_id: str
    layout: Optional[dict[str, Any]]

    @property
    def host_port(self) -> tuple[str, int]:
        """control_address split into (host, port)."""
        host, _, port = self.control_address.rpartition(":")
        return host.strip("[]"), int(port)


class Announcement:
    """A registration the registry keeps while a background thread refreshes it; ends with
    :meth:`close` (or the context manager), which removes it from the registry."""

    def __init__(self, native: Any):
        self._native = native

    @property
    def refreshes(self) -> int:
        """Refreshes that reached the registry so far (registration included)."""
        return self._native.refreshes

    def close(self) -> None:
        """Stops refreshing and removes the entry from the registry, so that the name, role and
        rank are free for another agent at once. Waits at most the client's ``timeout`` for the
        registry and never raises for it: when the registry cannot be reached or does not answer
        in time (logged at warn), the entry expires after the registry's missed heartbeats.
        Closing again does nothing; an announcement that is collected unclosed is closed."""
        self._native.close()

    def __enter__(self) -> "Announcement":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RegistryClient:
    """A client of a kvt-bootstrap registry at host:port. Each call uses its own connection;
    thread-safe. ``timeout``: seconds for connecting and for each reply."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, cluster_token: str = "",
                 client_id: str = "kvt-python", timeout: float = 5.0):
        self.host = host
        self.port = _int_in(port, "port", 1, 65535, "give the registry's port")
        self.cluster_token = cluster_token
        self.client_id = client_id
        self.timeout = float(timeout)

    def lookup(self, name: str = "", role: str = "any",
               tp_rank: Optional[int] = None) -> list[AgentEntry]:
        """Live entries matching the filter ("" / "any" / None match all).

        Raises:
            TransferError: the registry cannot be reached (code "Unavailable").
            ValueError: an unknown role, a tp_rank out of [0, 2**32 - 1].
            TypeError: a tp_rank that is no int (a bool, a float), naming it.
        """
        rows = _kvt.registry_lookup(self.host, self.port, self.client_id, self.cluster_token,
                                    self.timeout, name, role, tp_rank)
        return [AgentEntry(**row) for row in rows]

    def announce(self, name: str, role: str, control_address: str, *, tp_rank: int = 0,
                 tp_size: int = 1, host_id: str = "") -> Announcement:
        """Registers an agent ("prefill" or "decode") reachable at ``control_address``
        ("host:port"; decode entries carry port 0) and keeps it registered until the returned
        Announcement is closed, which removes the entry. The registry refuses addresses no peer
        can reach (wildcard hosts, port 0 on a prefill entry) with ValueError naming them; a
        name, role and rank announced by another live agent with TransferError code
        "AlreadyExists" naming that agent's address ("Unavailable" while that agent is
        disconnected: retry once its entry expired); a registry at its ``--max-entries`` with
        code "ResourceExhausted". tp_rank and tp_size are ints (not bools) in [0, 2**32 - 1]
        and [1, 2**32 - 1]."""
        native = _kvt.Announcement(self.host, self.port, self.cluster_token, self.timeout, name,
                                   role, control_address, tp_rank, tp_size, host_id)
        return Announcement(native)


def find_bootstrap() -> str:
    """The kvt-bootstrap binary: $KVT_BOOTSTRAP, else next to the package (kvt/bin/ when pip
    installed it, <build>/tools/bootstrap/ when it is a build folder's), else on PATH. Raises
    FileNotFoundError saying where it looked."""
    looked = []
    env = os.environ.get("KVT_BOOTSTRAP")
    if env:
        if os.access(env, os.X_OK):
            return env
        looked.append(f"$KVT_BOOTSTRAP={env} (not an executable)")
    package = Path(__file__).resolve().parent
    # Installed by pip (kvt/bin/), or the package assembled in a build folder
    # (<build>/python/kvt, the tool at <build>/tools/bootstrap/).
    for beside in (package / "bin" / "kvt-bootstrap",
                   package.parent.parent / "tools" / "bootstrap" / "kvt-bootstrap"):
        if os.access(beside, os.X_OK):
            return str(beside)
        looked.append(str(beside))
    on_path = shutil.which("kvt-bootstrap")
    if on_path:
        return on_path
    looked.append("PATH")
    raise FileNotFoundError(
        "kvt-bootstrap not found (looked in " + ", ".join(looked) + "): build kvt's tools "
        "(cmake --build <build> --target kvt-bootstrap) and set KVT_BOOTSTRAP to the binary, or "
        "put its folder on PATH")


class Bootstrap:
    """A running kvt-bootstrap process (from :func:`start_bootstrap`): ``host``, ``port``,
    ``address``; :meth:`client` gives a RegistryClient for it; :meth:`stop` ends it."""

    def __init__(self, process: subprocess.Popen, host: str, port: int, cluster_token: str):
        self.process = process
        self.host = host
        self.port = port
        self.cluster_token = cluster_token

    @property
    def address(self) -> str:
        """"host:port"."""
        return f"{self.host}:{self.port}"

    def client(self, **kwargs: Any) -> RegistryClient:
        """A RegistryClient for this registry (keyword arguments go to RegistryClient)."""
        kwargs.setdefault("cluster_token", self.cluster_token)
        return RegistryClient(self.host, self.port, **kwargs)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminates the process and waits for it (kills it after ``timeout`` seconds)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "Bootstrap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_bootstrap(host: str = "127.0.0.1", port: int = 0, *, cluster_token: str = "",
                    heartbeat_ms: Optional[int] = None, max_entries: Optional[int] = None,
                    timeout: float = 10.0, binary: Optional[str] = None) -> Bootstrap:
    """Starts kvt-bootstrap (for tests and notebooks) listening on host:port (port 0: a free
    one) and waits until it is ready. The process exits with its parent. ``heartbeat_ms`` and
    ``max_entries`` are its ``--heartbeat-ms`` and ``--max-entries`` (None: its defaults).

    Raises:
        FileNotFoundError: no kvt-bootstrap binary (see :func:`find_bootstrap`).
        TimeoutError / RuntimeError: it did not become ready within ``timeout`` seconds / it
            exited, with its output.
    """
    exe = binary or find_bootstrap()
    with tempfile.TemporaryDirectory(prefix="kvt-bootstrap-") as tmp:
        ready = Path(tmp) / "ready.json"
        log = Path(tmp) / "log"
        cmd = [exe, "--listen", f"{host}:{_int_in(port, 'port', 0, 65535, '0: a free port')}",
               "--ready-file", str(ready), "--exit-with-parent"]
        if heartbeat_ms is not None:
            cmd += ["--heartbeat-ms", str(_int_in(heartbeat_ms, "heartbeat_ms", 1, 2**31 - 1))]
        if max_entries is not None:
            cmd += ["--max-entries", str(_int_in(max_entries, "max_entries", 1, 1 << 20))]
        env = dict(os.environ)
        if cluster_token:
            env["KVT_CLUSTER_TOKEN"] = cluster_token
        with open(log, "wb") as out:
            process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + timeout
        while True:
            if ready.exists():
                try:
                    bound = json.loads(ready.read_text())["port"]
                    return Bootstrap(process, host, int(bound), cluster_token)
                except (ValueError, KeyError):
                    pass  # being written
            if process.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {process.returncode}: "
                                   f"{log.read_text(errors='replace').strip()}")
            if time.monotonic() > end:
                process.kill()
                process.wait()
                raise TimeoutError(f"{' '.join(cmd)} was not ready after {timeout} s: "
                                   f"{log.read_text(errors='replace').strip()}")
            time.sleep(0.02)
