"""The prefill process of the example engine: computes ("forward") each request's KV layer by
layer into its pool and hands every layer to kvt as soon as it is written.

Reads requests as JSON lines on stdin ({"room": ..., "tokens": ...}); prints one JSON line per
finished request. Registered in the registry as "prefill-0" for the decode side to find."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import kvt
from pool import AUX_SLOT_BYTES, Pool, first_token, layer_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry", required=True, help="the kvt-bootstrap's host:port")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    pool = Pool(device=args.device)
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    layout = kvt.TransferLayout.from_buf_infos(
        ptrs, lens, item_lens, page_size=pool.page_size, dtype="bf16", head_num=pool.head_num,
        head_dim=pool.head_dim, unit_lens=pool.get_contiguous_buf_unit_lens(),
        device=0 if args.device.startswith("cuda") else -1,
        aux_data_ptrs=[pool.aux.ctypes.data], aux_data_lens=[pool.aux.nbytes],
        aux_item_lens=[AUX_SLOT_BYTES])
    backend = "cuda_ipc" if args.device.startswith("cuda") else "ucx"
    host, port = args.registry.rsplit(":", 1)
    with kvt.TransferEngine("prefill", layout, backend=backend, deadline=30) as engine, \
            kvt.RegistryClient(host, int(port)).announce(
                "prefill-0", "prefill", f"127.0.0.1:{engine.port}"):
        print(json.dumps({"ready": engine.port}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            room, tokens = req["room"], req["tokens"]
            pages = pool.alloc(-(-tokens // pool.page_size))
            slot = pool.free_slots.pop()
            # One send per request (a chunked prefill would send each chunk's pages, is_last on
            # the last one); then the forward, layer by layer.
            request = engine.send(room, pages, aux_slot=slot)
            page_bytes = item_lens[0]
            for layer in range(pool.layers):
                for b in (layer, pool.layers + layer):  # this layer's K and V
                    pool.write_pages(b, pages, layer_bytes(room, b, len(pages), page_bytes))
                if layer == pool.layers - 1:  # the first output token, before the last layer
                    pool.aux[slot, :4] = np.frombuffer(
                        np.int32(first_token(room)).tobytes(), np.uint8)
                engine.layers_ready(room, layer + 1)  # these layers may go now
            state = request.wait(30)
            pool.release(pages)
            pool.free_slots.append(slot)
            print(json.dumps({"room": room, "state": state.name, "bytes": request.info().bytes}),
                  flush=True)


if __name__ == "__main__":
    main()
