"""Engine replicas as the pool sees them: the two transports.

Process topology of one ``EnginePool`` (pool.py)::

    pipeline threads --generate()/embed()--> pool loop thread
        --GenerateBatch/EmbedBatch/Shutdown-->  replica process 0 .. N-1 (spawn; engine.py:
        <--Ready/StartFailed/TokenPiece/BatchResult--  its own engine, serve batches)
    endpoint (or isolation="thread") replicas: one engine per replica in the pool's process,
    batches run on that replica's threads, same messages (messages.py), no pickling.

A transport hands every message it receives to ``deliver``; when a replica process ends,
its transport delivers ``Exited``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .engine import serve, start_engine, worker_main
from .messages import Cancel, Deliver, EmbedBatch, Exited, GenerateBatch, Shutdown, ToReplica


class ProcessReplica:
    """A replica in its own process (multiprocessing "spawn"), reached over a Pipe.

    A reader thread delivers what the worker sends, then ``Exited`` when the pipe closes
    (the process ended, however it ended).
    """

    def __init__(self, spec: dict[str, Any], kind: str, deliver: Deliver, label: str,
                 max_workers: int = 1):
        """Prepare (nothing runs until ``start``) a worker that opens ``spec`` as a
        ``kind`` engine and serves ``max_workers`` batches at once; ``deliver`` gets its
        messages on the reader thread; ``label`` names the process (``tailrace-pool-llm-0``).
        """
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._send_lock = threading.Lock()  # the pool loop and stream readers both send
        self._proc = ctx.Process(target=worker_main,
                                 args=(child, dict(spec), kind, max_workers),
                                 name=label, daemon=True)
        self._child = child
        self._deliver = deliver
        self._reader = threading.Thread(target=self._read, name=f"{label}-reader", daemon=True)

    def start(self) -> None:
        """Spawn the process and start reading its messages."""
        self._proc.start()
        self._child.close()  # only the child holds its end: its death gives us EOF
        self._reader.start()

    def alive(self) -> bool:
        return self._proc.is_alive()

    def send(self, msg: ToReplica) -> None:
        """Send a message; a dead process is reported by ``Exited``, not here."""
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            self._conn.send(msg)

    def request_stop(self) -> None:
        """Ask the worker to exit after its current call (returns at once)."""
        self.send(Shutdown())

    def stop(self, grace_s: float = 2.0) -> None:
        """Wait up to ``grace_s`` for the worker to finish its current call, close its
        engine and exit; then terminate, then kill it."""
        self.request_stop()
        if self._proc.pid is not None:
            self._proc.join(grace_s)
            for end in (self._proc.terminate, self._proc.kill):
                if self._proc.exitcode is not None:
                    break
                end()
                self._proc.join(1.0)
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(2.0)
        self._conn.close()

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            self._deliver(msg)
        self._proc.join(1.0)
        self._deliver(Exited(self._proc.exitcode))


class ThreadReplica:
    """A replica in the pool's own process: its engine runs batches on its own threads.

    Used for remote endpoints (an ``OpenAIEngine`` each) and for ``isolation="thread"``.
    """

    def __init__(self, spec: dict[str, Any], kind: str, deliver: Deliver, label: str,
                 base_url: str | None = None, max_workers: int = 1):
        """Prepare (nothing runs until ``start``) a ``kind`` engine of ``spec`` (at
        ``base_url`` for a remote replica) running ``max_workers`` calls at once on threads
        named ``label``; ``deliver`` gets its messages on those threads."""
        self._spec, self._kind, self._deliver, self._base_url = spec, kind, deliver, base_url
        self._exec = ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix=label)
        self._engine: Any = None
        self._stopped = False
        self._cancelled: dict[int, set[int]] = {}

    def start(self) -> None:
        """Open the engine on a replica thread; ``Ready`` or ``StartFailed`` follows."""
        self._exec.submit(self._open)

    def _open(self) -> None:
        self._engine, ready = start_engine(self._spec, self._kind, self._base_url)
        self._deliver(ready)

    def alive(self) -> bool:
        return not self._stopped

    def send(self, msg: ToReplica) -> None:
        """Run a batch on a replica thread; its ``BatchResult`` is delivered when done."""
        if isinstance(msg, Cancel):
            self._cancelled.setdefault(msg.batch_id, set()).add(msg.index)
            return
        if isinstance(msg, Shutdown) or self._stopped:
            return
        self._exec.submit(self._serve, msg)

    def _serve(self, msg: GenerateBatch | EmbedBatch) -> None:
        try:
            self._deliver(serve(self._engine, msg, self._deliver, self._cancelled))
        finally:
            self._cancelled.pop(msg.batch_id, None)

    def request_stop(self) -> None:
        self._stopped = True

    def stop(self) -> None:
        """Wait for running calls (they end by their timeout), drop queued ones, close the
        engine."""
        self._stopped = True
        self._exec.shutdown(wait=True, cancel_futures=True)
        if self._engine is not None:
            self._engine.close()
            self._engine = None


Replica = ProcessReplica | ThreadReplica
