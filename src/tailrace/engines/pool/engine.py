"""A replica's own engine: open it, describe it, run one batch on it; the replica process.

The same code runs in a replica process (``worker_main``, the target a pool's
``ProcessReplica`` spawns) and on the threads of a thread replica
(``replicas.ThreadReplica``); each replica creates its own engine (``create_engine``),
never the process's shared one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..call import Streamed
from ..models import create_engine
from .messages import (
    BatchResult,
    Cancel,
    Deliver,
    EmbedBatch,
    FromReplica,
    GenerateBatch,
    ItemError,
    Ready,
    Shutdown,
    StartFailed,
    TokenPiece,
)


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def serve(engine: Any, msg: GenerateBatch | EmbedBatch, send: Deliver,
          cancelled: dict[int, set[int]] | None = None) -> BatchResult:
    """Run one batch on ``engine``; a failing batch is rerun one request at a time, so the
    request at fault (say one that overflows the context) fails alone and the other
    callers merged into the batch still get their results.

    send:      where ``TokenPiece`` messages go while the batch runs.
    cancelled: batch id -> indexes of requests whose callers went away (filled in while
               the batch runs): the engine is told to stop them at their next token.
    """
    bid = msg.batch_id
    items: Sequence[Any]
    streamed: dict[int, Streamed] = {}  # request index -> its text sent (reruns skip it)
    run: Callable[[Sequence[Any], Any], Any]
    if isinstance(msg, GenerateBatch):
        items, streamed = msg.requests, {i: Streamed() for i in msg.stream}

        def on_token(i: int, text: str) -> bool:
            mark = streamed.get(i)
            if mark is None:
                return True
            text = mark.fresh(text)
            if text:
                send(TokenPiece(bid, i, text))
            return cancelled is None or i not in cancelled.get(bid, ())

        run, stream_cb = engine.generate, on_token if streamed else None
    else:
        items, stream_cb = msg.texts, None

        def run(batch: Sequence[Any], cb: Any) -> Any:
            return engine.embed(batch)
    try:
        return BatchResult(bid, run(items, stream_cb))
    except Exception as e:
        if len(items) == 1:
            return BatchResult(bid, [None], (ItemError(0, type(e).__name__, one_line(e)),))
    outputs: list[Any] = []
    errors: list[ItemError] = []
    for i, item in enumerate(items):
        if i in streamed:
            streamed[i].restart()
        cb = None if stream_cb is None else (lambda _j, t, i=i: stream_cb(i, t))
        try:
            outputs.append(run([item], cb)[0])
        except Exception as e:
            outputs.append(None)
            errors.append(ItemError(i, type(e).__name__, one_line(e)))
    return BatchResult(bid, outputs, tuple(errors))


def start_engine(spec: dict[str, Any], kind: str,
                 base_url: str | None = None) -> tuple[Any, Ready | StartFailed]:
    """Create a replica's engine: (engine, ``Ready``), or (None, ``StartFailed``) saying why.
    ``base_url``: the endpoint of a remote replica (overrides the spec's)."""
    engine = None
    try:
        engine = create_engine(spec, base_url)
        dim = int(engine.dim) if kind == "embed" else None  # only an embedder has one
        chat = getattr(engine, "chat", None) if kind == "generate" else None
        return engine, Ready(os.getpid(), str(getattr(engine, "model", "")),
                             getattr(engine, "context_length", None), dim, chat)
    except Exception as e:
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.close()
        return None, StartFailed(one_line(e))


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
