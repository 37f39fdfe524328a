"""The target process of test_compat_mooncake.py: an engine whose registered host buffers a peer
writes into. Commands arrive on a queue; answers go back on another (spawned process)."""

from __future__ import annotations

import traceback

import numpy as np

from kvt.compat.mooncake import TransferEngine

FILL = 0xEE  # what untouched bytes hold


def target_main(sizes: list[int], options: dict, commands, answers) -> None:
    """Registers one buffer per size, answers ("ready", session id, pointers), then serves
    ("dump",) -> the buffers' bytes, ("register", sizes) -> new pointers,
    ("deregister", ptr) -> the call's result, ("exit",)."""
    try:
        engine = TransferEngine("127.0.0.1", raise_errors=True, **options)
        buffers = [np.full(n, FILL, dtype=np.uint8) for n in sizes]
        for b in buffers:
            engine.register(b.ctypes.data, b.nbytes)
        answers.put(("ready", engine.get_session_id(), [b.ctypes.data for b in buffers]))
        while True:
            command = commands.get(timeout=120)
            if command[0] == "dump":
                answers.put(("ok", [b.copy() for b in buffers]))
            elif command[0] == "register":
                more = [np.full(n, FILL, dtype=np.uint8) for n in command[1]]
                for b in more:
                    engine.register(b.ctypes.data, b.nbytes)
                buffers.extend(more)
                answers.put(("ok", [b.ctypes.data for b in more]))
            elif command[0] == "deregister":
                answers.put(("ok", engine.deregister(command[1])))
            else:
                engine.close()
                answers.put(("ok", None))
                return
    except BaseException:  # the test reads the trace instead of waiting for its timeout
        answers.put(("error", traceback.format_exc()))
