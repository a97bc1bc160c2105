"""Engine replicas: the messages between a pool and its replicas, and the two transports.

Process topology of one ``EnginePool`` (pool.py)::

    pipeline threads --generate()/embed()--> pool loop thread
        --GenerateBatch/EmbedBatch/Shutdown-->  replica process 0 .. N-1 (spawn; worker_main:
        <--Ready/StartFailed/TokenPiece/BatchResult--  open_engine(spec), serve batches)
    endpoint (or isolation="thread") replicas: one engine per replica in the pool's process,
    batches run on that replica's threads, same messages, no pickling.

Messages are small frozen dataclasses grouped by direction. A transport hands every message
it receives to ``deliver``; when a replica process ends, its transport delivers ``Exited``.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..engines.base import GenerationRequest
from ..engines.registry import BACKENDS, open_engine
from ..errors import EngineError

# -- down: pool -> replica -------------------------------------------------------------


@dataclass(frozen=True)
class GenerateBatch:
    """Run ``requests`` as one engine call; stream the pieces of the requests in ``stream``."""

    batch_id: int
    requests: tuple[GenerationRequest, ...]
    stream: tuple[int, ...] = ()


@dataclass(frozen=True)
class EmbedBatch:
    """Embed ``texts`` as one engine call."""

    batch_id: int
    texts: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    """Finish the current call, close the engine and exit."""


@dataclass(frozen=True)
class Cancel:
    """The caller of request ``index`` of batch ``batch_id`` went away: stop generating it."""

    batch_id: int
    index: int


ToReplica = GenerateBatch | EmbedBatch | Shutdown | Cancel

# -- up: replica -> pool ---------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine is open: the replica is healthy and takes batches."""

    pid: int
    model: str
    context_length: int | None = None
    dim: int | None = None
    chat: bool | None = None  # a generation engine that takes chat messages


@dataclass(frozen=True)
class StartFailed:
    """The engine could not be opened; ``error`` says why (one line)."""

    error: str


@dataclass(frozen=True)
class TokenPiece:
    """A piece of text of request ``index`` of batch ``batch_id``, as it is produced."""

    batch_id: int
    index: int
    text: str


@dataclass(frozen=True)
class ItemError:
    """Request ``index`` of a batch failed: ``kind`` is the exception class name."""

    index: int
    kind: str
    message: str


@dataclass(frozen=True)
class BatchResult:
    """The outputs of batch ``batch_id`` in request order (None where ``errors`` has one).

    outputs: ``list[Generation | None]`` for generation; for embedding a float32 array with
             one row per text (or a list of rows, None where a text failed).
    """

    batch_id: int
    outputs: Any
    errors: tuple[ItemError, ...] = ()


@dataclass(frozen=True)
class Exited:
    """The replica process ended (sent by the transport, not the worker)."""

    exitcode: int | None


FromReplica = Ready | StartFailed | TokenPiece | BatchResult | Exited
Deliver = Callable[[FromReplica], None]

# -- serving ----------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def describe(engine: Any, kind: str) -> Ready:
    """The ``Ready`` message for an open engine.

    engine: the engine just opened.
    kind:   ``"generate"`` or ``"embed"`` (only an embedder is asked its ``dim``).
    """
    dim = int(engine.dim) if kind == "embed" else None
    chat = getattr(engine, "chat", None) if kind == "generate" else None
    return Ready(os.getpid(), str(getattr(engine, "model", "")),
                 getattr(engine, "context_length", None), dim, chat)


def serve(engine: Any, msg: GenerateBatch | EmbedBatch, send: Deliver,
          cancelled: dict[int, set[int]] | None = None) -> BatchResult:
    """Run one batch on ``engine``; a failing batch is rerun one request at a time.

    engine:    an open generation or embedding engine.
    msg:       the batch to run.
    send:      where ``TokenPiece`` messages go while the batch runs.
    cancelled: batch id -> indexes of requests whose callers went away (filled in while
               the batch runs): the engine is told to stop them at their next token.

    Rerunning singly isolates the request at fault (say one that overflows the context),
    so the other callers merged into the same batch still get their results.
    """
    bid = msg.batch_id
    items: Sequence[Any]
    delivered: dict[int, int] = {}  # request index -> characters sent (reruns skip them)
    seen: dict[int, int] = {}
    on_token: Callable[[int, str], bool] | None = None
    if isinstance(msg, GenerateBatch):
        items, wanted = msg.requests, frozenset(msg.stream)

        def on_token(i: int, text: str) -> bool:
            if i not in wanted:
                return True
            start, end = seen.get(i, 0), seen.get(i, 0) + len(text)
            seen[i] = end
            if end > delivered.get(i, 0):
                send(TokenPiece(bid, i, text[max(delivered.get(i, 0) - start, 0):]))
                delivered[i] = end
            return cancelled is None or i not in cancelled.get(bid, ())

        def run(batch: Sequence[Any], cb: Any) -> Any:
            return engine.generate(batch, cb)
        stream_cb = on_token if wanted else None
    else:
        items, stream_cb = msg.texts, None

        def run(batch: Sequence[Any], cb: Any) -> Any:
            return engine.embed(batch)
    try:
        return BatchResult(bid, run(items, stream_cb))
    except Exception as e:
        if len(items) == 1:
            return BatchResult(bid, [None], (ItemError(0, type(e).__name__, _one_line(e)),))
    outputs: list[Any] = []
    errors: list[ItemError] = []
    for i, item in enumerate(items):
        seen.pop(i, None)
        cb = None if stream_cb is None else (lambda _j, t, i=i: stream_cb(i, t))
        try:
            outputs.append(run([item], cb)[0])
        except Exception as e:
            outputs.append(None)
            errors.append(ItemError(i, type(e).__name__, _one_line(e)))
    return BatchResult(bid, outputs, tuple(errors))


