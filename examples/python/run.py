"""The example in one command: a registry (kvt-bootstrap), a prefill process and a decode
process of a minimal engine, and a driver that routes a few requests to both and checks what
the decode side verified. Exits 0 when every byte of every request arrived.

    PYTHONPATH=build/python python3 examples/python/run.py [--device cuda]

(from a kvt build folder; or with the `kvt` package installed by pip)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import kvt
except ImportError as e:
    raise SystemExit(f"cannot import kvt ({e}): run from a kvt build with "
                     "PYTHONPATH=<build>/python, or pip install kvt from python/ (docs/python.md)")

# (room, tokens): one token up to several pages; page_size is 16 tokens in pool.py.
REQUESTS = [("req-1", 1), ("req-2", 16), ("req-3", 17), ("req-4", 250), ("req-5", 64),
            ("req-6", 1000)]


def spawn(script: str, registry: str, device: str) -> subprocess.Popen:
    # The children import the same kvt as this process, wherever it came from.
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(kvt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, os.path.join(HERE, script), "--registry", registry,
                             "--device", device], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=HERE, env=env)


def reply(proc: subprocess.Popen, what: str, timeout: float = 60) -> dict:
    """The process's next JSON line (its other output goes to our stderr)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{what} exited with {proc.wait()} before answering")
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"{what} did not answer in {timeout} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (torch CUDA tensors over "
                    "CUDA IPC)")
    args = ap.parse_args()
    with kvt.start_bootstrap() as bootstrap:
        prefill = spawn("prefill.py", bootstrap.address, args.device)
        decode = None
        try:
            reply(prefill, "the prefill process")  # registered: the decode side can find it
            decode = spawn("decode.py", bootstrap.address, args.device)
            reply(decode, "the decode process")
            ok = True
            for room, tokens in REQUESTS:  # the router: each request to both sides
                for proc in (decode, prefill):
                    proc.stdin.write(json.dumps({"room": room, "tokens": tokens}) + "\n")
                    proc.stdin.flush()
                got = reply(decode, "the decode process")
                sent = reply(prefill, "the prefill process")
                good = got["state"] == "Success" and not got["errors"]
                ok &= good
                print(f"{room}: {tokens:5d} tokens, {got['pages']:3d} pages, "
                      f"{got['bytes']:9d} bytes: {got['state']}"
                      + ("" if good else f" {got['errors']}") + f" (prefill: {sent['state']})")
            print("every byte arrived" if ok else "FAILED")
            return 0 if ok else 1
        finally:
            for proc in (decode, prefill):
                if proc is not None:
                    proc.stdin.close()
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        proc.kill()


if __name__ == "__main__":
    sys.exit(main())
