"""The `kvt` Python package on CUDA pools: what Python adds per request, and kvt from Python
beside torch's own way of moving the same pages. Prints tables and writes JSON (--json).

Two processes on one GPU (spawned: a decode process, which drives and times, and a prefill
process), each with a pool laid out like the reference pool (per-layer K and V tensors of
[size + page_size, heads, head_dim] on cuda:0; default: 32 layers x 8 heads x 128 dims, bf16,
16-token pages = 32 KiB per page per buffer, 2 MiB per page over the 64 buffers), backend
cuda_ipc, random distinct pages on both sides. The prefill side fills its pool with seeded
random bytes; the decode side checks one request of every size with torch.equal.

(a) Python overhead per request (--overhead-pages, default 1 and 16 pages), one request at a
    time. The prefill process calls send(room, pages) and layers_ready(room, L) for a batch of
    rooms before the decode process asks for them; the decode process times, per request, on
    time.monotonic (CLOCK_MONOTONIC, the engine's clock too):
      caller = receive() called -> wait() returned (SUCCESS),
      engine = receive() called -> the engine saw TransferDone (RequestInfo.finished),
      receive() = the receive() call itself, wake-up = finished -> wait() returned.
    The same requests from C++: `kvt-bench transfer --backend cuda_ipc` (--kvt-bench) with the
    same layout, pool size and page size, one request at a time: its one-page latency and its
    whole requests of the larger size; its caller / engine figures are the same two intervals
    around TransferEngine::Receive and WaitRequest (there the prefill engine calls Send and
    LayersReady from on_transfer_request when the request arrives). Python - C++ (caller p50)
    is what the Python layer costs a request end to end.
(b) kvt from Python (the caller figure above; --copy-pages sizes) beside torch in one process:
    for each of the 2L buffers, dst.index_copy_(0, dst_idx, src.index_select(0, src_idx)) of
    the same page lists (index tensors already on the GPU, untimed), timed with CUDA events;
    and one contiguous copy_ of the same bytes (the ceiling). GB/s = request bytes / p50.

Usage: PYTHONPATH=<build>/python python3 python/bench/bench_python.py \
           --kvt-bench <prefix>/bin/kvt-bench --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class Pool:
    """2L CUDA buffers as [num_pages, page_bytes] uint8 views of reference-pool tensors."""

    def __init__(self, torch: Any, cfg: dict):
        self.page_size, self.layers = cfg["page_size"], cfg["layers"]
        self.num_pages = cfg["pages"]
        shape = (self.num_pages * self.page_size, cfg["heads"], cfg["head_dim"])
        self.k = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda:0")
                  for _ in range(self.layers)]
        self.v = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda:0")
                  for _ in range(self.layers)]
        self.views = [t.view(torch.uint8).view(self.num_pages, -1) for t in self.k + self.v]
        self.page_bytes = self.views[0].shape[1]

    def layout(self) -> Any:
        import kvt
        return kvt.TransferLayout.from_tensors(self.k, self.v, page_size=self.page_size)


def buffer_bytes(torch: Any, b: int, pool: Pool) -> Any:
    """The prefill pool's bytes of buffer b (both processes derive them)."""
    gen = torch.Generator(device="cuda:0")
    gen.manual_seed(7919 * (b + 1))
    return torch.randint(0, 256, (pool.num_pages, pool.page_bytes), dtype=torch.uint8,
                         device="cuda:0", generator=gen)


def prefill_main(cfg: dict, cmd_q, reply_q) -> None:
    try:
        import torch
        import kvt

        pool = Pool(torch, cfg)
        for b, view in enumerate(pool.views):
            view.copy_(buffer_bytes(torch, b, pool))
        torch.cuda.synchronize()
        engine = kvt.TransferEngine("prefill", pool.layout(), backend="cuda_ipc",
                                    name="bench-prefill", deadline=60)
        reply_q.put(("port", engine.port))
        sent: list[tuple[np.ndarray, np.ndarray]] = []
        while True:
            cmd = cmd_q.get(timeout=600)
            if cmd[0] == "send":  # [(room, src_pages, dst_pages)]: send them, time the calls
                send_us, ready_us = [], []
                for room, src, dst in cmd[1]:
                    t0 = time.monotonic()
                    engine.send(room, src)
                    t1 = time.monotonic()
                    engine.layers_ready(room, pool.layers)
                    t2 = time.monotonic()
                    send_us.append((t1 - t0) * 1e6)
                    ready_us.append((t2 - t1) * 1e6)
                    if cmd[2]:
                        sent.append((src, dst))
                reply_q.put(("sent", send_us, ready_us))
            elif cmd[0] == "torch":
                reply_q.put(("torch", torch_peer(torch, pool, sent, cmd[1], cmd[2])))
            elif cmd[0] == "stop":
                engine.close()
                reply_q.put(("stopped",))
                return
    except BaseException:  # noqa: BLE001 - report everything to the driver
        reply_q.put(("error", traceback.format_exc()))


