"""The example in one command: a registry (kvt-bootstrap), the prefill and the decode process of
a minimal engine, and a router that sends a few requests to both and collects what the decode
side verified. Exits 0 only when every byte of every request arrived.

    PYTHONPATH=build/python python3 examples/python/run.py [--device cuda]

from a kvt build folder (or with the package installed: pip install python/)."""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

try:
    import kvt
except ImportError as e:
    raise SystemExit(
        f"cannot import kvt ({e}). From a kvt build folder run "
        f"PYTHONPATH=build/python {os.path.basename(sys.executable)} examples/python/run.py "
        "(cmake --build build --target kvt_python kvt-bootstrap builds what it needs), or "
        "install the package: pip install --no-build-isolation python/ (docs/python.md)")

from pool import check_device  # noqa: E402 (needs kvt on the path)

# (tokens, what it shows); page_size is 16 tokens and prefill.py sends 256-token chunks.
REQUESTS = [(1, "one token in one page"), (16, "one full page"), (17, "a page and a token"),
            (250, "one chunk"), (1000, "four chunks, 63 pages"), (64, "four pages")]
STEP_TIMEOUT = 30.0  # seconds any process may take to answer


class Child:
    """A spawned process of the example and its JSON replies; a thread reads its stdout so
    that every wait for a reply is bounded."""

    def __init__(self, script: str, registry: str, device: str, env: dict[str, str]):
        self.name = script
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), "--registry", registry, "--device",
             device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE, env=env)
        self.replies: queue.Queue[Optional[dict]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.replies.put(json.loads(line))
        self.replies.put(None)  # exited

    def ask(self, request: dict) -> None:
        """Routes a request to the process."""
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        """The next reply; SystemExit when the process exits or stays silent."""
        try:
            got = self.replies.get(timeout=STEP_TIMEOUT)
        except queue.Empty:
            raise SystemExit(f"{self.name} did not answer in {STEP_TIMEOUT} s") from None
        if got is None:
            raise SystemExit(f"{self.name} exited with {self.proc.wait()} before answering "
                             "(its error is above)")
        return got

    def stop(self) -> None:
        """Closes its stdin (it exits at the end of its input); kills it after 20 s."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu",
                    help="cpu (host pools over UCX), or cuda / cuda:N (torch CUDA tensors over "
                         "CUDA IPC)")
    ap.add_argument("--seed", type=int, default=1, help="request i's bytes come from seed + i")
    ap.add_argument("--verbose", action="store_true", help="kvt's info logs (default: warnings)")
    args = ap.parse_args()
    error = check_device(args.device)
    if error:
        raise SystemExit(error)
    # The children import the same kvt as this process, wherever it came from.
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(kvt.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if not args.verbose:
        env.setdefault("KVT_LOG_LEVEL", "warn")

    with kvt.start_bootstrap() as bootstrap:  # exits with this process at the latest
        children: list[Child] = []
        try:
            prefill = Child("prefill.py", bootstrap.address, args.device, env)
            children.append(prefill)
            prefill.reply()  # announced: the decode side can find it
            decode = Child("decode.py", bootstrap.address, args.device, env)
            children.append(decode)
            decode.reply()  # connected
            ok = True
            for i, (tokens, what) in enumerate(REQUESTS):
                request = {"room": f"req-{i}", "tokens": tokens, "seed": args.seed + i}
                decode.ask(request)  # the decode side reserves pages and asks for the KV,
                prefill.ask(request)  # the prefill side computes it
                got, sent = decode.reply(), prefill.reply()
                good = got["state"] == "Success" and sent["state"] == "Success" and \
                    not got["errors"]
                ok &= good
                print(f"{request['room']}: {tokens:5d} tokens {got['pages']:3d} pages "
                      f"{got['bytes']:9d} bytes  {got['state']:7s} ({what})")
                problems = got["errors"] + ([sent["error"]] if "error" in sent else [])
                for problem in problems[:4]:
                    print(f"    {problem}")
                if len(problems) > 4:
                    print(f"    and {len(problems) - 4} more")
            print("every byte arrived" if ok else "FAILED: see the requests above")
            return 0 if ok else 1
        finally:
            for child in reversed(children):  # the decode side first, then the prefill side
                child.stop()


if __name__ == "__main__":
    started = time.monotonic()
    rc = main()
    if rc == 0:
        print(f"done in {time.monotonic() - started:.1f} s")
    sys.exit(rc)
