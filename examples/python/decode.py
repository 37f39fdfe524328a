"""The decode process of the example engine: finds the prefill engine in the registry, and for
each request reserves pages and an aux slot, asks kvt for the request's KV, polls until it is
there, and checks every byte against the seed the driver gave, the first token in the aux slot,
and that no page outside the request changed.

Reads requests from the driver as JSON lines on stdin ({"room", "tokens", "seed"}), prints one
JSON line per request, and exits when stdin closes."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import kvt
from pool import Pool, first_token, forward_bytes

POLL_TIMEOUT = 20.0  # seconds a request may take before the example calls it lost


def decode(engine: kvt.TransferEngine, peer: kvt.Peer, pool: Pool, room: str, tokens: int,
           seed: int) -> dict:
    """One request: receive it into fresh pages, poll until final, verify. Returns the JSON
    reply; ``errors`` is empty only when every byte is right."""
    before = [pool.read_pages(b) for b in range(2 * pool.layer_num)]
    pages = pool.alloc(-(-tokens // pool.page_size))
    slot = pool.free_slots.pop()
    request = engine.receive(room, peer, np.array(pages, np.int32), aux_slot=slot)
    # A serving engine polls from its scheduler loop (SGLang's KVPoll); wait() would block.
    end = time.monotonic() + POLL_TIMEOUT
    state = request.poll()
    while state not in (kvt.KVPoll.Success, kvt.KVPoll.Failed) and time.monotonic() < end:
        time.sleep(0.001)
        state = request.poll()
    info = request.info()
    errors = []
    if state == kvt.KVPoll.Failed:
        errors.append(str(request.failure_exception()))
    elif state != kvt.KVPoll.Success:
        request.abort(f"not final after {POLL_TIMEOUT} s")
        errors.append(f"still {state.name} after {POLL_TIMEOUT} s; aborted")
    others = np.setdiff1d(np.arange(pool.num_pages), pages)
    for b in range(2 * pool.layer_num):
        got = pool.read_pages(b)
        want = forward_bytes(seed, b, len(pages), pool.page_bytes())
        wrong = np.flatnonzero((got[pages] != want).any(axis=1))
        if state == kvt.KVPoll.Success and wrong.size:
            errors.append(f"buffer {b}: {wrong.size} of {len(pages)} pages differ from seed "
                          f"{seed}, the first at request page {wrong[0]} (pool page "
                          f"{pages[wrong[0]]})")
        changed = others[(got[others] != before[b][others]).any(axis=1)]
        if changed.size:
            errors.append(f"buffer {b}: {changed.size} pages outside the request changed, "
                          f"the first is pool page {changed[0]}")
    token = int(pool.aux[slot, :4].view(np.int32)[0])
    if state == kvt.KVPoll.Success and token != first_token(seed):
        errors.append(f"aux slot {slot}: first token {token}, the prefill wrote "
                      f"{first_token(seed)}")
    if state == kvt.KVPoll.Success or request.info().pages_reusable:
        # A real engine now decodes into these pages; the example recycles them. Pages of a
        # failed request whose writes may still land (pages_reusable False) stay reserved.
        pool.release(pages)
        pool.free_slots.append(slot)
        request.forget()  # final and quiet: kvt may drop the room's record
    return {"room": room, "state": state.name, "pages": len(pages), "bytes": info.bytes,
            "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--registry", required=True, help="the kvt-bootstrap's host:port")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = ap.parse_args()
    pool = Pool(device=args.device)
    backend = "ucx" if args.device == "cpu" else "cuda_ipc"
    host, port = args.registry.rsplit(":", 1)
    found = kvt.RegistryClient(host, int(port)).lookup(name="prefill-0", role="prefill")
    if not found:
        raise SystemExit(f"no prefill engine named prefill-0 in the registry at {args.registry}; "
                         "start prefill.py first (run.py does)")
    with kvt.TransferEngine("decode", pool.transfer_layout(), backend=backend,
                            deadline=10) as engine:
        peer = engine.connect(*found[0].host_port)  # the hello compares both layouts
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            print(json.dumps(decode(engine, peer, pool, req["room"], req["tokens"],
                                    req["seed"])), flush=True)


if __name__ == "__main__":
    main()
