"""Engine pools: one per named engine, shared by every pipeline in the process.

A pool owns N replicas of one engine (each its own process, or a remote endpoint) and one
loop thread that only orchestrates: callers' requests become items of a ``Batcher``
(batching.py), each batch goes to the replica the dispatch policy (dispatch.py) picks,
and the results are split back to each caller (docs/control.md, "Engine pools").

Failure: a replica that dies takes its in-flight batches with it; they are retried on
another healthy replica (at most ``max_retries`` times, then ``EngineError`` to the
callers) and the replica is restarted in the background (marked down after
``max_restarts`` failed starts in a row). A request the engine rejects itself
(``ContextOverflow``) fails only its caller and is not retried; other engine errors are.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import ContextOverflow, EngineError
from ...registry import Registry
from ..base import Generation, GenerationRequest, TokenCallback
from ..call import Call
from ..models import backend, batches_continuously
from ..tokens import approx_tokens, token_counter
from .batching import Batcher
from .dispatch import LoadTable, PrefixAffinity, ReplicaLoad, affinity_of, make_dispatch
from .messages import (
    BatchResult,
    EmbedBatch,
    Exited,
    FromReplica,
    GenerateBatch,
    Ready,
    StartFailed,
    TokenPiece,
)
from .replicas import ProcessReplica, ThreadReplica
from .state import Batch, Item, PoolStatistics, ReplicaState, ReplicaStatistics

__all__ = ["EnginePool", "PoolStatistics", "ReplicaStatistics", "check_options",
           "close_pools", "get_pool", "pool_statistics", "predicted_tokens"]

#: errors that are the request's own fault: failing on another replica would fail again
NOT_RETRIED: dict[str, type[EngineError]] = {"ContextOverflow": ContextOverflow}
_STOP = object()
_TICK_S = 0.25  # liveness checks and restarts happen at least this often


def predicted_tokens(req: GenerationRequest) -> int:
    """A request's predicted cost in tokens: its prompt (4 characters a token) + max_tokens."""
    text = req.prompt if req.prompt is not None else " ".join(
        str(m.get("content", "")) for m in (req.messages or ()))
    return approx_tokens(text) + max(req.max_tokens, 0)


