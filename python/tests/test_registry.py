"""The bootstrap registry from Python: start kvt-bootstrap, announce an agent, look it up."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import kvt


def test_missing_binary_says_what_to_do(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVT_BOOTSTRAP", str(tmp_path / "nothing"))
    monkeypatch.setenv("PATH", str(tmp_path))
    # A package with nothing beside it (neither kvt/bin/ nor a build folder's tools/).
    monkeypatch.setattr(kvt._registry, "__file__", str(tmp_path / "a" / "kvt" / "_registry.py"))
    with pytest.raises(FileNotFoundError, match="KVT_BOOTSTRAP") as refused:
        kvt.find_bootstrap()
    assert str(tmp_path / "a" / "kvt" / "bin" / "kvt-bootstrap") in str(refused.value)
    assert str(tmp_path / "tools" / "bootstrap" / "kvt-bootstrap") in str(refused.value)


def test_a_build_folders_package_finds_the_build_folders_tool(monkeypatch, tmp_path) -> None:
    tool = tmp_path / "tools" / "bootstrap" / "kvt-bootstrap"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.delenv("KVT_BOOTSTRAP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(kvt._registry, "__file__",
                        str(tmp_path / "python" / "kvt" / "_registry.py"))
    assert kvt.find_bootstrap() == str(tool)


@pytest.mark.skipif(not os.environ.get("KVT_BOOTSTRAP"), reason="KVT_BOOTSTRAP is not set")
def test_announce_and_lookup() -> None:
    with kvt.start_bootstrap() as registry:
        client = registry.client()
        assert client.lookup() == []
        with client.announce("py-agent", "prefill", "127.0.0.1:4567", tp_size=2) as ann:
            entries = client.lookup("py-agent", role="prefill")
            assert len(entries) == 1 and ann.refreshes >= 1
            entry = entries[0]
            assert (entry.name, entry.role, entry.tp_rank, entry.tp_size) == (
                "py-agent", "prefill", 0, 2)
            assert entry.host_port == ("127.0.0.1", 4567)
            assert client.lookup("py-agent", role="decode") == []
        with pytest.raises(ValueError, match="0.0.0.0"):
            client.announce("bad", "prefill", "0.0.0.0:1")
        with pytest.raises(ValueError, match="role"):
            client.lookup(role="boss")
    with pytest.raises(kvt.TransferError) as e:
        kvt.RegistryClient("127.0.0.1", registry.port, timeout=0.5).lookup()
    assert e.value.code == "Unavailable"


def _bootstrap_binary() -> str:
    """kvt-bootstrap as start_bootstrap finds it; the test is skipped where there is none."""
    try:
        return kvt.find_bootstrap()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_a_key_announced_by_a_live_agent_is_refused_to_another() -> None:
    binary = _bootstrap_binary()
    with kvt.start_bootstrap(binary=binary) as registry:
        client = registry.client()
        with client.announce("py-held", "prefill", "127.0.0.1:4567", tp_size=2) as holder:
            with pytest.raises(kvt.TransferError) as refused:
                client.announce("py-held", "prefill", "127.0.0.1:4568", tp_size=2)
            assert refused.value.code == "AlreadyExists"
            message = str(refused.value)
            assert "prefill 'py-held' rank 0 is held by the agent at 127.0.0.1:4567" in message
            assert "127.0.0.1:4568" in message and "another name or tp_rank" in message
            # Another rank of the name is another key; the holder keeps its entry.
            with client.announce("py-held", "prefill", "127.0.0.1:4568", tp_rank=1, tp_size=2):
                entries = client.lookup("py-held", role="prefill")
                assert [(e.tp_rank, e.control_address) for e in entries] == [
                    (0, "127.0.0.1:4567"), (1, "127.0.0.1:4568")]
            assert holder.refreshes >= 1


def test_a_full_registry_refuses_new_keys_naming_max_entries() -> None:
    binary = _bootstrap_binary()
    with kvt.start_bootstrap(binary=binary, max_entries=1) as registry:
        client = registry.client()
        with client.announce("only", "prefill", "127.0.0.1:4567"):
            with pytest.raises(kvt.TransferError) as refused:
                client.announce("second", "prefill", "127.0.0.1:4568")
            assert refused.value.code == "ResourceExhausted"
            assert "--max-entries 1" in str(refused.value)
            assert "prefill 'second' rank 0" in str(refused.value)
            assert [e.name for e in client.lookup()] == ["only"]
    with pytest.raises(ValueError, match=r"max_entries = 0 is out of range \[1, 1048576\]"):
        kvt.start_bootstrap(binary=binary, max_entries=0)
    # The program's own flag check, for those who start it by hand.
    done = subprocess.run([binary, "--max-entries", "0"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0
    assert "--max-entries" in done.stderr and "0 is not allowed" in done.stderr, done.stderr


def test_closing_an_announcement_frees_its_key_at_once() -> None:
    binary = _bootstrap_binary()
    # Entries would live 30 s without their heartbeats: a key free at once was unregistered.
    with kvt.start_bootstrap(binary=binary, heartbeat_ms=10000) as registry:
        client = registry.client()
        first = client.announce("py-closed", "prefill", "127.0.0.1:4567")
        assert [e.control_address for e in client.lookup("py-closed")] == ["127.0.0.1:4567"]
        first.close()
        assert client.lookup("py-closed") == []
        with client.announce("py-closed", "prefill", "127.0.0.1:4568"):
            assert [e.control_address for e in client.lookup("py-closed")] == ["127.0.0.1:4568"]
        assert client.lookup("py-closed") == []
        first.close()  # closing again does nothing
        orphan = registry.client(timeout=0.5).announce("py-orphan", "prefill", "127.0.0.1:4567")
    # The registry is gone: close() waits at most the client's timeout, and does not raise.
    start = time.monotonic()
    orphan.close()
    assert time.monotonic() - start < 3.0
