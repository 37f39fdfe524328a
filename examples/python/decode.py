"""The decode process of the example engine: reserves pages for each request, asks the prefill
engine (found in the registry) for them, and checks every byte that arrived, the first token in
its aux slot, and that no other page changed.

Reads requests as JSON lines on stdin; prints one JSON line per request."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import kvt
from pool import AUX_SLOT_BYTES, Pool, first_token, layer_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry", required=True)
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
    prefill = kvt.RegistryClient(host, int(port)).lookup(name="prefill-0", role="prefill")
    if not prefill:
        raise SystemExit("no prefill-0 in the registry")
    with kvt.TransferEngine("decode", layout, backend=backend, deadline=30) as engine:
        peer = engine.connect(*prefill[0].host_port)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            room, tokens = req["room"], req["tokens"]
            before = [pool.page_bytes(b).copy() for b in range(2 * pool.layers)]
            pages = pool.alloc(-(-tokens // pool.page_size))
            slot = pool.free_slots.pop()
            request = engine.receive(room, peer, np.array(pages, np.int32), aux_slot=slot)
            state = request.wait(30)
            errors = [] if state == kvt.KVPoll.Success else [str(request.failure_exception())]
            for b in range(2 * pool.layers):
                got = pool.page_bytes(b)
                want = layer_bytes(room, b, len(pages), item_lens[b]).reshape(len(pages), -1)
                if not np.array_equal(got[pages], want):
                    errors.append(f"buffer {b}: the request's pages differ")
                others = np.setdiff1d(np.arange(pool.pages + 1), pages)
                if not np.array_equal(got[others], before[b][others]):
                    errors.append(f"buffer {b}: a page outside the request changed")
            token = int(np.frombuffer(pool.aux[slot, :4].tobytes(), np.int32)[0])
            if token != first_token(room):
                errors.append(f"aux slot {slot}: first token {token}, sent {first_token(room)}")
            pool.release(pages)  # a real engine keeps them for decoding; the example recycles
            pool.free_slots.append(slot)
            print(json.dumps({"room": room, "state": state.name, "pages": len(pages),
                              "bytes": request.info().bytes, "errors": errors}), flush=True)


if __name__ == "__main__":
    main()
