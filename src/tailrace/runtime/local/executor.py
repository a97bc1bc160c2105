"""The local runtime: a Plan on one asyncio event loop (docs/architecture.md §4).

Each stage is one task per replica (per call a replica may have in flight,
``Execution.in_flight``) moving micro-batches from its bounded input channel through its
``StageWorker`` to the downstream channels. When a stage's replicas have all seen the end
of their input, it closes its downstream channels, so end-of-input propagates through
branches, merges and replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...compiler import MAX_MICROBATCH, Plan, PlanStage
from ...engines import open_engine
from ...observability import Histogram, StageMeter
from ...observability.tracing import STATE as TRACING
from ...observability.tracing import stage_spans
from ...operators import BuildContext, OpRuntime
from ...request import REQUEST, Request, request_of, strip
from ..ingress import input_failed, read, read_admitted
from ..stage import StageWorker, sink_runtime, sink_target
from .channel import Channel


class LocalRun:
    """State of one run of a plan; ``execute()`` runs it to completion."""

    def __init__(self, plan: Plan, *, inputs: dict[str, Any], outputs: dict[str, Any],
                 on_error: Callable[[ErrorRecord], None], admission: Any = None,
                 on_drop: Callable[[str, list], None] | None = None,
                 admission_window: int = MAX_MICROBATCH) -> None:
        """inputs, outputs: records for sources and targets for sinks declared without them.
        on_error:  receives each ``ErrorRecord``.
        admission: the admission gate each record waits for, or None.
        on_drop:   ``on_drop(stage id, records)`` for records that ended without an
                   output or error (a server answers their requests), found by
                   their ``REQUEST``.
        admission_window: most records waiting for admission at once; past that the
                   source stops reading its input.
        """
        self.plan = plan
        self.on_error = on_error
        self.on_drop = on_drop
        self.admission = admission
        # id(ticket) -> [ticket, copies of it in flight]; see ``_account``
        self.tickets: dict[int, list] = {}
        self.admission_window = admission_window
        self.latency = Histogram()
        self.scheduling = Histogram()  # arrival -> first operator start, per record
        self.records_in = 0
        self.records_out = 0
        self.errors = 0
        self.channels: dict[str, Channel] = {}
        self.workers: dict[str, list[StageWorker]] = {}
        self.source_meters: dict[str, StageMeter] = {}
        self.inputs = inputs
        try:
            for s in plan.stages:
                if s.ops[0].op.kind == "source":
                    self.source_meters[s.id] = StageMeter(s.id, "source")
                    continue
                self.channels[s.id] = Channel(s.queue, producers=len(s.upstream))
                n = s.replicas * s.execution.in_flight  # type: ignore[union-attr]
                workers = self.workers[s.id] = []
                for _ in range(n):
                    workers.append(StageWorker(s, self._build(s, outputs), on_drop))
        except BaseException:  # a build failed: release what the others opened
            for ws in self.workers.values():
                for w in ws:
                    w.stop(wait=False)
            raise
        ids = [s.id for s in plan.stages]
        self.down: dict[str, dict[str | None, list[Channel]]] = {
            ids[i]: {port: [self.channels[ids[c]] for c in cs] for port, cs in ports.items()}
            for i, ports in plan.consumers().items()}
        self.first_stages = {ids[i] for i in plan.first_stages()}
        self.sinks = {s.id for s in plan.stages if s.ops[-1].op.kind == "sink"}

    def _build(self, s: PlanStage, outputs: dict[str, Any]) -> list:
        rts: list[OpRuntime] = []
        try:
            for o in s.ops:
                if o.op.kind == "sink":
                    target = sink_target(o, outputs)
                    if self.admission is not None and self.on_drop is None:
                        target = _user_fields(target)  # a batch run's sink: no request
                    rts.append(sink_runtime(target))
                else:
                    rts.append(o.op.build(o.params, BuildContext(o.contract, open_engine)))
        except BaseException:  # the fused operators built before it release theirs
            for rt in rts:
                if rt.close is not None:
                    rt.close()
            raise
        return rts

    # -- the run ----------------------------------------------------------------------
    async def execute(self) -> None:
        finished = False
        try:
            async with asyncio.TaskGroup() as tg:
                for s in self.plan.stages:
                    if s.ops[0].op.kind == "source":
                        tg.create_task(self._source(s))
                    else:
                        tg.create_task(self._stage(s))
            finished = True
        finally:
            for workers in self.workers.values():
                # a finished run leaves no thread behind, except one running an abandoned
                # timed-out call (it cannot be stopped); an interrupted run does not wait
                for w in workers:
                    w.stop(wait=finished)
            if self.admission is not None:  # an interrupted run: free what is left
                for ticket, _ in list(self.tickets.values()):
                    self.admission.done(ticket)
                self.tickets.clear()

    def _error(self, errs: list[ErrorRecord]) -> None:
        self.errors += len(errs)
        for e in errs:
            self.on_error(e)

    # -- admission: every ticket taken is given back exactly once -----------------------
    # An admitted record's request holds its ticket; ``tickets`` counts the
    # copies of it in flight (fan-out and flat_map children add, every stage's input
    # subtracts, its outputs add back). A record ends where its ticket stops appearing:
    # at a sink, as an error record, dropped by a filter, or replaced by a stage with a
    # record that does not carry it. The count reaching 0 releases the ticket.
    def _account(self, sid: str, batch: list, ports: dict[str | None, list]) -> None:
        """Under admission: one stage call took ``batch`` and emitted ``ports``."""
        delta: dict[int, int] = {}
        for r in batch:
            q = request_of(r)
            t = q.ticket if q is not None else None
            if t is not None:
                delta[id(t)] = delta.get(id(t), 0) - 1
        down = self.down[sid]
        for port, records in ports.items():
            k = len(down.get(port, ()))
            if k:
                for r in records:
                    q = request_of(r)
                    t = q.ticket if q is not None else None
                    if t is not None and id(t) in self.tickets:
                        delta[id(t)] = delta.get(id(t), 0) + k
        tickets = self.tickets
        for key, d in delta.items():
            entry = tickets.get(key)
            if entry is None:
                continue
            entry[1] += d
            if entry[1] <= 0:
                del tickets[key]
                self.admission.done(entry[0])

    async def _admitted(self, sid: str, data: Any, meter: StageMeter) -> None:
        """Admission at the source (``ingress.read_admitted``); an admitted record enters
        the plan with its request holding its ticket (a batch run's record gets a
        request here; a served one has its own)."""
        urgency = getattr(self.admission, "urgency", None)  # class + deadline, engines'
        copies = len(self.down[sid].get(None, ()))

        async def send(x: Any, ticket: Any, born: float) -> None:
            self.tickets[id(ticket)] = [ticket, copies]
            req = request_of(x)
            if req is None:
                req = Request()
                x = {**x, REQUEST: req}
            req.ticket = ticket
            req.granted = urgency(ticket) if urgency is not None else None
            await self._emit(sid, {None: [x]}, born)

        def refuse(x: Any, e: BaseException) -> None:
            self.errors += 1
            self.on_error(ErrorRecord.from_exception("admission", x, e))

        await read_admitted(data, self.admission, self.plan.name, self.admission_window,
                            meter, send, refuse, _not_a_dict)

    async def _emit(self, sid: str, ports: dict[str | None, list], born: float) -> None:
        down = self.down[sid]
        for port, records in ports.items():
            if records:
                for ch in down.get(port, ()):
                    if not ch.put_nowait(records, born):
                        await ch.put(records, born)

    def _close(self, sid: str) -> None:
        for chans in self.down[sid].values():
            for ch in chans:
                ch.close()

    async def _source(self, s: PlanStage) -> None:
        op = s.ops[0]
        data: Any = op.params.get("data")
        if data is None:
            data = self.inputs[op.id]
        meter = self.source_meters[s.id]
        down = self.down[s.id].get(None, [])

        def send(chunk: list) -> Awaitable[None]:
            return self._emit(s.id, {None: chunk}, perf_counter())

        run_now = self._runner(down[0]) if len(down) == 1 else None

        def offer(records: list, alone: bool = False) -> bool:  # one channel: all or nothing
            ch = down[0]
            if ch.closed:
                return False
            if alone and run_now is not None and ch.depth == 0 and run_now(records):
                return True
            return ch.put_nowait(records, perf_counter())

        try:
            if self.admission is not None:
                await self._admitted(s.id, data, meter)
            else:
                await read(data, min([MAX_MICROBATCH] + [ch.bound for ch in down]), meter,
                           send, offer if len(down) == 1 else None)
        except Exception as e:  # the input itself failed: report it, end the stream
            self._error([input_failed(op.id, meter, e)])
        finally:
            meter.records_in = meter.records_out
            self.records_in += meter.records_out
            self._close(s.id)

    def _runner(self, ch: Channel) -> Callable[[list], bool] | None:
        """The stage that ``ch`` feeds, run on the caller's stack for a lone record
        (``Feed.push(records, alone=True)``) by an idle replica, when the stage is an
        inline ``chain`` ending in a sink (docs/design.md: two task switches saved). Nothing
        is buffered before it, so the order holds; the meters count it as the worker
        would (queue wait 0). None: not such a stage."""
        s = next(st for st in self.plan.stages if self.channels.get(st.id) is ch)
        x = s.execution
        if x is None or x.call != "chain" or s.id not in self.sinks or len(s.upstream) != 1:
            return None
        workers = self.workers[s.id]

        def run_now(records: list) -> bool:
            for w in workers:
                if w.idle and w.run_blocking is None and not w.rts[0].is_async:
                    break
            else:
                return False
            errors: list[ErrorRecord] = []
            written = w.meters[-1].records_out
            now = perf_counter()
            try:
                ports = w.run_chain(records, errors)
                self._step(s, w, now, now, records, ports, now, errors, written)
            except Exception as e:  # noqa: BLE001 - a runtime bug: it ends the run, as in
                ch.fail(e)  # the worker (which raises it from its wait)
            return True

        return run_now

    async def _stage(self, s: PlanStage) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for w in self.workers[s.id]:
                    tg.create_task(self._worker(s, w))
        finally:
            self._close(s.id)

    async def _worker(self, s: PlanStage, w: StageWorker) -> None:
        """One replica's loop: take a micro-batch, run it, hand the results on."""
        x = w.execution
        w.start(f"{s.id}-{self.workers[s.id].index(w)}")
        ch = self.channels[s.id]
        max_n, collect = x.max_batch, x.call == "collect"
        max_wait = x.max_wait_ms / 1000.0
        ends = collect and w.rts[0].kind == "collect"  # a group ends its records' tickets
        is_sink = s.id in self.sinks
        while True:
            item = ch.get_nowait(max_n)
            if item is None:
                w.idle = True  # waiting with nothing buffered: ``_runner`` may use it
                try:
                    item = await (collect_batch(ch, max_n, max_wait) if collect
                                  else ch.get(max_n))
                finally:
                    w.idle = False
                if item is None:
                    return
            elif collect and len(item[2]) < max_n and max_wait > 0:
                item = await collect_batch(ch, max_n, max_wait, first_item=item)
            enq, born, batch = item  # type: ignore[misc]
            now = perf_counter()
            took = [strip(r) for r in batch] if ends and self.tickets else batch
            errors: list[ErrorRecord] = []
            written = w.meters[-1].records_out
            ports = await w.process(took, errors)
            self._step(s, w, enq, born, batch, ports, now, errors, written)
            if not is_sink:
                await self._emit(s.id, ports, born)

    def _step(self, s: PlanStage, w: StageWorker, enq: float, born: float, batch: list,
              ports: dict[str | None, list], now: float, errors: list[ErrorRecord],
              written: int) -> None:
        """Book one stage call that took ``batch`` (queued at ``enq``, born at ``born``,
        started at ``now``) and gave ``ports``: queue wait, scheduling, spans, the run's
        outputs and latency, error records, tickets."""
        n = len(batch)
        w.meters[0].queue_wait.record((now - enq) * 1e6, n)
        if s.id in self.first_stages:
            self.scheduling.record((now - born) * 1e6, n)
        if TRACING.tracer is not None:  # tracing off: this check is all it costs
            stage_spans(TRACING.tracer, s, batch, ports, errors, enq, now, perf_counter())
        if s.id in self.sinks:
            delivered = w.meters[-1].records_out - written  # sink records written now
            self.records_out += delivered
            self.latency.record((perf_counter() - born) * 1e6, delivered)
        if errors:
            self._error(errors)
        if self.tickets:
            self._account(s.id, batch, ports)


