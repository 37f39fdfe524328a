"""The extension in a process with other extensions: it exports its entry point only, so
libraries it carries (fmt, spdlog, protobuf) never bind to another extension's copies."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import kvt


def test_the_extension_exports_its_module_entry_point_only() -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", kvt._kvt.__file__], check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[-1] == "PyInit__kvt" and len(out) == 3, out[:30]


@pytest.mark.parametrize("order", ["import kvt, torch, torch.nn", "import torch, torch.nn, kvt"])
def test_kvt_and_torch_import_in_either_order(order: str) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is not installed")
    code = f"{order}; print(kvt.backend_names())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loopback" in done.stdout