def torch_peer(torch: Any, pool: Pool, sent: list, sizes: list[int], warmup: int) -> dict:
    """Per size: the same page lists moved by index_select + index_copy_ per buffer into a
    second pool of this process, and a contiguous copy of the same bytes."""
    dst_views = [torch.zeros_like(v) for v in pool.views]
    out = {}
    for n in sizes:
        lists = [(torch.from_numpy(s.astype(np.int64)).cuda(), torch.from_numpy(d.astype(np.int64)).cuda())
                 for s, d in sent if len(s) == n]
        nbytes = n * pool.page_bytes * len(pool.views)
        times, contiguous = [], []
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        flat_dst = torch.empty_like(flat_src)
        flat_src.random_(0, 256)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i, (src, dst) in enumerate(lists[:warmup] + lists):
            start.record()
            for sv, dv in zip(pool.views, dst_views):
                dv.index_copy_(0, dst, sv.index_select(0, src))
            end.record()
            end.synchronize()
            if i >= warmup:
                times.append(start.elapsed_time(end))
            start.record()
            flat_dst.copy_(flat_src)
            end.record()
            end.synchronize()
            if i >= warmup:
                contiguous.append(start.elapsed_time(end))
        src, dst = lists[-1]
        ok = all(torch.equal(dv.index_select(0, dst), sv.index_select(0, src))
                 for sv, dv in zip(pool.views, dst_views))
        out[str(n)] = {"bytes": nbytes, "requests": len(times),
                       "index_copy_ms_p50": statistics.median(times),
                       "contiguous_ms_p50": statistics.median(contiguous), "verified": ok}
        del flat_src, flat_dst
    return out


