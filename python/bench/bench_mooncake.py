"""kvt.compat.mooncake beside kvt's page-id API, on the same pools and the same pages.

Two processes (spawned), each with a pool laid out like the reference pool: 2L buffers (K of
every layer, then V) of --pages pages of (page_size x heads x head_dim x 2 bytes) each, in host
memory (numpy) or on cuda:0 (--device cuda, torch). The "decode" process's pool receives; the
"prefill" process's pool is filled with seeded random bytes. Random distinct pages on both
sides; one request at a time; --iters requests per size after --warmup.

- page-id API: the decode process calls receive(room, peer, dst_pages) and wait(); the prefill
  process has already called send(room, src_pages) and layers_ready(room, L). Timed in the
  decode process from receive() to wait() returning Success (what an engine waits for).
- Mooncake surface: the prefill process calls batch_transfer_sync(session, src_addrs,
  dst_addrs, lengths) with one descriptor per page per buffer, as tokenspeed builds them
  (numpy, untimed), and it returns when the bytes are visible at the peer. Timed around the
  call. With scattered pages nothing coalesces (runs = descriptors); "contiguous" requests
  (--contiguous) coalesce into one run per buffer.

Both move exactly the same bytes between the same memory; the page-id API also carries the
decode side's request and the done message (which the Mooncake surface leaves to its caller).
Prints a table; --json writes the figures.

Usage: PYTHONPATH=<build>/python python3 python/bench/bench_mooncake.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time
import traceback
from typing import Any

import numpy as np


def _pool(cfg: dict, fill_seed: int | None) -> tuple[list[Any], list[int], int]:
    """2L buffers (numpy or torch CUDA), their pointers, and the page bytes."""
    item = cfg["page_size"] * cfg["heads"] * cfg["head_dim"] * 2
    n = cfg["pages"] * item
    if cfg["device"] == "cuda":
        import torch

        gen = torch.Generator(device="cuda")
        bufs = []
        for b in range(2 * cfg["layers"]):
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            if fill_seed is None:
                t.fill_(0)
            else:
                gen.manual_seed(fill_seed + b)
                t.random_(0, 256, generator=gen)
            bufs.append(t)
        torch.cuda.synchronize()
        return bufs, [t.data_ptr() for t in bufs], item
    rng = np.random.default_rng(fill_seed or 0)
    # np.full writes every byte: np.zeros maps pages lazily, and a first write into each page
    # would be timed (about 2 ms per 512 KiB request here), which a serving engine's pool,
    # touched when it was made, never pays.
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) if fill_seed is not None
            else np.full(n, 0, np.uint8) for _ in range(2 * cfg["layers"])]
    return bufs, [b.ctypes.data for b in bufs], item


def _layout(cfg: dict, ptrs: list[int], item: int):
    import kvt

    n = cfg["pages"] * item
    return kvt.TransferLayout.from_buf_infos(
        ptrs, [n] * len(ptrs), [item] * len(ptrs), page_size=cfg["page_size"], dtype="bf16",
        head_num=cfg["heads"], head_dim=cfg["head_dim"],
        device=0 if cfg["device"] == "cuda" else -1)


def _plan(cfg: dict) -> list[dict]:
    """Per size, --warmup + --iters requests of distinct random (or contiguous) pages."""
    rng = np.random.default_rng(7)
    plan = []
    for size in cfg["sizes"]:
        for i in range(cfg["warmup"] + cfg["iters"]):
            if cfg["contiguous"]:
                s0 = int(rng.integers(1, cfg["pages"] - size + 1))
                d0 = int(rng.integers(1, cfg["pages"] - size + 1))
                src, dst = list(range(s0, s0 + size)), list(range(d0, d0 + size))
            else:
                src = rng.choice(np.arange(1, cfg["pages"]), size, replace=False).tolist()
                dst = rng.choice(np.arange(1, cfg["pages"]), size, replace=False).tolist()
            plan.append({"room": f"r{size}-{i}", "size": size, "timed": i >= cfg["warmup"],
                         "src": src, "dst": dst})
    return plan


def _backend(cfg: dict) -> str:
    return "cuda_ipc" if cfg["device"] == "cuda" else "ucx"


def decode_main(cfg: dict, plan: list[dict], inbox, outbox) -> None:
    try:
        import kvt
        from kvt.compat.mooncake import TransferEngine as MooncakeEngine

        bufs, ptrs, item = _pool(cfg, None)
        engine = kvt.TransferEngine("decode", _layout(cfg, ptrs, item), backend=_backend(cfg),
                                    deadline=60)
        compat = MooncakeEngine("127.0.0.1", raise_errors=True)
        for p in ptrs:
            compat.register(p, cfg["pages"] * item)
        outbox.put(("ready", compat.get_session_id(), ptrs))
        port = inbox.get(timeout=60)
        peer = engine.connect("127.0.0.1", port)
        times: dict[int, list[float]] = {}
        for item_plan in plan:
            t0 = time.perf_counter()
            request = engine.receive(item_plan["room"], peer, item_plan["dst"])
            state = request.wait(60)
            t1 = time.perf_counter()
            if state != kvt.KVPoll.Success:
                raise RuntimeError(f"{item_plan['room']}: {request.failure_exception()}")
            if item_plan["timed"]:
                times.setdefault(item_plan["size"], []).append(t1 - t0)
        outbox.put(("page-api", times))
        inbox.get(timeout=600)  # the Mooncake-surface phase runs from the prefill process
        engine.close()
        compat.close()
        outbox.put(("done", None))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))


def prefill_main(cfg: dict, plan: list[dict], inbox, outbox) -> None:
    try:
        import kvt
        from kvt.compat.mooncake import TransferEngine as MooncakeEngine

        bufs, ptrs, item = _pool(cfg, 11)
        engine = kvt.TransferEngine("prefill", _layout(cfg, ptrs, item), backend=_backend(cfg),
                                    deadline=60)
        compat = MooncakeEngine("127.0.0.1", raise_errors=True)
        for p in ptrs:
            compat.register(p, cfg["pages"] * item)
        session, dst_ptrs = inbox.get(timeout=60)
        for item_plan in plan:  # sends may come before the decode side's requests
            engine.send(item_plan["room"], item_plan["src"])
            engine.layers_ready(item_plan["room"], cfg["layers"])
        outbox.put(("port", engine.port))
        inbox.get(timeout=600)  # the page-id phase is over
        src_base = np.array(ptrs, np.uint64)[:, None]
        dst_base = np.array(dst_ptrs, np.uint64)[:, None]
        times: dict[int, list[float]] = {}
        runs: dict[int, int] = {}
        for item_plan in plan:
            sp = np.asarray(item_plan["src"], np.uint64)[None, :] * np.uint64(item)
            dp = np.asarray(item_plan["dst"], np.uint64)[None, :] * np.uint64(item)
            src_addrs, dst_addrs = (src_base + sp).ravel(), (dst_base + dp).ravel()
            lengths = np.full(src_addrs.size, item, np.uint64)
            before = compat.stats()["runs"]
            t0 = time.perf_counter()
            compat.batch_transfer_sync(session, src_addrs, dst_addrs, lengths)
            t1 = time.perf_counter()
            if item_plan["timed"]:
                times.setdefault(item_plan["size"], []).append(t1 - t0)
                runs[item_plan["size"]] = compat.stats()["runs"] - before
        outbox.put(("mooncake", times, runs))
        engine.close()
        compat.close()
    except BaseException:
        outbox.put(("error", traceback.format_exc()))


def _get(q, what: str, timeout: float = 600):
    got = q.get(timeout=timeout)
    if got[0] == "error":
        raise RuntimeError(f"{what} process failed:\n{got[1]}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["host", "cuda"], default="host")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--contiguous", action="store_true")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if max(args.sizes) >= args.pages:
        ap.error(f"--sizes up to {max(args.sizes)} need --pages > that (got {args.pages})")
    cfg = {"device": args.device, "layers": args.layers, "heads": args.heads,
           "head_dim": args.head_dim, "page_size": args.page_size, "pages": args.pages,
           "sizes": args.sizes, "iters": args.iters, "warmup": args.warmup,
           "contiguous": args.contiguous}
    plan = _plan(cfg)
    ctx = mp.get_context("spawn")
    to_d, from_d, to_p, from_p = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    decode = ctx.Process(target=decode_main, args=(cfg, plan, to_d, from_d))
    prefill = ctx.Process(target=prefill_main, args=(cfg, plan, to_p, from_p))
    decode.start()
    prefill.start()
    try:
        _, session, dst_ptrs = _get(from_d, "decode", 120)
        to_p.put((session, dst_ptrs))
        _, port = _get(from_p, "prefill", 300)
        to_d.put(port)
        _, page_api = _get(from_d, "decode")
        to_p.put("go")
        _, mooncake, runs = _get(from_p, "prefill")
        to_d.put("done")
        _get(from_d, "decode", 60)
    finally:
        for proc in (decode, prefill):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    item = args.page_size * args.heads * args.head_dim * 2
    rows = []
    print(f"{'pages':>6} {'MiB':>8} {'descr':>6} {'runs':>6} {'page-id p50 us':>15} "
          f"{'GB/s':>7} {'mooncake p50 us':>16} {'GB/s':>7} {'mooncake/page-id':>17}")
    for size in args.sizes:
        nbytes = size * item * 2 * args.layers
        p = statistics.median(page_api[size])
        m = statistics.median(mooncake[size])
        row = {"pages": size, "bytes": nbytes, "descriptors": size * 2 * args.layers,
               "runs": runs[size], "page_api_p50_us": p * 1e6, "page_api_gbps": nbytes / p / 1e9,
               "mooncake_p50_us": m * 1e6, "mooncake_gbps": nbytes / m / 1e9,
               "mooncake_over_page_api_speed": p / m}
        rows.append(row)
        print(f"{size:>6} {nbytes / 2**20:>8.2f} {row['descriptors']:>6} {row['runs']:>6} "
              f"{row['page_api_p50_us']:>15.1f} {row['page_api_gbps']:>7.2f} "
              f"{row['mooncake_p50_us']:>16.1f} {row['mooncake_gbps']:>7.2f} "
              f"{row['mooncake_over_page_api_speed']:>17.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "machine": platform.node(), "cpu": platform.processor(),
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
