"""The prefill process of the example engine: runs each request's fake forward chunk by chunk
and layer by layer into its pool, and hands every layer to kvt as soon as it is written, so the
first layers travel while the next ones are computed.

Announces itself in the registry as "prefill-0". Reads requests from the driver as JSON lines on
stdin ({"room", "tokens", "seed"}), prints one JSON line per finished request, and exits when
stdin closes."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import kvt
from pool import Pool, first_token, forward_bytes, torch

CHUNK_TOKENS = 256  # chunked prefill: a long prompt is computed (and sent) 256 tokens at a time


def prefill(engine: kvt.TransferEngine, pool: Pool, room: str, tokens: int, seed: int) -> dict:
    """One request: allocate its pages, then per chunk declare the chunk's pages (send) and run
    the forward, marking each layer ready as it is written. Returns the JSON reply."""
    pages = pool.alloc(-(-tokens // pool.page_size))
    slot = pool.free_slots.pop()
    chunk_pages = CHUNK_TOKENS // pool.page_size
    chunks = [pages[i:i + chunk_pages] for i in range(0, len(pages), chunk_pages)]
    data = [forward_bytes(seed, b, len(pages), pool.page_bytes())
            for b in range(2 * pool.layer_num)]
    request = None
    events = []  # kvt waits on a room's latest event when it posts: keep them until the end
    try:
        for c, chunk in enumerate(chunks):
            last = c == len(chunks) - 1
            # The aux slot goes with the last chunk; its bytes are written before the last
            # layers_ready of that chunk.
            request = engine.send(room, chunk, is_last=last, aux_slot=slot if last else None)
            rows = slice(c * chunk_pages, c * chunk_pages + len(chunk))
            for layer in range(pool.layer_num):
                for b in (layer, pool.layer_num + layer):  # this layer's K, then its V
                    pool.write_pages(b, chunk, data[b][rows])
                if last and layer == pool.layer_num - 1:
                    pool.aux[slot, :4] = np.frombuffer(
                        np.int32(first_token(seed)).tobytes(), np.uint8)
                event = None
                if pool.cuda_ordinal() >= 0:  # the copy waits for the writes on the GPU
                    event = torch.cuda.Event()
                    event.record()
                    events.append(event)
                engine.layers_ready(room, layer + 1, event)
        state = request.wait(20)
    except (kvt.TransferError, ValueError, TimeoutError) as e:
        # The room may still be reading these pages: they stay out of the free lists.
        return {"room": room, "state": "Failed", "bytes": 0, "error": f"{type(e).__name__}: {e}"}
    reply = {"room": room, "state": state.name, "bytes": request.info().bytes}
    if state != kvt.KVPoll.Success:
        reply["error"] = str(request.failure_exception())
    request.forget()  # final: kvt may drop the room's record
    pool.release(pages)
    pool.free_slots.append(slot)
    return reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--registry", required=True, help="the kvt-bootstrap's host:port")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = ap.parse_args()
    pool = Pool(device=args.device)
    backend = "ucx" if args.device == "cpu" else "cuda_ipc"
    host, port = args.registry.rsplit(":", 1)
    # deadline: a room whose decode side never asks fails after 10 s instead of holding pages.
    with kvt.TransferEngine("prefill", pool.transfer_layout(), backend=backend,
                            deadline=10) as engine, \
            kvt.RegistryClient(host, int(port)).announce(
                "prefill-0", "prefill", f"127.0.0.1:{engine.port}"):
        print(json.dumps({"ready": engine.port}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            print(json.dumps(prefill(engine, pool, req["room"], req["tokens"], req["seed"])),
                  flush=True)


if __name__ == "__main__":
    main()