async def collect_batch(ch: Channel, max_n: int, max_wait: float,
                        first_item: tuple | None = None,
                        clock: Callable[[], float] = perf_counter) -> tuple | None:
    """Gather up to ``max_n`` records, waiting at most ``max_wait`` seconds after the
    first one arrives; a partial batch is returned at the deadline or at end of input."""
    item = first_item if first_item is not None else await ch.get(max_n)
    if item is None:
        return None
    enq, born, recs = item
    if len(recs) >= max_n or max_wait <= 0:
        return item
    recs = list(recs)
    deadline = clock() + max_wait
    while len(recs) < max_n:
        nxt = ch.get_nowait(max_n - len(recs))
        if nxt is not None:
            recs.extend(nxt[2])
            born = min(born, nxt[1])
            continue
        if ch.closed:
            break
        remaining = deadline - clock()
        if remaining <= 0:
            break
        await ch.wait_readable(remaining)
    return enq, born, recs


def _not_a_dict(x: Any) -> BaseException | None:
    """The record points at its request (and ticket): under admission it must be a
    dict."""
    if isinstance(x, dict):
        return None
    return TypeError(f"admission needs records that are dicts (JSON objects) to carry their "
                     f"ticket; got {type(x).__name__}: wrap it, e.g. {{'value': x}}")


def _user_fields(target: Any) -> Any:
    """A sink target that receives records without the request admission gave them."""
    if isinstance(target, list):
        append = target.append
        return lambda r: append(strip(r))
    if callable(target):
        return lambda r: target(strip(r))
    return target