def worker_main(conn: Any, spec: dict[str, Any], kind: str, workers: int = 1) -> None:
    """A replica process: open the engine, say Ready, serve batches until Shutdown or EOF.

    conn:    this end of the pool's Pipe.
    spec:    the engine spec (``open_engine``).
    kind:    ``"generate"`` or ``"embed"``.
    workers: batches served at once, each on its own thread (an engine that batches
             continuously, like llama.cpp's, decodes them together).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        engine = open_engine(dict(spec))
        ready = describe(engine, kind)
    except Exception as e:
        conn.send(StartFailed(_one_line(e)))
        return
    conn.send(ready)
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


def create_engine(spec: dict[str, Any], base_url: str | None = None) -> Any:
    """A new engine for ``spec`` (not the per-process shared one): each replica owns its own.

    spec:     the engine spec ``{backend: ..., ...}``.
    base_url: the endpoint of a remote replica (overrides the spec's ``base_url``).
    """
    backend = spec.get("backend", "")
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend '{backend}'; known: {', '.join(sorted(BACKENDS))}")
    module, cls, _ = BACKENDS[backend]
    options = {k: v for k, v in spec.items() if k != "backend"}
    if base_url is not None:
        options["base_url"] = base_url
    return getattr(importlib.import_module(module), cls)(**options)


# -- transports -------------------------------------------------------------------------


class ProcessReplica:
    """A replica in its own process (multiprocessing "spawn"), reached over a Pipe.

    A reader thread delivers what the worker sends, then ``Exited`` when the pipe closes
    (the process ended, however it ended).
    """

    def __init__(self, spec: dict[str, Any], kind: str, deliver: Deliver, label: str,
                 max_workers: int = 1):
        """Prepare (nothing runs until ``start``).

        spec:        the engine spec the worker opens.
        kind:        ``"generate"`` or ``"embed"``.
        deliver:     called with each message from the replica (on the reader thread).
        label:       the process name, e.g. ``tailrace-pool-llm-0``.
        max_workers: batches the worker serves at once.
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

    @property
    def pid(self) -> int | None:
        return self._proc.pid

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
        """Wait up to ``grace_s`` for the worker to exit, then terminate, then kill it.

        grace_s: seconds the worker gets to finish its current call and close its engine.
        """
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
        """Prepare (nothing runs until ``start``).

        spec:        the engine spec.
        kind:        ``"generate"`` or ``"embed"``.
        deliver:     called with each message from the replica (on its threads).
        label:       the thread name prefix.
        base_url:    the endpoint of a remote replica.
        max_workers: calls it runs at once.
        """
        self._spec, self._kind, self._deliver, self._base_url = spec, kind, deliver, base_url
        self._exec = ThreadPoolExecutor(max_workers=max(1, max_workers),
                                        thread_name_prefix=label)
        self._engine: Any = None
        self._stopped = False
        self._cancelled: dict[int, set[int]] = {}

    @property
    def pid(self) -> int:
        return os.getpid()

    def start(self) -> None:
        """Open the engine on a replica thread; ``Ready`` or ``StartFailed`` follows."""
        self._exec.submit(self._open)

    def _open(self) -> None:
        try:
            self._engine = create_engine(self._spec, self._base_url)
            ready = describe(self._engine, self._kind)
        except Exception as e:
            self._deliver(StartFailed(_one_line(e)))
            return
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

    def stop(self, grace_s: float = 2.0) -> None:
        """Wait for running calls, drop queued ones, close the engine.

        grace_s: unused (calls on threads cannot be interrupted; they end by their timeout).
        """
        self._stopped = True
        self._exec.shutdown(wait=True, cancel_futures=True)
        if self._engine is not None:
            self._engine.close()
            self._engine = None


Replica = ProcessReplica | ThreadReplica