def run_cpp(args, cfg: dict) -> dict:
    """kvt-bench transfer on the same layout and pool, one request at a time."""
    n = max(args.overhead_pages)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cpp.json")
        pool_bytes = cfg["pages"] * cfg["page_size"] * cfg["heads"] * cfg["head_dim"] * 2 * \
            2 * cfg["layers"]
        cmd = [args.kvt_bench, "transfer", "--backend", "cuda_ipc", "--page-tokens",
               str(cfg["page_size"]), "--tokens", str(n * cfg["page_size"]), "--iters",
               str(args.requests), "--warmup", str(args.warmup), "--latency-requests",
               str(args.requests), "--inflight", "1", "--layerwise-requests", "0",
               "--peer-items", "1024", "--layers", str(cfg["layers"]), "--heads",
               str(cfg["heads"]), "--head-dim", str(cfg["head_dim"]), "--pool", str(pool_bytes),
               "--json", path]
        print("C++:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"kvt-bench exited {proc.returncode}:\n{proc.stdout[-4000:]}")
        with open(path) as f:
            doc = json.load(f)
    r = doc["results"][0]
    one, big = r["one_page"], r["kvt"]["latency"]
    return {"command": " ".join(cmd[1:]),
            "1": {"caller_us_p50": one["caller_p50"], "engine_us_p50": one["p50"],
                  "caller_us_p99": one["caller_p99"], "requests": one["count"]},
            str(n): {"caller_us_p50": big["caller_p50"] * 1000, "engine_us_p50": big["p50"] * 1000,
                     "caller_us_p99": big["caller_p99"] * 1000, "requests": big["count"]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvt-bench", default="", help="kvt-bench binary for the C++ figures")
    ap.add_argument("--json", default="", help="write every figure to this file")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--pool-pages", type=int, default=4097, help="pages per pool (page 0 incl.)")
    ap.add_argument("--requests", type=int, default=1000, help="timed requests per overhead size")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--overhead-pages", default="1,16")
    ap.add_argument("--copy-pages", default="1,16,256,2048")
    ap.add_argument("--copy-requests", type=int, default=30, help="timed requests per copy size")
    args = ap.parse_args()
    args.overhead_pages = [int(x) for x in args.overhead_pages.split(",")]
    args.copy_pages = [int(x) for x in args.copy_pages.split(",")]

    import torch
    if not torch.cuda.is_available():
        print("torch.cuda.is_available() is False: this benchmark needs a CUDA device",
              file=sys.stderr)
        return 2
    if 2 * max(args.copy_pages + args.overhead_pages) >= args.pool_pages:
        print(f"--pool-pages {args.pool_pages} is too small for requests of "
              f"{max(args.copy_pages + args.overhead_pages)} pages: give at least twice that + 1",
              file=sys.stderr)
        return 2
    import kvt

    cfg = {"layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
           "page_size": args.page_size, "pages": args.pool_pages}
    doc: dict[str, Any] = {
        "tool": "python/bench/bench_python.py", "command": " ".join(sys.argv),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"gpu": torch.cuda.get_device_name(0), "python": platform.python_version(),
                    "torch": torch.__version__, "cpus": os.cpu_count()},
        "config": cfg | {"backend": "cuda_ipc", "dtype": "bf16"}}
    page_bytes = args.page_size * args.heads * args.head_dim * 2 * 2 * args.layers
    doc["config"]["bytes_per_page"] = page_bytes

    cpp = run_cpp(args, cfg) if args.kvt_bench else {}
    doc["cpp"] = cpp

    ctx = mp.get_context("spawn")
    cmd_q, reply_q = ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(target=prefill_main, args=(cfg, cmd_q, reply_q))
    prefill.start()

    def reply(kind: str) -> tuple:
        r = reply_q.get(timeout=600)
        if r[0] != kind:
            raise RuntimeError(f"the prefill process answered {r[0]}: {r[1:]}")
        return r

    try:
        pool = Pool(torch, cfg)
        engine = kvt.TransferEngine("decode", pool.layout(), backend="cuda_ipc",
                                    name="bench-decode", deadline=60)
        peer = engine.connect("127.0.0.1", reply("port")[1])
        rng = np.random.default_rng(3)
        serial = [0]

        def run(n: int, count: int, keep: bool, batch: int = 100) -> dict:
            rows: dict[str, list[float]] = {"receive_us": [], "engine_us": [], "caller_us": [],
                                            "wakeup_us": [], "send_us": [], "layers_ready_us": []}
            done = 0
            verified = None
            while done < count:
                k = min(batch, count - done)
                items = []
                for _ in range(k):
                    serial[0] += 1
                    src = (rng.permutation(pool.num_pages - 1)[:n] + 1).astype(np.int32)
                    dst = (rng.permutation(pool.num_pages - 1)[:n] + 1).astype(np.int32)
                    items.append((f"r{serial[0]}", src, dst))
                cmd_q.put(("send", items, keep))
                _, send_us, ready_us = reply("sent")
                rows["send_us"] += send_us
                rows["layers_ready_us"] += ready_us
                for room, src, dst in items:
                    t0 = time.monotonic()
                    req = engine.receive(room, peer, dst)
                    t1 = time.monotonic()
                    state = req.wait(60)
                    t2 = time.monotonic()
                    info = req.info()
                    if state != kvt.KVPoll.Success:
                        raise RuntimeError(f"room {room}: {state.name} {info.reason}")
                    rows["receive_us"].append((t1 - t0) * 1e6)
                    rows["engine_us"].append((info.finished - t0) * 1e6)
                    rows["caller_us"].append((t2 - t0) * 1e6)
                    rows["wakeup_us"].append((t2 - info.finished) * 1e6)
                    req.forget()
                    last = (src, dst)
                done += k
            if keep:  # the last request's bytes, every buffer
                src, dst = (torch.from_numpy(x.astype(np.int64)).cuda() for x in last)
                verified = all(torch.equal(pool.views[b].index_select(0, dst),
                                           buffer_bytes(torch, b, pool).index_select(0, src))
                               for b in range(len(pool.views)))
            out = {f"{key}_p50": percentile(v, 0.5) for key, v in rows.items()}
            out |= {f"{key}_p99": percentile(v, 0.99) for key, v in rows.items()
                    if key in ("caller_us", "engine_us")}
            out["requests"] = count
            out["bytes"] = n * page_bytes
            out["verified"] = verified
            return out

        overhead = {}
        for n in args.overhead_pages:
            run(n, args.warmup, keep=False)
            overhead[str(n)] = run(n, args.requests, keep=True)
        copies = {}
        for n in args.copy_pages:
            run(n, 3, keep=False)
            copies[str(n)] = run(n, args.copy_requests, keep=True, batch=10)
        cmd_q.put(("torch", args.copy_pages, 3))
        peer_figures = reply("torch")[1]
        cmd_q.put(("stop",))
        reply("stopped")
        engine.close()
    finally:
        prefill.join(60)
        if prefill.is_alive():
            prefill.kill()
    doc["python"] = {"overhead": overhead, "copies": copies}
    doc["torch"] = peer_figures

    print(f"\n{doc['machine']['gpu']}, Python {doc['machine']['python']}, torch "
          f"{doc['machine']['torch']}; {args.layers} layers x {args.heads} heads x "
          f"{args.head_dim} dims bf16, {args.page_size}-token pages ({page_bytes >> 20} MiB per "
          f"page over {2 * args.layers} buffers), cuda_ipc, two processes, one request at a time")
    print("\n(a) per request, p50 microseconds (caller: receive() called -> wait() returned; "
          "engine: -> TransferDone seen)")
    print(f"{'pages':>6} {'C++ caller':>11} {'C++ engine':>11} {'Py caller':>10} "
          f"{'Py engine':>10} {'Py - C++':>9} {'receive()':>10} {'Py wake':>8} {'C++ wake':>9} "
          f"{'send()':>7} {'ready()':>8} {'ok':>3}")
    for n in args.overhead_pages:
        p, c = overhead[str(n)], cpp.get(str(n), {})
        cc, ce = c.get("caller_us_p50", float("nan")), c.get("engine_us_p50", float("nan"))
        print(f"{n:>6} {cc:>11.1f} {ce:>11.1f} {p['caller_us_p50']:>10.1f} "
              f"{p['engine_us_p50']:>10.1f} {p['caller_us_p50'] - cc:>9.1f} "
              f"{p['receive_us_p50']:>10.1f} {p['wakeup_us_p50']:>8.1f} {cc - ce:>9.1f} "
              f"{p['send_us_p50']:>7.1f} {p['layers_ready_us_p50']:>8.1f} "
              f"{'yes' if p['verified'] else 'NO':>3}")
        p["minus_cpp_caller_us_p50"] = p["caller_us_p50"] - cc
        p["ratio_to_cpp_caller"] = p["caller_us_p50"] / cc if cc == cc else None
    print("\n(b) kvt from Python (cuda_ipc, caller p50) vs torch index_select + index_copy_ per "
          "buffer in one process (p50), GB/s")
    print(f"{'pages':>6} {'MiB':>7} {'kvt ms':>8} {'kvt GB/s':>9} {'torch ms':>9} "
          f"{'torch GB/s':>11} {'kvt/torch':>10} {'contig GB/s':>12} {'kvt/contig':>11} {'ok':>5}")
    for n in args.copy_pages:
        k, t = copies[str(n)], peer_figures[str(n)]
        nbytes = k["bytes"]
        kvt_gbps = nbytes / (k["caller_us_p50"] * 1e-6) / 1e9
        torch_gbps = nbytes / (t["index_copy_ms_p50"] * 1e-3) / 1e9
        contig_gbps = nbytes / (t["contiguous_ms_p50"] * 1e-3) / 1e9
        k |= {"gbps": kvt_gbps, "ratio_to_torch_index_copy": kvt_gbps / torch_gbps,
              "ratio_to_contiguous": kvt_gbps / contig_gbps}
        t |= {"index_copy_gbps": torch_gbps, "contiguous_gbps": contig_gbps}
        ok = "yes" if k["verified"] and t["verified"] else "NO"
        print(f"{n:>6} {nbytes / 2**20:>7.0f} {k['caller_us_p50'] / 1000:>8.3f} {kvt_gbps:>9.1f} "
              f"{t['index_copy_ms_p50']:>9.3f} {torch_gbps:>11.1f} {kvt_gbps / torch_gbps:>10.2f} "
              f"{contig_gbps:>12.1f} {kvt_gbps / contig_gbps:>11.3f} {ok:>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    bad = [n for n in args.overhead_pages if not overhead[str(n)]["verified"]] + \
          [n for n in args.copy_pages
           if not (copies[str(n)]["verified"] and peer_figures[str(n)]["verified"])]
    if bad:
        print(f"MISMATCH in the requests of {bad} pages", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
