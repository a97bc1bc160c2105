"""The local runtime: a Plan on one asyncio event loop.

Each stage is one task per replica reading micro-batches from its bounded input
channel. ``inline`` stages run operator code on the loop; ``thread`` stages (blocking
code, replicas, timeouts) run it in worker threads; ``async`` stages await it. When a
stage's replicas have all seen the end of their input, it closes its downstream
channels, so end-of-input propagates through branches, merges and replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import islice
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...compiler import Plan, PlanStage
from ...errors import PlanError
from ...observability import Histogram, StageMeter
from ...observability.tracing import STATE as TRACING
from ...observability.tracing import stage_spans
from .channel import Channel
from .stage import ABANDON_CAP, Replica, call_careful, call_collect, sink_runtime

#: Largest micro-batch a source emits or a stage takes at once.
MAX_MICROBATCH = 1024


class LocalRun:
    """State of one run of a plan; ``execute()`` runs it to completion."""

    def __init__(self, plan: Plan, *, inputs: dict[str, Any], outputs: dict[str, Any],
                 on_error: Callable[[ErrorRecord], None], admission: Any = None,
                 on_drop: Callable[[str, list], None] | None = None,
                 admission_window: int = MAX_MICROBATCH,
                 drop_key: str | None = None) -> None:
        """Prepare a run (``execute`` runs it).

        inputs, outputs: records for sources and targets for sinks declared without them.
        on_error:  receives each ``ErrorRecord``.
        admission: the admission gate each record waits for, or None.
        on_drop:   ``on_drop(stage id, records)`` for records that ended without an
                   output or error (a server answers those requests instead of waiting
                   forever); needs ``drop_key``.
        admission_window: most arriving records waiting for admission at once; past
                   that the source stops reading its input.
        drop_key:  with ``on_drop``: a field every record keeps (a request id); a
                   record ended where no output or error of an operator carries its key.
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
        self.replicas: dict[str, list[Replica]] = {}
        self.source_meters: dict[str, StageMeter] = {}
        self.inputs = inputs
        # the blocking replicas' threads, with the runtime of the operator they call
        self.pools: list[tuple[ThreadPoolExecutor, Any]] = []
        for s in plan.stages:
            if s.ops[0].op.kind == "source":
                self.source_meters[s.id] = StageMeter(s.id, "source")
                continue
            self.channels[s.id] = Channel(s.queue, producers=len(s.upstream))
            self.replicas[s.id] = [Replica(s, self._build(s, outputs), on_drop, drop_key)
                                   for _ in range(s.replicas)]
        self.down: dict[str, dict[str | None, list[Channel]]] = {s.id: {} for s in plan.stages}
        sources = {s.id for s in plan.stages if s.ops[0].op.kind == "source"}
        self.first_stages = set()
        for s in plan.stages:
            for ref in s.upstream:
                src, _, port = ref.partition(".")
                self.down[src].setdefault(port or None, []).append(self.channels[s.id])
                if src in sources:
                    self.first_stages.add(s.id)

    def _build(self, s: PlanStage, outputs: dict[str, Any]) -> list:
        rts = []
        for o in s.ops:
            if o.op.kind == "sink":
                target = o.params.get("target")
                if target is None:
                    target = outputs.get(o.id)
                if target is None:
                    raise PlanError("sink has no target: pass a list or callable to "
                                    ".sink(...) or tr.run(p, output=...)", stage=o.id)
                if self.admission is not None:
                    target = _without_ticket(target)
                rts.append(sink_runtime(target))
            else:
                rts.append(o.op.build(o.params, o.contract))
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
            for pool, rt in self.pools:
                # a finished run leaves no thread behind, except one running an abandoned
                # timed-out call (it cannot be stopped); an interrupted run does not wait
                pool.shutdown(wait=finished and rt.abandoned == 0, cancel_futures=True)
            if self.admission is not None:  # an interrupted run: free what is left
                for ticket, _ in list(self.tickets.values()):
                    self.admission.done(ticket)
                self.tickets.clear()

    def _error(self, errs: list[ErrorRecord]) -> None:
        self.errors += len(errs)
        for e in errs:
            self.on_error(e)

    # -- admission: every ticket taken is given back exactly once -----------------------
    # An admitted record carries its ticket in ``_admission``; ``tickets`` counts the
    # copies of it in flight (fan-out and flat_map children add, every stage's input
    # subtracts, its outputs add back). A record ends where its ticket stops appearing:
    # at a sink, as an error record, dropped by a filter, or replaced by a stage with a
    # record that does not carry it. The count reaching 0 releases the ticket.
    def _account(self, sid: str, batch: list, ports: dict[str | None, list]) -> None:
        """Under admission: one stage call took ``batch`` and emitted ``ports``."""
        delta: dict[int, int] = {}
        for r in batch:
            t = r.get("_admission") if isinstance(r, dict) else None
            if t is not None:
                delta[id(t)] = delta.get(id(t), 0) - 1
        down = self.down[sid]
        for port, records in ports.items():
            k = len(down.get(port, ()))
            if k:
                for r in records:
                    t = r.get("_admission") if isinstance(r, dict) else None
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

    async def _admit(self, x: Any, born: float, down: list[Channel],
                     window: asyncio.Semaphore) -> None:
        """One arriving record through the admission gate, then into the plan."""
        try:
            if not isinstance(x, dict):  # the ticket rides in the record: it must be a dict
                self.errors += 1
                self.on_error(ErrorRecord.from_exception("admission", x, TypeError(
                    f"admission needs records that are dicts (JSON objects) to carry their "
                    f"ticket; got {type(x).__name__}: wrap it, e.g. {{'value': x}}")))
                return
            try:
                ticket = await self.admission.admit(self.plan.name, x)
            except Exception as e:  # noqa: BLE001 - AdmissionRejected (or a gate failure)
                self.errors += 1
                self.on_error(ErrorRecord.from_exception("admission", x, e))
                return
            self.tickets[id(ticket)] = [ticket, len(down)]
            rec = [{**x, "_admission": ticket}]
            for ch in down:
                if not ch.put_nowait(rec, born):
                    await ch.put(rec, born)
        finally:
            window.release()

    async def _admitted_source(self, data: Any, down: list[Channel],
                               meter: StageMeter) -> None:
        """Open-loop ingress: each record waits for admission in its own task, so a
        queued record does not delay the arrival of the next one — up to
        ``admission_window`` records waiting at once; past that the source stops reading
        (memory stays flat whatever the input size)."""
        window = asyncio.Semaphore(self.admission_window)
        async with asyncio.TaskGroup() as tg:
            if hasattr(data, "__aiter__"):
                async for x in data:
                    await window.acquire()
                    meter.records_out += 1
                    tg.create_task(self._admit(x, perf_counter(), down, window))
            else:
                for x in data:
                    await window.acquire()
                    meter.records_out += 1
                    tg.create_task(self._admit(x, perf_counter(), down, window))

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
        try:
            if self.admission is not None:
                await self._admitted_source(data, down, meter)
            elif hasattr(data, "__aiter__"):
                async for x in data:
                    born = perf_counter()
                    meter.records_out += 1
                    for ch in down:
                        if not ch.put_nowait([x], born):
                            await ch.put([x], born)
            else:
                n = min([MAX_MICROBATCH] + [ch.bound for ch in down])
                it = iter(data)
                failure = None
                while failure is None:
                    chunk: list = []
                    try:
                        chunk.extend(islice(it, n))  # keeps what was read before a failure
                    except Exception as e:  # noqa: BLE001 - the input itself failed
                        failure = e
                    if not chunk:
                        break
                    born = perf_counter()
                    meter.records_out += len(chunk)
                    for ch in down:
                        if not ch.put_nowait(chunk, born):
                            await ch.put(chunk, born)
                if failure is not None:
                    raise failure
        except Exception as e:  # the input itself failed: report it, end the stream
            meter.errors += 1
            self._error([ErrorRecord.from_exception(
                op.id, f"<after record {meter.records_out}>", e)])
        finally:
            meter.records_in = meter.records_out
            self.records_in += meter.records_out
            self._close(s.id)

    async def _stage(self, s: PlanStage) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for rep in self.replicas[s.id]:
                    tg.create_task(self._worker(s, rep))
        finally:
            self._close(s.id)

    async def _worker(self, s: PlanStage, rep: Replica) -> None:
        ch = self.channels[s.id]
        first = s.ops[0]
        rt = rep.rts[0]
        meter = rep.meters[0]
        batch_spec = first.contract.batch
        collect = rt.kind == "collect" or batch_spec is not None
        if collect:
            max_n = batch_spec.max_size if batch_spec else first.params["max_size"]
            max_wait = (batch_spec.max_wait_ms if batch_spec else first.params["max_wait_ms"])
            max_wait /= 1000.0
        else:
            max_n = max(1, min(MAX_MICROBATCH, s.queue) // s.replicas)
            max_wait = 0.0
        if rt.max_batch is not None and not (collect and batch_spec):
            max_n = min(max_n, rt.max_batch)
        careful = (rt.is_async or first.contract.retries > 0
                   or first.contract.timeout_ms is not None)
        run_blocking = None
        if s.mode == "thread":
            # One dedicated thread per blocking replica (native libraries such as llama.cpp
            # keep per-thread state: OpenMP teams, caches); under a timeout, spare threads
            # for up to ABANDON_CAP abandoned calls, so one never blocks the replica.
            i = self.replicas[s.id].index(rep)
            n = 1 + (ABANDON_CAP if first.contract.timeout_ms is not None else 0)
            pool = ThreadPoolExecutor(n, thread_name_prefix=f"tailrace-{s.id}-{i}")
            self.pools.append((pool, rt))
            run_blocking = partial(asyncio.get_running_loop().run_in_executor, pool)
        await self._serve(s, rep, ch, first, rt, meter, max_n, max_wait, collect, careful,
                          run_blocking)

    async def _serve(self, s: PlanStage, rep: Replica, ch: Channel, first: Any, rt: Any,
                     meter: StageMeter, max_n: int, max_wait: float, collect: bool,
                     careful: bool, run_blocking: Any) -> None:
        """The replica's loop: take a micro-batch, run it, hand the results on."""
        is_sink = s.ops[-1].op.kind == "sink"
        first_stage = s.id in self.first_stages
        errors: list[ErrorRecord] = []
        counted = 0  # sink records already added to the run's total
        while True:
            item = ch.get_nowait(max_n)
            if item is None:
                item = await (collect_batch(ch, max_n, max_wait) if collect else ch.get(max_n))
                if item is None:
                    return
            elif collect and len(item[2]) < max_n and max_wait > 0:
                item = await collect_batch(ch, max_n, max_wait, first_item=item)
            enq, born, batch = item  # type: ignore[misc]
            now = perf_counter()
            n = len(batch)
            meter.queue_wait.record((now - enq) * 1e6, n)
            if first_stage:
                self.scheduling.record((now - born) * 1e6, n)
            ports: dict[str | None, list]
            if collect:
                # a batch window ends its records' tickets: its list holds them without
                took = batch if not (self.tickets and rt.kind == "collect") else \
                    [_strip_ticket(r) for r in batch]
                ports = {None: await call_collect(s.ops[0], rep.rts[0], rep.meters[0], took,
                                                  run_blocking, errors)}
            elif careful:
                ports = await call_careful(s.ops[0], rep.rts[0], rep.meters[0], batch,
                                           run_blocking, errors, self.on_drop)
            elif run_blocking is not None:
                ports = await run_blocking(rep.run_chain, batch, errors)
            else:
                ports = rep.run_chain(batch, errors)
            if TRACING.tracer is not None:  # tracing off: this check is all it costs
                stage_spans(TRACING.tracer, s, batch, ports, errors, enq, now, perf_counter())
            if is_sink:
                sm = rep.meters[-1]
                delivered = sm.records_out - counted
                counted = sm.records_out
                self.records_out += delivered
                self.latency.record((perf_counter() - born) * 1e6, delivered)
            if errors:
                self._error(errors)
                errors = []
            if self.tickets:
                self._account(s.id, batch, ports)
            if not is_sink:
                await self._emit(s.id, ports, born)



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


def _strip_ticket(r: Any) -> Any:
    """``r`` without its admission ticket (a copy: the same record may still be in
    flight on another branch)."""
    if isinstance(r, dict) and "_admission" in r:
        return {k: v for k, v in r.items() if k != "_admission"}
    return r


def _without_ticket(target: Any) -> Any:
    """A sink target that receives records without their admission ticket."""
    strip = _strip_ticket
    if isinstance(target, list):
        append = target.append
        return lambda r: append(strip(r))
    if callable(target):
        return lambda r: target(strip(r))
    return target
