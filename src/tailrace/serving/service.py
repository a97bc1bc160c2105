"""Long-running pipeline hosts: one compiled plan served continuously to many callers.

A ``PipelineService`` runs ONE plan for as long as it is started. Its source reads an
endless feed that ``submit`` fills; every record carries its ``Request``
(``tailrace/request.py``) under the one reserved key ``REQUEST``, and its output or
error record is routed back to the waiting caller by the request's id, on the caller's
own loop, after the runtime has counted it and freed its admission ticket. A record
that ends without an output is answered at once with ``RecordDropped`` (one folded
into a ``batch`` window's list gets ``ServiceTimeout``). docs/serving.md ("In
Python", "On Ray") has the whole contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace
from functools import partial
from time import perf_counter
from typing import Any

from ..api.pipeline import Pipeline
from ..api.records import ErrorRecord
from ..compiler import Plan, compile_pipeline
from ..control.gate import approx_prompt_tokens, settle
from ..errors import PlanError
from ..observability import RunStats
from ..observability.tracing import STATE as TRACING
from ..observability.tracing import current_trace
from ..request import REQUEST, Cancel, Request, request_of, strip
from ..runtime.ingress import Feed
from ..runtime.trace_out import answer_budget, asked_tokens, output_tokens
from .errors import (
    CallerGone,
    RecordDropped,
    RequestFailed,
    ServiceError,
    ServiceOverloaded,
    ServiceTimeout,
    ServiceUnavailable,
)
from .own_loop import own_loop

_STOP = object()


@dataclass(slots=True)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    retry_after: float | None = None


def _answer(waiter: _Waiter, value: Any, exc: BaseException | None) -> None:
    """Resolve a waiter's future on its own loop (from any thread)."""
    with contextlib.suppress(RuntimeError):  # the caller's loop is gone
        waiter.loop.call_soon_threadsafe(settle, waiter.future, value, exc)


def _streamer(loop: asyncio.AbstractEventLoop, on_token: Callable[[str], Any],
              cancel: Cancel) -> Callable[[str], None]:
    """A request's token sink: hands each piece to ``on_token`` on the caller's loop."""
    call_soon = loop.call_soon_threadsafe

    def stream(piece: str) -> None:
        try:
            call_soon(on_token, piece)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            cancel.set()

    return stream


