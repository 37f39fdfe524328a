"""The prefill and decode processes of test_transfer.py (spawned; results go back on queues)."""

from __future__ import annotations

import traceback

import numpy as np

import kvt
from refpool import ReferencePool, page_bytes_for, torch


def _layout(pool: ReferencePool) -> kvt.TransferLayout:
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    aux_ptrs, aux_lens, aux_item_lens = pool.aux_infos()
    return kvt.TransferLayout.from_buf_infos(
        np.array(ptrs, dtype=np.uint64), lens, np.array(item_lens, dtype=np.int64),
        page_size=pool.page_size, dtype=pool.dtype, head_num=pool.head_num,
        head_dim=pool.head_dim, unit_lens=pool.get_contiguous_buf_unit_lens(),
        aux_data_ptrs=aux_ptrs, aux_data_lens=aux_lens, aux_item_lens=aux_item_lens)


def _page_list(pages: list[int], i: int):
    """Page lists in every accepted form: numpy int32, list, torch int64 / int32."""
    form = i % 3
    if form == 0:
        return np.array(pages, dtype=np.int32)
    if form == 1 or torch is None:
        return list(pages)
    return torch.tensor(pages, dtype=torch.int64 if i % 2 else torch.int32)


def aux_bytes_for(room: str, n: int) -> np.ndarray:
    return page_bytes_for(room + "/aux", 0, 1, n)[0]


def prefill_main(cfg: dict, plan: list[dict], port_q, result_q) -> None:
    try:
        pool = ReferencePool(**cfg)
        engine = kvt.TransferEngine("prefill", _layout(pool), name="py-prefill", deadline=30)
        port_q.put(engine.port)
        page_bytes = pool.page_view(0).shape[1]
        free = list(np.random.default_rng(11).permutation(np.arange(1, pool.num_pages)))
        requests = []
        for i, item in enumerate(plan):
            room, n = item["room"], item["pages"]
            pages = [int(free.pop()) for _ in range(n)]
            for b in range(2 * pool.layer_num):
                pool.page_view(b)[pages] = page_bytes_for(room, b, n, page_bytes)
            aux_slot = None
            if item.get("aux") is not None:
                aux_slot = item["aux"]
                pool.aux_view()[aux_slot] = aux_bytes_for(room, pool.aux_view().shape[1])
            chunks = [pages] if not item.get("chunked") else [pages[: n // 2], pages[n // 2:]]
            if item.get("chunked") == "closed by an empty send":
                chunks.append([])  # the chunks hold every page; this one says they are all
            for c, chunk in enumerate(chunks):
                last = c == len(chunks) - 1
                request = engine.send(room, _page_list(chunk, i + c), aux_slot=aux_slot,
                                      is_last=last)
                if not chunk:
                    continue
                if item["mode"] == "layerwise":
                    for layer in range(1, pool.layer_num + 1):
                        engine.layers_ready(room, layer)
                else:
                    engine.layers_ready(room, pool.layer_num)
            requests.append(request)
        states = {r.room: int(r.wait(60)) for r in requests}
        failures = {r.room: str(r.failure_exception()) for r in requests
                    if r.poll() != kvt.KVPoll.Success}
        result_q.put(("ok", {"states": states, "failures": failures, "stats": engine.stats()}))
        port_q.get(timeout=60)  # stay up until the decode side has checked its pool
        engine.close()
    except BaseException:  # noqa: BLE001 - report everything to the test
        result_q.put(("error", traceback.format_exc()))


def decode_main(cfg: dict, plan: list[dict], port_q, result_q) -> None:
    try:
        pool = ReferencePool(**cfg)
        num_buffers = 2 * pool.layer_num
        page_bytes = pool.page_view(0).shape[1]
        # Every page but the dummy page 0 starts with known bytes, to see untouched pages stay.
        initial = [page_bytes_for("initial", b, pool.num_pages, page_bytes)
                   for b in range(num_buffers)]
        for b in range(num_buffers):
            pool.page_view(b)[1:] = initial[b][1:]
        aux_initial = pool.aux_view().copy() if pool.aux else None
        engine = kvt.TransferEngine("decode", _layout(pool), name="py-decode", deadline=30)
        peer = engine.connect("127.0.0.1", port_q.get(timeout=60))
        free = list(np.random.default_rng(22).permutation(np.arange(1, pool.num_pages)))
        requests, placed = [], []
        for i, item in enumerate(plan):
            pages = [int(free.pop()) for _ in range(item["pages"])]
            placed.append(pages)
            requests.append(engine.receive(item["room"], peer, _page_list(pages, i + 1),
                                           aux_slot=item.get("aux"), layers=item.get("layers")))
        states = {r.room: int(r.wait(60)) for r in requests}
        errors = []
        for item, pages, request in zip(plan, placed, requests):
            room = item["room"]
            info = request.info()
            if info.state != kvt.KVPoll.Success:
                errors.append(f"{room}: {info.state.name} {info.reason}")
                continue
            begin, end = item.get("layers") or (0, pool.layer_num)
            for b in range(num_buffers):
                moved = begin <= b % pool.layer_num < end
                want = (page_bytes_for(room, b, len(pages), page_bytes) if moved
                        else initial[b][pages])
                if not pool.equal_pages(b, pages, want):
                    errors.append(f"{room}: buffer {b} pages {pages} differ "
                                  f"({'moved' if moved else 'outside the layer range'})")
            if item.get("aux") is not None:
                got = pool.aux_view()[item["aux"]]
                if not np.array_equal(got, aux_bytes_for(room, got.shape[0])):
                    errors.append(f"{room}: aux slot {item['aux']} differs")
        used = {p for pages in placed for p in pages}
        untouched = [p for p in range(1, pool.num_pages) if p not in used]
        for b in range(num_buffers):
            if not pool.equal_pages(b, untouched, initial[b][untouched]):
                errors.append(f"buffer {b}: an untouched page changed")
            if pool.page_view(b)[0].any():
                errors.append(f"buffer {b}: the dummy page 0 was written")
        if aux_initial is not None:
            slots = {item["aux"] for item in plan if item.get("aux") is not None}
            for s in range(aux_initial.shape[0]):
                if s not in slots and not np.array_equal(pool.aux_view()[s], aux_initial[s]):
                    errors.append(f"aux slot {s} changed")
        result_q.put(("ok", {"states": states, "errors": errors, "stats": engine.stats(),
                             "checked_pages": len(used)}))
        engine.close()
    except BaseException:  # noqa: BLE001
        result_q.put(("error", traceback.format_exc()))


def idle_prefill_main(cfg: dict, port_q, busy_poll: float = 0.0) -> None:
    """A prefill engine that accepts requests and never sends (to be killed by the test)."""
    import time

    pool = ReferencePool(**cfg)
    engine = kvt.TransferEngine("prefill", _layout(pool), name="py-doomed", deadline=60,
                                control_busy_poll=busy_poll)
    port_q.put(engine.port)
    time.sleep(120)
    engine.close()
