"""The driver of a Ray run: places the plan on hosts, feeds it, delivers its results.

The driver process keeps what is bound to the caller: sources and sinks (and the
stages ``driver_stages`` puts here); every other stage runs in ``StageHost`` actors. A
source batch is done when its push is acknowledged end to end; one long-polling
``drain`` per host brings back what the ledger de-duplicates (``ledger.py``). Under
admission a record's ticket is released exactly once, when its one-record source batch
is acknowledged end to end or the run ends. A served run keeps each record's live
request here (``served.py``); a batch acknowledged with no output or error record for
its record was dropped by a stage, and ``on_drop`` hears of it.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from collections.abc import Callable
from itertools import count
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...compiler import Plan
from ...observability import Histogram, StageMeter
from ...request import request_of
from ..ingress import input_failed, read, read_admitted
from ..stage import sink_runtime, sink_target, stage_meter, write_sink
from ..stats import RayRunStats, build_stats
from .autoscale import Elastic
from .credits import Link, cause, gather_acks, ray_errors, send_all
from .host import Entries
from .install import install, preflight
from .instance import HostedWorker
from .ledger import Ledger
from .messages import (
    BatchKey,
    Commit,
    Delivery,
    Drained,
    Failures,
    Lineage,
    MeterReport,
    Pieces,
)
from .placement import HostHandle, StagePlacement, driver_stages
from .served import ServedRequests

#: Seconds between looks for cancelled callers in a served run.
CANCEL_POLL_S = 0.05

#: Most source records waiting for admission (or for credits right after it) at once,
#: per source; fewer when the first edge's window is smaller. A served run's records
#: are in memory already (the service bounds them, ``max_pending``): all of them go to
#: the gate at once, so it queues or rejects them by its own bounds, never a feed
#: queue in front of it (under overload a 429 would otherwise wait for its turn).
ADMISSION_WAITS = 64


class _Sink:
    __slots__ = ("op_id", "rt", "meter", "queued", "first")

    def __init__(self, op_id: str, rt: Any, meter: StageMeter, queued: bool, first: bool):
        self.op_id, self.rt, self.meter, self.queued, self.first = op_id, rt, meter, queued, first


class _DriverBox(Entries):
    """The outbox of the driver's sources and of the stage replicas that run in it
    (``driver_stages``): each entry goes through the run's ledger now, its
    acknowledgement (the returned future) done at once."""

    def __init__(self, run: RayRun) -> None:
        self.run = run
        self.reroutes = {}  # no replica here was installed late

    def put(self, entry: Delivery | Failures | Commit) -> asyncio.Future:
        self.run.take(entry)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


class RayRun:
    """One run of a plan on Ray; ``execute()`` runs it to completion.

    plan, inputs, outputs, on_error, admission: as ``run_on_ray``.
    placements: stage index -> ``StagePlacement`` (``parse_placement``).
    on_drop:    ``on_drop(stage ids, records)`` for source records that ended without an
                output or error record (a served run, its records found by their
                ``REQUEST``: the caller is answered at once).
    on_ready:   called once every stage replica is installed (engines opened).
    """

    def __init__(self, plan: Plan, *, inputs: dict[str, Any], outputs: dict[str, Any],
                 on_error: Callable[[ErrorRecord], None], admission: Any = None,
                 placements: dict[int, StagePlacement] | None = None,
                 on_drop: Callable[[str, list], None] | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.plan = plan
        self.on_drop = on_drop
        self.on_ready = on_ready
        self.served = ServedRequests(self._sink) if on_drop is not None else None
        ops = [o for s in plan.stages for o in s.ops if o.op.kind not in ("source", "sink")]
        self.droppers = ", ".join(o.id for o in ops if o.op.name in ("filter", "flat_map")
                                  ) or ", ".join(o.id for o in ops)  # named in a drop
        self.inputs = inputs
        self.on_error = on_error
        self.admission = admission
        self.placements = placements or {}
        self.run_id = uuid.uuid4().hex[:12]
        self.latency = Histogram()
        self.scheduling = Histogram()
        self.records_in = self.records_out = self.errors = 0
        self.actor_restarts = 0
        self.source_meters: dict[int, StageMeter] = {}
        self.sinks: dict[int, _Sink] = {}
        self.reports: dict[tuple, MeterReport] = {}
        self.final: set[tuple] = set()
        self.ledger = Ledger()  # what each source batch delivered (de-duplication)
        self.consumers = plan.consumers()
        self.first = plan.first_stages()
        sources = {i for i, s in enumerate(plan.stages) if s.ops[0].op.kind == "source"}
        for i, s in enumerate(plan.stages):
            if i in sources:
                self.source_meters[i] = StageMeter(s.id, "source")
            elif s.ops[-1].op.kind == "sink":
                o = s.ops[-1]
                j = len(s.ops) - 1
                self.sinks[i] = _Sink(o.id, sink_runtime(sink_target(o, outputs)),
                                      stage_meter(s, j), queued=j == 0, first=i in self.first)
        # stages in this process (no actor hop), then those the hosts run
        self.in_driver = driver_stages(plan, self.placements, served=on_drop is not None)
        self.local: dict[int, HostedWorker] = {}  # their replicas (``install``)
        self.box = _DriverBox(self)
        self.host_stages = [i for i, s in enumerate(plan.stages)
                            if i not in sources and i not in self.in_driver
                            and any(o.op.kind != "sink" for o in s.ops)]
        self.stages = preflight(plan, self.host_stages)  # shipped stages, checked
        self.source_links: dict[int, list[Link]] = {}
        self.hosts: list[HostHandle] = []
        self.assignment: dict[tuple[int, int], HostHandle] = {}
        self.incarnations: dict[int, str] = {}  # id(host) -> incarnation seen
        self.replica_incarnations: dict[tuple[int, int], set[str]] = {}
        self.spec_refs: dict[int, Any] = {}  # stage -> its install spec (an ObjectRef)
        self.elastic = Elastic(self)  # elastic stages' replicas and scaling
        self.tg: asyncio.TaskGroup | None = None  # the run's tasks (``execute``)

    # -- the run --------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """This run's pipeline, id, ``{stage id: [(actor name, node id), ...]}`` (every
        operator id of a fused stage names the stage's actors), the ids of the operators
        that run in the driver (``in_driver``), the active replicas per stage and its
        scale events so far (as ``RayRunStats.scale_events``)."""
        stages: dict[str, list[tuple[str, str | None]]] = {}
        for (i, _), h in sorted(self.assignment.items()):
            for o in self.plan.stages[i].ops:
                if o.op.kind != "sink":
                    stages.setdefault(o.id, []).append((h.name, h.node))
        active = {self.plan.stages[i].id: sum(a) for i, a in self.elastic.active.items()}
        in_driver = [o.id for i in sorted(self.in_driver) for o in self.plan.stages[i].ops
                     if o.op.kind != "sink"]
        return {"pipeline": self.plan.name, "run_id": self.run_id, "stages": stages,
                "in_driver": in_driver, "active_replicas": active,
                "scale_events": list(self.elastic.events)}

    async def execute(self) -> None:
        finished = False
        try:
            await install(self)
            if self.on_ready is not None:
                self.on_ready()
            async with asyncio.TaskGroup() as tg:
                self.tg = tg
                drains = [tg.create_task(self.drain(h)) for h in self.hosts]
                if self.served is not None:
                    drains.append(tg.create_task(self._watch_cancels(self.served)))
                if self.elastic.stages:
                    drains.append(tg.create_task(self.elastic.scale()))
                async with asyncio.TaskGroup() as sources:
                    for i in self.source_meters:
                        sources.create_task(self._source(i))
                # every source batch is acknowledged end to end: all records are out
                await self._finish()
                finished = True
                for t in drains + list(self.elastic.steps.values()):  # only meter snapshots
                    t.cancel()  # may be left, and finish had them
        except BaseExceptionGroup as eg:
            raise cause(eg.exceptions[0]) from None
        finally:
            if not finished:  # failed or interrupted: release the replicas, don't wait
                for h in self.hosts:
                    h.handle.finish.remote(self.run_id)
                self._close_local()

    async def _finish(self) -> None:
        """End the run on every host and keep the replicas' final meter snapshots."""
        if self.served is not None:  # their pieces had every chance to arrive
            self.served.unpark_all()
        for ref in [h.handle.finish.remote(self.run_id) for h in self.hosts]:
            try:
                reports = await ref
            except ray_errors():  # died at the very end: its last snapshots must do
                continue
            for rep in reports:
                self._report(rep, final=True)
        self._close_local()

    def _close_local(self) -> None:
        """Stop the replicas in the driver, keeping their final meter snapshots."""
        for inst in self.local.values():
            self._report(inst.report(), final=True)
            inst.close()
        self.local.clear()

    def _report(self, rep: MeterReport, final: bool = False) -> None:
        self.elastic.latest[(rep.stage, rep.replica)] = rep
        key = (rep.stage, rep.replica, rep.incarnation)
        self.replica_incarnations.setdefault(key[:2], set()).add(rep.incarnation)
        if final:
            self.final.add(key)
        elif key in self.final:  # an older snapshot drained after the final one
            return
        self.reports[key] = rep

    async def drain(self, host: HostHandle) -> None:
        ack = 0
        delay = 0.02
        while True:
            inc = self.incarnations.get(id(host), "")
            try:
                d: Drained = pickle.loads(await host.handle.drain.remote(self.run_id, ack, inc))
            except ray_errors():  # restarting: its outbox is gone, producers replay
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)
                continue
            delay = 0.02
            if d.incarnation != self.incarnations.get(id(host)):
                if id(host) in self.incarnations:
                    self.actor_restarts += 1
                    self.elastic.reroute_host(host)  # it forgot how elastic stages scaled
                self.incarnations[id(host)] = d.incarnation
            for e in d.entries:
                if type(e) is MeterReport:
                    self._report(e)
                elif type(e) is Pieces:
                    if self.served is not None:
                        self.served.pieces(e.pieces)
                else:
                    self.take(e)
            ack = d.last_seq
            if d.closed:
                return

    # -- sources --------------------------------------------------------------------------
    async def _source(self, i: int) -> None:
        op = self.plan.stages[i].ops[0]
        data = op.params["data"] if op.params.get("data") is not None else self.inputs[op.id]
        meter = self.source_meters[i]
        links = self.source_links[i]
        pending: set[asyncio.Task] = set()
        seq = 0

        async def send(records: list) -> None:
            nonlocal seq
            key = (i, seq)
            seq += 1
            acks: list = []
            if self.served is not None:
                self.served.hold(records)
            await send_all(links, key, records, range(len(records)), time.time(), acks)
            t = asyncio.ensure_future(self._settle(key, acks, None, records))
            pending.add(t)
            t.add_done_callback(pending.discard)

        try:
            if self.admission is not None:
                await self._admitted(i, data, links, meter)
            else:
                await read(data, max([1] + [link.chunk for link in links]), meter, send)
        except Exception as e:  # the input itself failed: report it, end the stream
            self.errors += 1
            self.on_error(input_failed(op.id, meter, e))
        finally:
            meter.records_in = meter.records_out
            self.records_in += meter.records_out
        while pending:
            await asyncio.gather(*list(pending))

    async def _admitted(self, i: int, data: Any, links: list[Link],
                        meter: StageMeter) -> None:
        """Admission at the source (``ingress.read_admitted``): an admitted record is
        sent as a one-record source batch, its ticket released by ``_settle``."""
        counter = count()
        gate = self.admission
        # a served request carries its class and deadline to the engines
        served = self.served
        urgency = getattr(gate, "urgency", None) if served is not None else None
        k = (max(1, min([ADMISSION_WAITS] + [link.window.size for link in links]))
             if served is None else 1 << 20)

        async def send(x: Any, ticket: Any, arrived: float) -> Any:
            key = (i, next(counter))
            acks: list = []
            born = time.time() - (perf_counter() - arrived)  # latency counts the wait
            records = [x]
            if served is not None:
                req = request_of(x)
                if req is not None and urgency is not None:
                    req.granted = urgency(ticket)
                served.hold(records)
            try:
                await send_all(links, key, records, range(len(records)), born, acks)
            except BaseException:
                self.ledger.settle(key)
                if served is not None:
                    served.forget(records)
                gate.done(ticket)
                raise
            return self._settle(key, acks, ticket, records)

        def refuse(x: Any, e: BaseException) -> None:
            self.errors += 1
            self.on_error(ErrorRecord.from_exception("admission", x, e))

        await read_admitted(data, gate, self.plan.name, k, meter, send, refuse)

    async def _settle(self, key: BatchKey, acks: list, ticket: Any,
                      records: list) -> None:
        """A source batch is acknowledged end to end (or the run ends): forget its
        lineage, report its records nothing answered (served runs), free its ticket."""
        try:
            await gather_acks(acks)
            if self.on_drop is not None and self.served is not None:
                gone = self.served.unanswered(records)
                if gone:
                    self.on_drop(self.droppers, gone)
        finally:
            self.ledger.settle(key)
            if self.served is not None:
                self.served.forget(records)
            if ticket is not None:
                self.admission.done(ticket)

    async def _watch_cancels(self, served: ServedRequests) -> None:
        """Tell every host about callers that gave up (their records' flags get set)."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            rids = served.newly_cancelled()
            if rids:
                for h in self.hosts:
                    h.handle.cancel.remote(self.run_id, rids)

    # -- sinks and errors (in the driver) -------------------------------------------------
    def take(self, entry: Any) -> None:
        """An outbox entry, through the ledger: what it lets through goes to the sinks
        and the error handler."""
        served = self.served
        for e in self.ledger.commit(entry) if type(entry) is Commit else self.ledger.offer(entry):
            if type(e) is Delivery:
                records = e.records
                if served is not None:
                    expected = served.arrived(records)
                    if expected:
                        records = served.ready(e.target, records, expected, e.born, e.sent)
                if records:
                    self._sink(e.target, records, e.born, e.sent)
            elif type(e) is Failures:
                if served is not None:
                    served.arrived([err.input for err in e.errors])
                self._errors(e.errors)
            else:  # Unsendable: sink records that could not come back
                sid = self.sinks[e.target].op_id
                self._errors([ErrorRecord(sid, r, "TypeError", e.reason) for r in e.reprs])

    def _sink(self, target: int, records: list, born: float, sent: float) -> None:
        n = len(records)
        st = self.sinks[target]
        m = st.meter
        now = time.time()
        if st.queued:
            m.queue_wait.record(max(0.0, now - sent) * 1e6, n)
        if st.first:
            self.scheduling.record(max(0.0, now - born) * 1e6, n)
        m.records_in += n
        errors: list[ErrorRecord] = []
        ok = write_sink(st.op_id, st.rt, m, records, errors)
        self._errors(errors)
        self.records_out += ok
        self.latency.record(max(0.0, time.time() - born) * 1e6, ok)

    def _errors(self, errors: list) -> None:
        for err in errors:
            self.errors += 1
            self.on_error(err)

    def unsendable(self, key: BatchKey, records: list, lin: Lineage,
                   exc: BaseException) -> asyncio.Future:
        sid = self.plan.stages[key[0]].ops[0].id
        return self.box.fail(key[0], key, [ErrorRecord.from_exception(sid, x, TypeError(
            f"record cannot be sent to a Ray actor: {exc}")) for x in records], lin)

    # -- statistics -----------------------------------------------------------------------
    def stats(self, wall: float, interrupted: bool) -> RayRunStats:
        """The run's statistics, in the local runtime's format (plus restarts, nodes)."""
        for inst in self.local.values():  # the driver's replicas: as they are now
            self._report(inst.report())
        depth: dict[int, int] = {}
        for links in self.source_links.values():
            for link in links:
                if link.route.sink:
                    depth[link.route.target] = max(depth.get(link.route.target, 0),
                                                   link.window.max_used)
        return build_stats(
            self.plan, self.reports, source_meters=self.source_meters,
            sink_meters={i: s.meter for i, s in self.sinks.items()}, sink_depth=depth,
            totals=(self.records_in, self.records_out, self.errors), wall=wall,
            latency=self.latency, scheduling=self.scheduling, interrupted=interrupted,
            actor_restarts=self.actor_restarts, duplicates=self.ledger.dropped,
            incarnations=self.replica_incarnations, scale_events=tuple(self.elastic.events))