def _nothing_else_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Is the calling task all that ``loop`` has to run now (a lone query, not one of a
    burst that should cross the stages as one micro-batch)? Read from CPython's ready
    callbacks (``_ready``); a loop without them (uvloop) never lends a caller a stage."""
    ready = getattr(loop, "_ready", None)
    return ready is not None and not ready


class _Door:
    """The admission gate as the runtime sees it; remembers each rejection's retry-after
    so the caller's 429 carries it (the error record keeps only the message), and gives
    a ticket straight back when its caller left while the record waited for it."""

    def __init__(self, gate: Any, service: PipelineService) -> None:
        self.gate = gate
        self.service = service

    async def admit(self, pipeline: str, record: Any) -> Any:
        req = request_of(record)
        try:
            ticket = await self.gate.admit(pipeline, record)
        except Exception as e:
            retry = getattr(e, "retry_after", None)
            if retry is not None and req is not None:
                waiter = self.service._waiting.get(req.rid)
                if waiter is not None:
                    waiter.retry_after = float(retry)
            raise
        if req is not None and req.cancel.is_set():
            self.gate.done(ticket)
            raise CallerGone(f"pipeline '{pipeline}': the caller gave up while this request "
                             "waited for admission; it did not run")
        return ticket

    def done(self, ticket: Any, service_seconds: float | None = None) -> None:
        self.gate.done(ticket, service_seconds)

    def urgency(self, ticket: Any) -> tuple[int, float] | None:
        """The admitted request's class and deadline for the engines (the gate's)."""
        of = getattr(self.gate, "urgency", None)
        return of(ticket) if of is not None else None


class PipelineService:
    """Hosts one compiled pipeline continuously (``start``); callers ``submit``. A lone
    query may run an idle inline first stage on the caller's own stack (``own_loop.py``).

    plan_or_pipeline: a ``Pipeline`` (compiled here) or a compiled ``Plan``; its source
                      must be declared without data and its sink without a target.
    admission:        the process's shared admission gate (``AdmissionGate``) or None.
    max_pending:      most requests waiting for an answer at once; more get
                      ``ServiceOverloaded`` (HTTP 429) instead of an unbounded queue.
    timeout_s:        how long a caller waits for its output before ``ServiceTimeout``.
    runtime:          "local" (this process) or "ray" (stage actors on a Ray cluster,
                      this process the driver; needs ``pip install 'tailrace[ray]'``).
    address:          with "ray": the cluster (``HOST:PORT``, ``ray://HOST:PORT``,
                      ``auto``; None: the current connection, ``RAY_ADDRESS`` or a new
                      local Ray), connected when the service starts.
    placement:        with "ray": ``{stage id: {num_cpus, num_gpus, memory, resources,
                      strategy}}``.
    runs:             with "ray": the caller's ``runtime.ray.ActiveRuns`` that lists the
                      run (its stage actors) while it runs, or None.
    trace:            a ``runtime.trace_out.TraceWriter`` that gets one line per submitted
                      record as its ``submit`` ends (ok, error, or rejected: a 429), or
                      None; its owner closes it after stopping the service.
    """

    def __init__(self, plan_or_pipeline: Pipeline | Plan, *, admission: Any = None,
                 max_pending: int = 1024, timeout_s: float = 300.0, runtime: str = "local",
                 address: str | None = None, placement: dict | None = None,
                 runs: Any = None, trace: Any = None) -> None:
        plan = (plan_or_pipeline if isinstance(plan_or_pipeline, Plan)
                else compile_pipeline(plan_or_pipeline))
        _check_servable(plan)
        if runtime not in ("local", "ray"):
            raise ValueError(f"runtime must be 'local' or 'ray', got {runtime!r}")
        if runtime == "local" and (address is not None or placement is not None or
                                   runs is not None):
            raise ValueError("address and placement are options of runtime='ray', like "
                             "runs; the local runtime takes none of them")
        if runtime == "ray":
            from ..runtime.ray import import_ray
            from ..runtime.ray.placement import parse_placement

            import_ray()  # RayUnavailable at once: no Ray installed
            parse_placement(plan, placement)  # a bad option fails here, not at start
        if type(max_pending) is not int or max_pending < 1:
            raise ValueError(f"max_pending must be a positive integer, got {max_pending!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.plan = plan
        self.name = plan.name
        self.gate = admission
        self.max_pending = max_pending
        self.timeout_s = float(timeout_s)
        self.runtime = runtime
        self.address = address
        self.placement = placement
        self.runs = runs
        self.trace = trace
        # the answering stage's output budget and usage field, for the trace's lines
        self._budget = answer_budget(plan) if trace is not None else (None, None)
        self.unrouted = 0  # outputs/error records with no waiting caller (late, extra)
        self.spend: dict[str, float] = {}  # tenant ("" none) -> what its answers cost
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiter] = {}
        self._state = "new"  # new -> running -> stopping -> stopped | failed
        self._failure: BaseException | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The feed: records submitted and not yet taken by the source. Bounded by
        # max_pending (``_queued`` counts them under ``_lock``; ``submit`` refuses past it,
        # so ``put_nowait`` never finds it full), +1 for the stop marker. Records whose
        # caller gave up still hold their slot until the source takes (and skips) them.
        self._queue: asyncio.Queue | None = None
        self._queued = 0
        self._run: Any = None  # the LocalRun (RayRun), once built
        self._t0 = 0.0
        self._feed = _Feed(self)
        self._task: asyncio.Task | None = None  # start(loop): the run, on the caller's loop
        self._loop_thread: int | None = None  # the thread that runs ``_loop``
        # start(): the lock ``_loop`` holds except while it waits (``own_loop.py``)
        self._hold: threading.Lock | None = None

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once the engines are loaded and the run is accepting records."""
        return self._ready.is_set() and self._state == "running"

    @property
    def started(self) -> bool:
        """True once ``start`` was called (whatever happened since)."""
        return self._state != "new"

    @property
    def failure(self) -> BaseException | None:
        """Why the service stopped on its own (engine load failure, runtime bug), or None."""
        return self._failure

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> PipelineService:
        """Start the run; returns at once (see ``ready``, ``wait_ready``).

        loop: None: on a thread and event loop of its own. Else the running loop this is
              called from: the run becomes tasks on it (stop with ``aclose``).
        """
        if loop is not None:
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if here is not loop:
                raise ServiceError(f"pipeline '{self.name}': start(loop) must be called "
                                   "from inside that running loop")
        with self._lock:
            if self._state != "new":
                raise ServiceError(f"pipeline '{self.name}': start() called twice "
                                   f"(state {self._state}); create a new service")
            if loop is None:
                self._loop, self._hold = own_loop()
            else:
                self._loop = loop
            self._queue = asyncio.Queue(maxsize=self.max_pending + 1)
            self._state = "running"
        if loop is not None:
            self._loop_thread = threading.get_ident()
            self._task = loop.create_task(self._hosted(), name=f"tailrace-serve-{self.name}")
            return self
        self._thread = threading.Thread(target=self._main, name=f"tailrace-serve-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ready (True), failed or ``timeout`` seconds (None: no limit)
        passed (False)."""
        deadline = None if timeout is None else perf_counter() + timeout
        while not self._ready.wait(0.05):
            if self._state in ("failed", "stopped"):
                return False
            if deadline is not None and perf_counter() >= deadline:
                return False
        return self.ready

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking requests, finish those in the pipeline, then end the run; callers
        still waiting after ``timeout`` seconds get ``ServiceUnavailable``."""
        with self._lock:
            if self._state != "running":
                if self._state == "new":
                    self._state = "stopped"
                return
            self._state = "stopping"
        loop, queue = self._loop, self._queue
        assert loop is not None and queue is not None
        with contextlib.suppress(RuntimeError):  # the loop already ended (the run failed)
            loop.call_soon_threadsafe(queue.put_nowait, _STOP)
        if self._task is not None:  # on the caller's loop: ``aclose`` waits for the drain
            return
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_waiting(ServiceUnavailable(
            f"pipeline '{self.name}' stopped before answering this request"))

    async def aclose(self, timeout: float = 30.0) -> None:
        """``stop`` for a service started on the caller's loop (``start(loop)``): stop
        taking requests, finish those in the pipeline (at most ``timeout`` seconds),
        then end the run. On a thread of its own, it stops it in a worker thread."""
        if self._task is None:
            await asyncio.to_thread(self.stop, timeout)
            return
        self.stop(timeout)
        task = self._task
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._fail_waiting(ServiceUnavailable(
            f"pipeline '{self.name}' stopped before answering this request"))

    def _main(self) -> None:
        loop, hold = self._loop, self._hold
        assert loop is not None and hold is not None
        self._loop_thread = threading.get_ident()
        hold.acquire()
        try:
            with asyncio.Runner(loop_factory=lambda: loop) as runner:
                runner.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported through .failure and callers
            self._failed(e)
        finally:
            hold.release()
            self._ended()

    async def _hosted(self) -> None:
        """The run as a task on the caller's loop (``start(loop)``)."""
        try:
            await self._serve()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - reported through .failure and callers
            self._failed(e)
        finally:
            self._ended()

    def _failed(self, e: BaseException) -> None:
        while isinstance(e, BaseExceptionGroup):  # the runtime's task groups
            e = e.exceptions[0]
        self._failure = e

    def _ended(self) -> None:
        with self._lock:
            self._state = "stopped" if self._failure is None else "failed"
        why = (f": {type(self._failure).__name__}: {self._failure}"
               if self._failure is not None else "")
        self._fail_waiting(ServiceUnavailable(f"pipeline '{self.name}' stopped{why}"))

    async def _serve(self) -> None:
        from ..runtime import bind_io
        from ..runtime.local import LocalRun

        inputs, outputs, _ = bind_io(self.plan, self._feed, self._on_output)
        io: dict[str, Any] = {
            "inputs": inputs, "outputs": outputs, "on_error": self._on_error,
            "on_drop": self._on_drop,
            "admission": _Door(self.gate, self) if self.gate is not None else None}
        if self.runtime == "ray":
            await self._serve_on_ray(io)
            return
        build = partial(LocalRun, self.plan, **io)  # loads engines
        # on a shared loop, the engines load in a worker thread: the loop keeps serving
        self._run = build() if self._task is None else await asyncio.to_thread(build)
        self._t0 = perf_counter()
        self._ready.set()
        await self._run.execute()

    async def _serve_on_ray(self, io: dict[str, Any]) -> None:
        """The run on Ray: ready once every stage replica (and its engines) is installed."""
        from ..runtime.ray import serving_run

        def installed() -> None:
            self._t0 = perf_counter()
            self._ready.set()

        build = partial(serving_run, self.plan, on_ready=installed, address=self.address,
                        placement=self.placement, **io)
        run = self._run = await asyncio.to_thread(build)  # connecting blocks: off the loop
        await (run.execute() if self.runs is None else self.runs.execute(run))

    # -- requests -----------------------------------------------------------------------
    async def submit(self, record: dict, on_token: Callable[[str], Any] | None = None,
                     cancel: Cancel | threading.Event | None = None, *,
                     request: Request | None = None) -> dict:
        """Run one record through the pipeline; returns its output record.

        record:   a JSON object (dict) of user fields; the key ``_request`` is reserved.
        on_token: called on the caller's event loop with each generated text piece.
        cancel:   an event the caller sets to stop the work (a fresh one if None);
                  cancelling this coroutine sets it too.
        request:  the request's control data (options, urgency, session, conversation:
                  a ``Request`` the caller made; its id, cancel and sink are set here);
                  after the answer its ``reply`` holds what the answering stage
                  reported. None: a plain request.
        Raises ``RequestFailed`` (carrying the error record; admission rejections are
        status 429 with ``retry_after``), ``ServiceOverloaded``, ``ServiceUnavailable``
        or ``ServiceTimeout``.
        """
        if not isinstance(record, dict):
            raise ServiceError(f"pipeline '{self.name}': a record must be a JSON object, got "
                               f"{type(record).__name__}", status=400, code="invalid_record")
        trace = self.trace
        arrived = perf_counter() if trace is not None else 0.0
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if REQUEST in record:
            raise ServiceError(f"pipeline '{self.name}': the record field '{REQUEST}' is "
                               "reserved for the request tailrace attaches; rename it",
                               status=400, code="invalid_record")
        # one cancel concept: the caller's own event (if any) counts as set too
        signal = cancel if type(cancel) is Cancel else Cancel(cancel)
        req = Request(cancel=signal) if request is None else request
        req.cancel = signal
        # this service's own id: requests made elsewhere (several ingress replicas in
        # front of one hub) may share ids, answers are routed by this one
        rid = req.rid = next(self._ids)
        if on_token is not None:
            req.sink = _streamer(loop, on_token, req.cancel)
        if TRACING.tracer is not None:  # its stage spans join the current request span
            req.trace = current_trace(self.name)
        rec = {**record, REQUEST: req}
        with self._lock:
            if self._state != "running":
                raise self._refused(trace, arrived, record, req,
                                    ServiceUnavailable(self._why_unavailable()))
            if len(self._waiting) >= self.max_pending or self._queued >= self.max_pending:
                raise self._refused(trace, arrived, record, req, ServiceOverloaded(
                    f"pipeline '{self.name}': {self.max_pending} requests already waiting; "
                    "retry later"))
            self._waiting[rid] = _Waiter(loop, fut)
            assert self._loop is not None and self._queue is not None
            alone = len(self._waiting) == 1 and _nothing_else_ready(loop)
            here = loop is self._loop
            hold = self._hold  # a caller on another thread may borrow the idle run
            borrowed = (not here and alone and not self._queued and hold is not None
                        and hold.acquire(False))
            if not here and not borrowed:
                self._queued += 1
                self._loop.call_soon_threadsafe(self._queue.put_nowait, rec)
        # straight into the first stage if it can take it; alone, it may run and be
        # answered right here (outside the lock: the answer takes it)
        if here and not self._feed.offer(rec, alone):
            with self._lock:
                self._queued += 1
            self._queue.put_nowait(rec)
        elif borrowed:
            try:
                taken = self._feed.offer(rec, True)
            finally:
                hold.release()  # type: ignore[union-attr]
            if taken and not fut.done():
                # it went into a channel (a first stage that is not an inline chain to the
                # sink), waking its worker from this thread: wake the loop from select too
                self._loop.call_soon_threadsafe(_nothing)
            if not taken:
                with self._lock:
                    if self._state == "running":  # else stopping: ``stop`` answers it
                        self._queued += 1
                        self._loop.call_soon_threadsafe(self._queue.put_nowait, rec)
        try:
            if fut.done():  # answered where it was offered: no wait, no timer
                return fut.result()
            timer = loop.call_later(self.timeout_s, self._expired, fut, req, cancel)
            try:
                return await fut
            finally:
                timer.cancel()
        finally:
            if not fut.done() or fut.cancelled():
                req.cancel.set()
                if cancel is not None and cancel is not req.cancel:
                    cancel.set()
            with self._lock:
                self._waiting.pop(rid, None)
            if trace is not None:
                self._traced(trace, arrived, record, req, fut, None)

    def _refused(self, trace: Any, arrived: float, record: dict, req: Request,
                 exc: ServiceError) -> ServiceError:
        """``exc``, the refusal of a request, after its trace line (tracing on)."""
        if trace is not None:
            self._traced(trace, arrived, record, req, None, exc)
        return exc

    def _traced(self, trace: Any, arrived: float, record: dict, req: Request,
                fut: asyncio.Future | None, exc: BaseException | None) -> None:
        """The trace's line of a request whose ``submit`` ends now: answered by ``fut``
        (not done or cancelled: the caller gave up) or refused with ``exc``."""
        if fut is not None:
            exc = (asyncio.CancelledError() if not fut.done() or fut.cancelled()
                   else fut.exception())
        max_tokens, usage_field = self._budget
        out = None
        if exc is None:
            assert fut is not None
            outcome, out = "ok", output_tokens(req, fut.result(), usage_field)
        elif getattr(exc, "status", None) == 429:  # admission (or too many waiting)
            outcome = "rejected"
        else:
            outcome = "error"
        trace.record(arrived, self.name, approx_prompt_tokens(record),
                     asked_tokens(req, max_tokens), out, outcome)

    def _expired(self, fut: asyncio.Future, req: Request, cancel: Any) -> None:
        """``submit``'s timer: no answer within ``timeout_s``; the work is stopped."""
        if fut.done():
            return
        req.cancel.set()
        if cancel is not None and cancel is not req.cancel:
            cancel.set()
        fut.set_exception(ServiceTimeout(
            f"pipeline '{self.name}': no output within {self.timeout_s:g} s (a stage "
            f"may have replaced the record without keeping its '{REQUEST}')"))

    def _why_unavailable(self) -> str:
        if self._state == "failed" and self._failure is not None:
            return (f"pipeline '{self.name}' failed: {type(self._failure).__name__}: "
                    f"{self._failure}")
        if self._state == "new":
            return f"pipeline '{self.name}' is not started; call start() first"
        return f"pipeline '{self.name}' is stopping or stopped"

    def _waiter_of(self, record: Any) -> _Waiter | None:
        req = request_of(record)
        with self._lock:
            waiter = self._waiting.pop(req.rid, None) if req is not None else None
        if waiter is None:
            self.unrouted += 1
        return waiter

    def _reply(self, waiter: _Waiter, value: Any, exc: BaseException | None) -> None:
        """Answer ``waiter`` once the runtime's current step is over: the runtime hands a
        record to the sink before it counts it and frees its ticket, in the same step."""
        if threading.get_ident() == self._loop_thread:
            assert self._loop is not None
            if waiter.loop is self._loop:  # the caller shares the loop: its task wakes
                settle(waiter.future, value, exc)  # after this step anyway (call_soon)
            else:
                self._loop.call_soon(_answer, waiter, value, exc)
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:  # a blocking sink's worker thread
            here = None
        if waiter.loop is here:  # a caller that borrowed the run answers itself, after
            settle(waiter.future, value, exc)  # the step (it awaits nothing meanwhile)
        else:
            _answer(waiter, value, exc)

    def _spent(self, req: Any, cost: Any) -> None:
        if isinstance(cost, (int, float)) and cost:
            key = (req.tenant or "") if req is not None else ""
            with self._lock:
                self.spend[key] = self.spend.get(key, 0.0) + cost

    def _on_output(self, record: Any) -> None:
        req = request_of(record)
        if req is not None and req.reply.cost is not None:
            self._spent(req, req.reply.cost)
        waiter = self._waiter_of(record)
        if waiter is not None:
            self._reply(waiter, strip(record), None)

    def _on_error(self, err: ErrorRecord) -> None:
        if err.detail is not None:  # a budgeted route spent this much before it failed
            self._spent(request_of(err.input), (err.detail.get("route") or {}).get("spent"))
        waiter = self._waiter_of(err.input)
        if waiter is not None:
            self._reply(waiter, None, RequestFailed(err, waiter.retry_after))

    def _on_drop(self, stage: str, records: list) -> None:
        for record in records:
            waiter = self._waiter_of(record)
            if waiter is not None:
                self._reply(waiter, None, RecordDropped(
                    f"pipeline '{self.name}': stage '{stage}' dropped this record (a filter "
                    "said no, a flat_map made nothing of it, or the stage replaced it "
                    "without keeping its '_request'); the pipeline has no answer for it"))

    def _fail_waiting(self, exc: ServiceError) -> None:
        with self._lock:
            waiters = list(self._waiting.values())
            self._waiting.clear()
        for w in waiters:
            _answer(w, None, exc)

    # -- figures ------------------------------------------------------------------------
    @property
    def local_run(self) -> Any:
        """The running ``LocalRun`` (live meters and channels), or None before start
        (and on Ray, whose meters live in the actors)."""
        return self._run if self.runtime == "local" else None

    @property
    def pending(self) -> int:
        """Requests submitted and not yet answered."""
        return len(self._waiting)

    @property
    def queued(self) -> int:
        """Records submitted and not yet taken by the pipeline's source (at most
        ``max_pending``; a record whose caller gave up counts until it is taken)."""
        return self._queued

    def stats(self) -> RunStats:
        """A live snapshot of the run's statistics (approximate while records flow:
        counters are read without stopping the stages; on Ray, the stage actors' meters
        as of their last snapshot, at most ``FLUSH_S`` old: a ``RayRunStats``)."""
        from ..runtime import live_stats

        run = self._run
        if self.runtime == "ray" and run is not None:
            st = run.stats(perf_counter() - self._t0, False)
            arrived = sum(m.records_out for m in run.source_meters.values())
            return dataclass_replace(st, records_in=arrived)  # the source never ends
        return live_stats(run, self._t0)

    def queue_depths(self) -> dict[str, int]:
        """Records buffered now in each stage's input channel, by stage id (a local run;
        on Ray the queues live in the actors: ``stats()`` has their peaks)."""
        lr = self.local_run
        return {} if lr is None else {sid: ch.depth for sid, ch in lr.channels.items()}


class _Feed(Feed):
    """The records ``submit`` queued, as the pipeline's source reads them: one at a time
    (under admission) or in lists of what has arrived. A record whose caller gave up
    before it was taken is skipped; the stop marker ends the feed."""

    def __init__(self, service: PipelineService) -> None:
        self.service = service
        self.idle = False  # the source waits for the next request, holding none

    def offer(self, record: dict, alone: bool = False) -> bool:
        """Hand ``record`` straight to the first stage (no queue, no source turn) when
        that keeps the order: the source is idle and nothing is queued before it.
        ``alone``: no other request is waiting, so the stage may run it at once
        (``Feed.push``)."""
        push, queue = self.push, self.service._queue
        return (push is not None and self.idle and queue is not None and queue.empty()
                and push([record], alone))

    def _taken(self, record: Any) -> bool:
        with self.service._lock:
            self.service._queued -= 1
        return not record[REQUEST].cancel.is_set()  # else its caller gave up before it entered

    async def __aiter__(self) -> Any:
        queue = self.service._queue
        assert queue is not None
        while True:
            record = await queue.get()
            if record is _STOP:
                return
            if self._taken(record):
                yield record

    async def batches(self, n: int) -> Any:
        queue = self.service._queue
        assert queue is not None
        while True:
            batch: list = []
            self.idle = True
            try:
                record = await queue.get()
            finally:
                self.idle = False
            while record is not _STOP:
                if self._taken(record):
                    batch.append(record)
                if len(batch) >= n or queue.empty():
                    break
                record = queue.get_nowait()
            if batch:
                yield batch
            if record is _STOP:
                return


def _check_servable(plan: Plan) -> None:
    open_sources = [o.id for s in plan.stages for o in s.ops
                    if o.op.kind == "source" and o.params.get("data") is None]
    open_sinks = [o.id for s in plan.stages for o in s.ops
                  if o.op.kind == "sink" and o.params.get("target") is None]
    if len(open_sources) != 1:
        raise PlanError(f"pipeline '{plan.name}' cannot be served: it needs exactly one "
                        "source declared without data (the requests), found "
                        f"{len(open_sources)}")
    if not open_sinks:
        raise PlanError(f"pipeline '{plan.name}' cannot be served: no sink without a target "
                        "receives its outputs; end it with .sink() (YAML pipelines do)")


def _nothing() -> None:
    """A callback that only wakes a loop waiting in ``select``."""
