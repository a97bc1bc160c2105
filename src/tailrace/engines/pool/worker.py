"""The replica process: the target a pool's ``ProcessReplica`` spawns.

It opens its own engine, says ``Ready`` (or ``StartFailed``), then serves the batches it
receives over its Pipe, several at once on threads, until ``Shutdown`` or the pool is gone.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .engine import serve, start_engine
from .messages import Cancel, EmbedBatch, FromReplica, GenerateBatch, Shutdown


def worker_main(conn: Any, spec: dict[str, Any], kind: str, workers: int = 1) -> None:
    """A replica process: open the ``kind`` engine of ``spec``, say Ready on ``conn`` (its
    end of the pool's Pipe), serve batches until Shutdown or EOF. ``workers``: batches
    served at once, each on its own thread (an engine that batches continuously, like
    llama.cpp's, decodes them together)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    engine, ready = start_engine(dict(spec), kind)
    conn.send(ready)
    if engine is None:
        return
    lock = threading.Lock()  # one message at a time on the pipe

    def send(m: FromReplica) -> None:
        with lock:
            conn.send(m)

    cancelled: dict[int, set[int]] = {}

    def handle(m: GenerateBatch | EmbedBatch) -> None:
        try:
            send(serve(engine, m, send, cancelled))
        finally:
            cancelled.pop(m.batch_id, None)

    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="replica")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the pool is gone: exit rather than linger
                break
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, Cancel):
                cancelled.setdefault(msg.batch_id, set()).add(msg.index)
                continue
            pool.submit(handle, msg)
    finally:
        pool.shutdown(wait=True)  # batches already taken finish before the engine closes
        engine.close()