class EnginePool:
    """N replicas of one engine behind one batching, dispatching, retrying front.

    Thread-safe: ``generate`` and ``embed`` may be called from many threads at once.
    """

    def __init__(self, name: str, spec: dict[str, Any], *, replicas: int | None = None,
                 endpoints: Sequence[str] | None = None, dispatch: str = "least_work",
                 max_batch_size: int = 8, max_wait_ms: float | None = None,
                 max_batch_tokens: int | None = None, max_retries: int = 2,
                 health_timeout_s: float = 60.0, max_in_flight: int | None = None,
                 isolation: str = "process", max_restarts: int = 3,
                 affinity_slack: int | None = None, clock: Callable[[], float] = time.monotonic,
                 transport: Callable[..., Any] | None = None):
        """Configure the pool (nothing starts until ``start``).

        name:             the engine's name in the pipeline (used in every message).
        spec:             the engine spec, e.g. ``{backend: llama_cpp, model: ..., n_threads: 1}``.
        replicas:         embedded replicas to run (each opens ``spec`` itself).
        endpoints:        base URLs of remote OpenAI-compatible servers, one replica each.
        dispatch:         the dispatch policy (``least_work``, ``prefix_affinity`` or
                          ``round_robin``).
        max_batch_size:   the most requests in one engine call.
        max_wait_ms:      the longest a request waits for others to share its engine call
                          (default 2; 0 for an engine that batches them itself).
        max_batch_tokens: the most predicted tokens in one engine call (None: no budget).
        max_retries:      times a failed batch is retried on another replica.
        health_timeout_s: seconds a replica has to become healthy (at start and on restart).
        max_in_flight:    engine calls each replica runs at once (default 4 for endpoints
                          and engines that batch concurrent calls themselves; 1 else;
                          with ``prefix_affinity``, 4 x llama.cpp's ``n_seq_max``).
        isolation:        ``process`` (one spawned process per replica) or ``thread``
                          (replicas in this process) for embedded replicas.
        max_restarts:     failed starts in a row after which a replica is marked down.
        affinity_slack:   ``prefix_affinity`` only: the most predicted tokens a replica
                          holding a request's prefix (or session) may have outstanding
                          beyond the least-loaded one and still get it (default 2048).
        clock:            seconds, monotonic; tests and the simulator inject their own.
        transport:        makes a replica's transport, called as ``transport(spec, kind,
                          deliver, label, endpoint, max_in_flight)`` (default: a process
                          or thread replica by ``isolation``); the simulator gives its
                          virtual replicas (``tailrace.simulate``).
        """
        where = f"engine pool '{name}'"
        if (replicas is None) == (endpoints is None):
            raise EngineError(f"{where}: give either replicas=N (embedded engines) or "
                              "endpoints=[URL, ...] (remote servers), not both or neither")
        count = replicas if endpoints is None else len(endpoints)
        if not isinstance(count, int) or count < 1:
            raise EngineError(f"{where} needs at least one replica, got {count}")
        if isolation not in ("process", "thread"):
            raise EngineError(f"{where}: isolation must be 'process' or 'thread', "
                              f"got {isolation!r}")
        kinds = backend(spec.get("backend"), where)[2]
        self.kind = str(spec.get("kind") or kinds[0])
        # one batcher per engine kind (docs/design.md): none here for one that batches itself
        continuous = batches_continuously(spec, self.kind)
        if max_wait_ms is None:
            max_wait_ms = 0.0 if continuous else 2.0
        if max_retries < 0 or max_restarts < 0 or health_timeout_s <= 0:
            raise EngineError(f"{where}: max_retries and max_restarts must be >= 0 and "
                              f"health_timeout_s > 0 (got {max_retries}, {max_restarts}, "
                              f"{health_timeout_s})")
        try:
            self._policy = make_dispatch(dispatch, affinity_slack=affinity_slack,
                                         affinity_capacity=_cached_prompts(spec))
            self._batcher = Batcher(max_batch_size, max_wait_ms, max_batch_tokens)
        except ValueError as e:
            raise EngineError(f"{where}: {e}") from None
        self.name, self.spec = name, dict(spec)
        self.model: str = str(spec.get("model", ""))
        self.context_length: int | None = None
        self.dim: int | None = None
        self.chat = True  # the replicas' engine takes chat messages (known once started)
        self._counter: Any = None  # counts tokens here (see count_tokens)
        self.endpoints = tuple(endpoints) if endpoints is not None else None
        self.max_retries, self.max_restarts = max_retries, max_restarts
        self.health_timeout_s = float(health_timeout_s)
        self._isolation = "thread" if endpoints is not None else isolation
        # remote servers and continuous batching (llama.cpp) run several calls together; a
        # prefix_affinity llama.cpp replica queues 4 x n_seq_max, so ``affinity_slack``, not
        # the call cap, sends a request away from its prefix (docs/control.md)
        in_flight = max_in_flight or (4 if endpoints is not None or continuous else 1)
        if max_in_flight is None and isinstance(self._policy, PrefixAffinity) \
                and spec["backend"] == "llama_cpp":
            n_seq = spec.get("n_seq_max", 8)
            in_flight = 4 * (n_seq if isinstance(n_seq, int) and n_seq > 0 else 8)
        self._replicas = [ReplicaState(i, (self.endpoints or [None] * count)[i], in_flight)
                          for i in range(count)]
        # each replica's ``load()``, kept current by ``_touch`` wherever its state changes;
        # ``least_work`` finds its replica in the table without a scan
        self._load_of = LoadTable([r.load() for r in self._replicas])
        self._clock = clock
        self._transport = transport
        # What the loop thread takes in. No maxsize (a full queue would block a replica's
        # reader, or ``stop``, behind the loop): each producer is bounded, so it holds at
        # most callers + incarnations * (max_in_flight + 3) + 1 entries: one per caller
        # blocked in ``call.wait()``; per replica incarnation (replaced ones still
        # stopping too) one Ready/StartFailed, one Exited and a BatchResult per batch in
        # flight (token pieces bypass it); one _STOP (tests/serving/test_queue_bounds.py).
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._held: deque[Batch] = deque()  # batches waiting for a replica (retries first)
        self._batch_ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._started = self._stopped = self._running = False
        self._broken: str | None = None
        self._stoppers: list[threading.Thread] = []  # stopping replaced replicas
        self._shared_batches = self._retries = self._failed_calls = 0

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> EnginePool:
        """Start every replica and wait until each is healthy; EngineError if one never is."""
        with self._lock:
            if self._stopped:
                raise EngineError(f"engine pool '{self.name}' was stopped; create a new one")
            if self._started:
                return self
            self._started = True
            now = self._clock()
            for r in self._replicas:
                r.first_try = now
                self._spawn(r, now)
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"tailrace-pool-{self.name}")
            self._thread.start()
            while (error := self._start_error()) is None:
                if all(r.healthy for r in self._replicas):
                    self._running = True
                    return self
                self._lock.wait(0.05)
        self.stop()
        raise EngineError(error)

    def _start_error(self) -> str | None:
        """Why ``start`` must give up (a replica is late, the pool was stopped), or None."""
        if self._stopped or self._broken:
            return f"engine pool '{self.name}' {self._broken or 'was stopped'} while starting"
        for r in self._replicas:
            if not r.healthy and self._clock() - r.first_try >= self.health_timeout_s:
                return (f"engine pool '{self.name}': replica {r.id} did not become healthy "
                        f"within {self.health_timeout_s}s (its last error: "
                        f"{r.last_error or 'none, it never answered'})")
        return None

    def stop(self) -> None:
        """Stop the loop and every replica (no process is left behind); idempotent.

        Calls still waiting get ``EngineError`` saying the pool was stopped.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._events.put(_STOP)
        if self._thread is not None:
            self._thread.join()
        transports = [r.transport for r in self._replicas if r.transport is not None]
        for t in transports:
            t.request_stop()
        for t in transports:
            t.stop()
        for thread in self._stoppers:
            thread.join()
        with self._lock:
            self._fail_everything(f"engine pool '{self.name}' was stopped")
            for r in self._replicas:
                r.transport, r.healthy = None, False
                self._touch(r)

    def __enter__(self) -> EnginePool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- calls ----------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        """Generate for ``requests`` (batched with other callers'); results in request order.

        on_token: called as ``on_token(index, piece)`` as text is produced, on a pool
                  thread (keep it quick); a retried request does not repeat pieces.
        """
        return self.submit_generate(requests, Call(len(requests), on_token)).wait()

    def submit_generate(self, requests: Sequence[GenerationRequest], call: Call) -> Call:
        """Queue ``requests`` as ``call`` (``Call(len(requests), on_token)``) and return
        it without waiting: ``generate`` is this and ``call.wait()``; a driver of its own
        (the simulator) learns of the end from ``call`` itself."""
        self._check_kind("generate")
        affine = isinstance(self._policy, PrefixAffinity)
        self._submit(call, [Item(call, i, r, predicted_tokens(r),
                                 affinity_of(r) if affine else None)
                            for i, r in enumerate(requests)])
        return call

    def embed(self, texts: Sequence[str]) -> Any:
        """Embed ``texts`` (batched with other callers'): float32 array, one row each."""
        import numpy as np

        rows = self.submit_embed(texts, Call(len(texts), None)).wait()
        if not rows:
            return np.zeros((0, self.dim or 0), dtype=np.float32)
        return np.stack(rows).astype(np.float32, copy=False)

    def submit_embed(self, texts: Sequence[str], call: Call) -> Call:
        """Queue ``texts`` as ``call`` and return it without waiting (``submit_generate``)."""
        self._check_kind("embed")
        self._submit(call, [Item(call, i, t, approx_tokens(t)) for i, t in enumerate(texts)])
        return call

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes in the replicas' model, counted in this process
        (``tokens.token_counter``, made on first use: exact for llama.cpp)."""
        if self._counter is None:
            self._counter = token_counter(self.spec)
        return int(self._counter(text))

    close = stop  # the engine protocol's name for ``stop``

    def statistics(self) -> PoolStatistics:
        """A snapshot: per replica load, calls, failures and restarts; batches formed."""
        with self._lock:
            b = self._batcher.statistics()
            return PoolStatistics(
                self.name, tuple(r.statistics() for r in self._replicas), b.batches,
                b.mean_batch_size, self._shared_batches, b.queued + sum(
                    len(x.items) for x in self._held), self._retries, self._failed_calls)

    def _check_kind(self, kind: str) -> None:
        if self.kind != kind:
            raise EngineError(f"engine pool '{self.name}' serves {self.kind}, not {kind}")

    def _submit(self, call: Call, items: list[Item]) -> None:
        if not items:  # a call of no requests is done already
            return
        with self._lock:
            if not self._started or self._stopped or self._broken:
                state = ("is not started; call start() or use it as a context manager"
                         if not self._started else self._broken or "was stopped")
                raise EngineError(f"engine pool '{self.name}' {state}")
        self._events.put(items)

    # -- the loop: only orchestrates --------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                try:
                    ev = self._events.get(timeout=self._wait_s())
                except queue.Empty:
                    ev = None
                with self._lock:
                    if not self._turn(ev, maintain=True):
                        return
                    self._lock.notify_all()
        except Exception as e:  # a bug here must not leave callers waiting forever
            with self._lock:
                self._broken = f"loop failed: {type(e).__name__}: {e}"
                self._fail_everything(f"engine pool '{self.name}' {self._broken}")
            raise

    def _turn(self, ev: Any, *, maintain: bool) -> bool:
        """One turn of the loop (under the lock): ``ev`` and every event queued behind it,
        replica upkeep (restarts, liveness) if ``maintain``, then dispatch; False once
        the pool was told to stop."""
        while ev is not None:
            if ev is _STOP:
                return False
            self._handle(ev)
            ev = None if self._events.empty() else self._events.get()
        now = self._clock()
        if maintain:
            self._maintain(now)
        self._dispatch(now)
        return True

    # -- driven from outside (the simulator): no loop thread -------------------------------

    def start_driven(self) -> EnginePool:
        """Start every replica's transport and return at once, with no loop thread: the
        caller drives the pool with ``turn`` on its own (virtual) clock, as the simulator
        does (``tailrace.simulate``); replicas are used once they say ``Ready``."""
        with self._lock:
            if self._started or self._stopped:
                raise EngineError(f"engine pool '{self.name}' was already started")
            self._started = self._running = True
            now = self._clock()
            for r in self._replicas:
                r.first_try = now
                self._spawn(r, now)
        return self

    def turn(self, *, maintain: bool = True) -> float | None:
        """A driven pool's loop, one turn: what callers and replicas sent since the last
        turn, replica upkeep if ``maintain``, dispatch. Returns when the batcher wants the
        next turn at the latest (clock seconds); None if nothing waits to be batched or
        it waits for a replica (whose next message calls for a turn)."""
        with self._lock:
            ev = None if self._events.empty() else self._events.get()
            self._turn(ev, maintain=maintain)
            deadline = self._batcher.next_deadline()
            if deadline is None or self._held or self._batcher.ready(self._clock()):
                return None  # nothing waits, or it waits for a replica: its message turns
            return deadline

    def _wait_s(self) -> float:
        with self._lock:
            deadline = self._batcher.next_deadline()
            if deadline is None or self._held or self._batcher.ready(self._clock()):
                return _TICK_S
            return min(max(deadline - self._clock(), 0.0), _TICK_S)

    def _handle(self, ev: Any) -> None:
        if isinstance(ev, list):  # a caller's items
            now = self._clock()
            for item in ev:  # a generation request's class and deadline order the batches
                p = item.payload
                self._batcher.add(item, item.tokens, now, getattr(p, "priority", 0),
                                  getattr(p, "deadline", None))
            return
        rid, incarnation, msg = ev
        r = self._replicas[rid]
        if incarnation != r.incarnation:
            return  # from a replica process that has since been replaced
        if isinstance(msg, Ready):
            r.healthy, r.pid, r.failed_starts = True, msg.pid, 0
            self.model = msg.model or self.model
            self.context_length, self.dim = msg.context_length, msg.dim
            if msg.chat is not None:
                self.chat = msg.chat
        elif isinstance(msg, BatchResult):
            self._finish(r, msg)
        elif isinstance(msg, StartFailed):
            self._lost(r, msg.error, started=False)
        elif isinstance(msg, Exited):
            self._lost(r, f"its process exited with code {msg.exitcode}", started=r.healthy)
        self._touch(r)

    def _maintain(self, now: float) -> None:
        running = self._running
        for r in self._replicas:
            if r.down:
                continue
            if r.transport is None and now >= r.restart_at:
                r.restarts += 1
                self._spawn(r, now)
            elif r.transport is not None and r.healthy and not r.transport.alive():
                self._lost(r, "its process is not alive", started=True)
            elif (running and r.transport is not None and not r.healthy
                  and now - r.spawned_at >= self.health_timeout_s):
                self._lost(r, f"it did not become healthy within {self.health_timeout_s}s",
                           started=False)
        if all(r.down for r in self._replicas) and not self._broken:
            errors = "; ".join(f"replica {r.id}: {r.last_error}" for r in self._replicas)
            self._broken = f"has no replica left, each failed to restart ({errors})"
            self._fail_everything(f"engine pool '{self.name}' {self._broken}")

    def _dispatch(self, now: float) -> None:
        while self._held:
            if not self._route(self._held.popleft(), front=True):
                return
        while self._load_of.free and self._batcher.ready(now):
            batch = Batch(next(self._batch_ids), self._batcher.take(now))
            if len({id(i.call) for i in batch.items}) > 1:
                self._shared_batches += 1
            if not self._route(batch, front=False):
                return

    # -- steps the loop takes ---------------------------------------------------------------

    def _loads(self, exclude: set[int] | frozenset[int] = frozenset()) -> Sequence[ReplicaLoad]:
        if not exclude:
            return self._load_of
        return [x for x in self._load_of if x.id not in exclude]

    def _touch(self, r: ReplicaState) -> None:
        """``r``'s state changed: refresh the load dispatch sees."""
        self._load_of.set(r.load())

    def _route(self, batch: Batch, *, front: bool) -> bool:
        """Send ``batch`` (to replicas it has not failed on, while one is healthy); False
        if it (or a part) had to be held back (at the front of ``_held`` if ``front``).
        ``prefix_affinity`` chooses per request, so a generation batch may be split into
        one engine call per chosen replica (docs/control.md)."""
        untried = batch.tried and any(r.healthy and r.id not in batch.tried for r in self._replicas)
        loads = self._loads(batch.tried if untried else frozenset())
        if not isinstance(self._policy, PrefixAffinity) or self.kind != "generate":
            rid = self._policy.choose(loads, batch.tokens)
            if rid is not None:
                self._send(rid, batch)
                return True
            self._hold(batch, front)
            return False
        by_id = {x.id: x for x in loads}
        groups: dict[int, list[Item]] = {}
        for k, item in enumerate(batch.items):
            rid = self._policy.choose(list(by_id.values()), item.tokens, item.affinity)
            if rid is None:  # nothing can take it: hold what is left
                self._send_groups(batch, groups)
                self._hold(Batch(next(self._batch_ids), batch.items[k:], batch.attempts,
                                 set(batch.tried)), front)
                return False
            groups.setdefault(rid, []).append(item)
            # later requests see this one's work; joining a call takes no more in-flight slot
            x = by_id[rid]
            by_id[rid] = x._replace(outstanding_work=x.outstanding_work + item.tokens,
                                 in_flight=self._replicas[rid].load().in_flight)
        self._send_groups(batch, groups)
        return True

    def _send_groups(self, batch: Batch, groups: dict[int, list[Item]]) -> None:
        for n, (rid, items) in enumerate(groups.items()):
            part = batch if n == 0 and len(groups) == 1 else Batch(
                batch.id if n == 0 else next(self._batch_ids), items, batch.attempts,
                set(batch.tried))
            self._send(rid, part)

    def _hold(self, batch: Batch, front: bool) -> None:
        (self._held.appendleft if front else self._held.append)(batch)

    def _send(self, rid: int, batch: Batch) -> None:
        r = self._replicas[rid]
        batch.attempts += 1
        batch.tried.add(rid)
        r.in_flight[batch.id] = batch
        r.outstanding += batch.tokens
        self._touch(r)
        for item in batch.items:
            item.streamed.restart()
        payload = tuple(i.payload for i in batch.items)
        assert r.transport is not None
        if self.kind == "embed":
            r.transport.send(EmbedBatch(batch.id, payload))
        else:
            stream = tuple(k for k, i in enumerate(batch.items) if i.call.on_token is not None)
            r.transport.send(GenerateBatch(batch.id, payload, stream))

    def _finish(self, r: ReplicaState, msg: BatchResult) -> None:
        batch = r.in_flight.pop(msg.batch_id, None)
        if batch is None:
            return
        r.outstanding -= batch.tokens
        r.calls += 1
        r.requests += len(batch.items)
        errors = {e.index: e for e in msg.errors}
        again: list[Item] = []
        for k, item in enumerate(batch.items):
            err = errors.get(k)
            if err is None:
                out = msg.outputs[k]
                if isinstance(out, Generation):
                    r.prompt_tokens += out.prompt_tokens
                    r.cached_tokens += int(out.extra.get("cached_tokens", 0) or 0)
                item.call.complete(item.index, out)
            elif err.kind in NOT_RETRIED:
                self._fail(item.call, NOT_RETRIED[err.kind](err.message))
            else:
                again.append(item)
                r.last_error = err.message
        if again:
            r.failures += 1
            self._retry(Batch(batch.id, again, batch.attempts, batch.tried), r.last_error or "")

    def _lost(self, r: ReplicaState, reason: str, *, started: bool) -> None:
        """Replica ``r`` died or failed to start: retry its batches, schedule a restart."""
        r.failures += 1
        r.last_error = reason
        r.healthy = False
        r.incarnation += 1  # ignore whatever its old process still sends
        transport, r.transport = r.transport, None
        if transport is not None:
            transport.request_stop()
            self._stoppers = [t for t in self._stoppers if t.is_alive()]
            self._stoppers.append(threading.Thread(target=transport.stop, daemon=True))
            self._stoppers[-1].start()
        lost, r.in_flight, r.outstanding = list(r.in_flight.values()), {}, 0
        self._policy.forget(r.id)  # a restarted engine caches nothing
        for batch in lost:
            self._retry(batch, f"replica {r.id} failed: {reason}")
        if not started:
            r.failed_starts += 1
        if self._running and r.failed_starts > self.max_restarts:
            r.down = True
        else:
            r.restart_at = self._clock() + min(0.1 * 2 ** r.failed_starts, 2.0)
        self._touch(r)

    def _retry(self, batch: Batch, reason: str) -> None:
        if batch.attempts > self.max_retries:
            for call in {id(i.call): i.call for i in batch.items}.values():
                self._fail(call, EngineError(
                    f"engine pool '{self.name}': a call failed {batch.attempts} times "
                    f"(replicas {sorted(batch.tried)}); last error: {reason}"))
            return
        self._retries += 1
        self._held.appendleft(batch)

    def _fail(self, call: Call, exc: Exception) -> None:
        if call.fail(exc):
            self._failed_calls += 1

    def _fail_everything(self, message: str) -> None:
        items = self._batcher.drain()
        for b in list(self._held) + [b for r in self._replicas for b in r.in_flight.values()]:
            items += b.items
        self._held.clear()
        for r in self._replicas:
            r.in_flight, r.outstanding = {}, 0
            self._touch(r)
        while not self._events.empty():
            ev = self._events.get()
            if isinstance(ev, list):
                items += ev
        for call in {id(i.call): i.call for i in items}.values():
            self._fail(call, EngineError(message))

    def _spawn(self, r: ReplicaState, now: float) -> None:
        inc = r.incarnation
        label = f"tailrace-pool-{self.name}-{r.id}"

        def deliver(msg: FromReplica, rid: int = r.id) -> None:
            if isinstance(msg, TokenPiece):
                if self._replicas[rid].incarnation == inc:
                    self._replicas[rid].piece(msg)
            else:
                self._events.put((rid, inc, msg))

        if self._transport is not None:
            r.transport = self._transport(self.spec, self.kind, deliver, label, r.endpoint,
                                          r.max_in_flight)
        elif self._isolation == "process":
            r.transport = ProcessReplica(self.spec, self.kind, deliver, label, r.max_in_flight)
        else:
            r.transport = ThreadReplica(self.spec, self.kind, deliver, label, r.endpoint,
                                        r.max_in_flight)
        r.spawned_at = now
        try:
            r.transport.start()
        except Exception as e:  # e.g. no more processes: a failed start like any other
            r.transport = None
            r.failed_starts += 1
            r.last_error = f"could not start: {type(e).__name__}: {e}"
            r.restart_at = now + min(0.1 * 2 ** r.failed_starts, 2.0)
        self._touch(r)


def _cached_prompts(spec: dict[str, Any]) -> int:
    """Prompts one replica's engine keeps cached: ``n_seq_max + cache_sequences`` KV streams
    for llama.cpp (its defaults: 8 + 0), 8 for other backends."""
    if spec.get("backend") != "llama_cpp":
        return 8
    n, extra = spec.get("n_seq_max", 8), spec.get("cache_sequences", 0)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (n, extra))
    return max(n + extra, 1) if ok else 8  # bad values: the engine's own check names them


_POOLS: Registry[EnginePool] = Registry("engine pools", at_exit=True)


def get_pool(name: str, spec: dict[str, Any], **options: Any) -> EnginePool:
    """The process-wide started pool for engine ``name``, created on first use.

    name:    the engine's name; every pipeline naming it shares the pool.
    spec:    its engine spec; a different spec under the same name is an error.
    options: ``EnginePool`` keyword arguments, used when the pool is created.
    """
    if "replicas" not in options and "endpoints" not in options:
        options["replicas"] = 1
    pool = _POOLS.get(name, lambda: EnginePool(name, spec, **options).start(),
                      reuse=lambda p: not p._stopped)
    if pool.spec != dict(spec):
        raise EngineError(f"engine pool '{name}' already runs {pool.spec}, not "
                          f"{dict(spec)}; give the other engine another name")
    return pool


def check_options(name: str, spec: dict[str, Any], options: dict[str, Any]) -> None:
    """EngineError for bad pool options (builds the pool object, starts nothing)."""
    try:
        EnginePool(name, spec, **options)
    except TypeError as e:  # an option of the wrong type reached a comparison
        raise EngineError(f"engine pool '{name}': bad option ({e})") from None


def pool_statistics() -> dict[str, PoolStatistics]:
    """``statistics()`` of every pool ``get_pool`` started, by engine name."""
    return {str(name): pool.statistics() for name, pool in _POOLS.items()}


def close_pools() -> None:
    """Stop every pool ``get_pool`` created (tests, shutdown)."""
    _POOLS.close_all()
