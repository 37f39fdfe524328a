"""The bootstrap registry from Python: start kvt-bootstrap, announce an agent, look it up."""

from __future__ import annotations

import os

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
