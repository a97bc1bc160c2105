"""The driver of a Ray run: places the plan on hosts, feeds it, delivers its results.

The driver process keeps what is bound to the caller: sources (iterables, async
generators, JSONL readers) and sinks (lists, callables, writers). Every other stage runs
in ``StageHost`` actors. The driver reads the source in micro-batches and pushes them
under each edge's credit window; a source batch is done when its push is acknowledged
end to end. One long-polling ``drain`` per host brings back sink records, error records,
fan-out commits and meter snapshots; the ledger de-duplicates records by lineage
(``ledger.py``), so replays after an actor restart never reach a sink or the error
handler twice, even when the replayed stages emit different records.

Under admission each record waits for the gate in a task of its own (open-loop: a
queued record does not delay the next arrival), but at most ``ADMISSION_WAITS`` of them
at once: the source stops reading while that many wait, so memory stays flat whatever
the input size. A record's ticket is released exactly once, when its source batch is
acknowledged end to end (output, error record or drop alike) or the run ends.

A served run (``drop_key``, ``PipelineService(runtime="ray")``) keeps each record's live
``_cancel``/``_stream`` here by its request key and ships marks (``transient.py``):
a cancelled caller's flag is pushed to the hosts, streamed pieces come back with the
drains. A source batch acknowledged end to end whose record no output or error record
answered was dropped by a stage (a filter, an empty flat_map): ``on_drop`` hears of it.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from itertools import count
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...compiler import Plan, PlanOp, PlanStage
from ...errors import PlanError
from ...observability import Histogram, StageMeter
from ..ingress import input_failed, read, read_admitted
from ..stage import sink_runtime, sink_target, stage_meter, write_sink
from ..stats import RayRunStats, build_stats
from .credits import Link, cause, gather_acks, ray_errors
from .ledger import Ledger
from .messages import (
    BatchKey,
    Commit,
    Delivery,
    Drained,
    Failures,
    InstallSpec,
    Lineage,
    MeterReport,
    Pieces,
    Route,
)
from .placement import HostHandle, StagePlacement, host_pool
from .transient import detach, reattach

#: Seconds between looks for cancelled callers in a served run.
CANCEL_POLL_S = 0.05
#: Seconds an install waits for a stage host that is restarting (a pooled host killed
#: by an earlier run) before the run fails.
INSTALL_WAIT_S = 30.0
#: longest a served output waits for its streamed pieces (they ride another host's
#: drains); past it the output goes anyway (pieces lost with a dead host never come)
PIECES_WAIT_S = 2.0

#: Most source records waiting for admission (or for credits right after it) at once,
#: per source; fewer when the first edge's window is smaller. A served run's records
#: are in memory already (the service bounds them, ``max_pending``): all of them go to
#: the gate at once, so it queues or rejects them by its own bounds, never a feed
#: queue in front of it (under overload a 429 would otherwise wait for its turn).
ADMISSION_WAITS = 64

#: Seconds between autoscaling looks at an elastic stage (``replicas: {min, max}``).
SCALE_TICK_S = 0.25
#: An elastic stage gains a replica once, for this long, every replica that takes new
#: pushes has input queued (and is not itself waiting for its consumers' credits), or
#: it is a first stage, all its replicas are busy and requests wait at admission.
SCALE_UP_S = 1.0
#: It loses one (the replica stops taking new pushes) once one of them has been idle
#: (empty queue, nothing running) for this long.
SCALE_DOWN_S = 10.0


def chunk_size(s: PlanStage) -> int:
    """Records per push into stage ``s`` (its ``Execution``'s)."""
    assert s.execution is not None, "a source has no pushes into it"
    return s.execution.push


def shipped(stage: PlanStage) -> PlanStage:
    """The stage as sent to a host: sink targets (the caller's lists/writers) removed.

    stage: the compiled stage.
    """
    def strip(o: PlanOp) -> PlanOp:
        if o.op.kind != "sink":
            return o
        return replace(o, params={**o.params, "target": None},
                       spec=replace(o.spec, params={**o.spec.params, "target": None}))

    return replace(stage, ops=tuple(strip(o) for o in stage.ops))


def preflight(plan: Plan, host_stages: list[int]) -> dict[int, PlanStage]:
    """Serialise every operator that will run in an actor; a failure is a ``PlanError``
    naming the stage, raised before any actor starts. Returns the stages to ship.

    plan:        the compiled plan.
    host_stages: indexes of the stages that run in actors.
    """
    from ray import cloudpickle

    out = {}
    for i in host_stages:
        st = shipped(plan.stages[i])
        for o in st.ops:
            try:
                cloudpickle.dumps(o)
            except Exception as e:  # noqa: BLE001 - any pickling failure
                reason = str(e).splitlines()[0] if str(e) else ""
                raise PlanError(
                    f"cannot be sent to a Ray actor: pickling its operator failed "
                    f"({type(e).__name__}: {reason}); define functions and operators at "
                    "module level and create locks, files and clients inside them instead "
                    "of capturing them (or use the local runtime)", stage=o.id) from None
        out[i] = st
    return out


class _Sink:
    __slots__ = ("op_id", "rt", "meter", "queued", "first")

    def __init__(self, op_id: str, rt: Any, meter: StageMeter, queued: bool, first: bool):
        self.op_id, self.rt, self.meter, self.queued, self.first = op_id, rt, meter, queued, first


class RayRun:
    """One run of a plan on Ray; ``execute()`` runs it to completion.

    plan:       the compiled plan (the same one the local runtime runs).
    inputs:     data for sources declared without it, by operator id.
    outputs:    targets for sinks declared without one, by operator id.
    on_error:   receives each ``ErrorRecord``.
    admission:  an admission gate each source record waits for (or None).
    placements: stage index -> ``StagePlacement``.
    on_drop:    ``on_drop(stage ids, records)`` for source records that ended without an
                output or error record (a served run: the caller is answered at once);
                needs ``drop_key``.
    drop_key:   with ``on_drop``: the field every record keeps (a request id); records'
                live ``_cancel``/``_stream`` travel by it (see the module doc).
    on_ready:   called once every stage replica is installed (engines opened).
    """

    def __init__(self, plan: Plan, *, inputs: dict[str, Any], outputs: dict[str, Any],
                 on_error: Callable[[ErrorRecord], None], admission: Any = None,
                 placements: dict[int, StagePlacement] | None = None,
                 on_drop: Callable[[str, list], None] | None = None,
                 drop_key: str | None = None,
                 on_ready: Callable[[], None] | None = None) -> None:
        if on_drop is not None and drop_key is None:
            raise ValueError("a drop hook needs the drop_key its records keep")
        self.plan = plan
        self.on_drop = on_drop
        self.drop_key = drop_key
        self.on_ready = on_ready
        self.held: dict[Any, tuple[Any, Any]] = {}  # request key -> (_cancel, _stream)
        self.answered: set = set()  # request keys with an output or error record
        self.cancels_sent: set = set()
        self.streamed: dict[Any, int] = {}  # request key -> pieces handed to its caller
        # request key -> (pieces its output waits for, [(sink, record, born, sent)])
        self.parked: dict[Any, tuple[int, list]] = {}
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
                target = sink_target(o, outputs)
                j = len(s.ops) - 1
                self.sinks[i] = _Sink(o.id, sink_runtime(target), stage_meter(s, j),
                                      queued=j == 0, first=i in self.first)
        self.host_stages = [i for i, s in enumerate(plan.stages)
                            if i not in sources and any(o.op.kind != "sink" for o in s.ops)]
        self.stages = preflight(plan, self.host_stages)
        self.source_links: dict[int, list[Link]] = {}
        self.hosts: list[HostHandle] = []
        self.assignment: dict[tuple[int, int], HostHandle] = {}
        self.incarnations: dict[int, str] = {}  # id(host) -> incarnation seen
        self.replica_incarnations: dict[tuple[int, int], set[str]] = {}
        # elastic stages (see ``_autoscale``): their replicas' hosts, install specs and
        # whether each takes new pushes; the latest report of each replica
        self.elastic = [i for i in self.host_stages if plan.stages[i].elastic]
        self.spec_refs: dict[int, Any] = {}
        self.replica_hosts: dict[int, list] = {}
        self.replica_specs: dict[int, list] = {}
        self.active: dict[int, list[bool]] = {}
        self.latest: dict[tuple[int, int], MeterReport] = {}
        self.scale_events: list[tuple[float, str, int]] = []  # (time, stage id, replicas)
        self._tg: asyncio.TaskGroup | None = None
        self._steps: dict[int, asyncio.Task] = {}  # elastic stage -> its scale-out

    # -- placement and installation -------------------------------------------------------
    def _route(self, consumer: int, assignment: dict, holders: dict) -> Route:
        s = self.plan.stages[consumer]
        if consumer not in self.host_stages:  # a sink the driver runs
            return Route(consumer, True, (), (), s.queue, chunk_size(s), s.id)
        hosts = tuple(assignment[(consumer, r)].handle for r in range(s.replicas))
        return Route(consumer, False, hosts, holders[consumer], s.queue, chunk_size(s), s.id)

    async def _install(self) -> None:
        import ray

        assignment = host_pool().assign(self.plan, self.host_stages, self.placements)
        self.assignment = assignment
        env = {k: v for k, v in os.environ.items() if k.startswith("TAILRACE_")}
        path = tuple(p for p in sys.path if p and os.path.isdir(p))
        holders: dict[int, tuple[list, ...]] = {}
        for i in reversed(self.host_stages):  # consumers first: routes name their specs
            s = self.plan.stages[i]
            routes: dict[str | None, tuple[Route, ...]] = {}
            if s.ops[-1].op.kind == "sink":
                routes[None] = (Route(i, True, (), (), s.queue, chunk_size(s), s.id),)
            for port, stage_ids in self.consumers[i].items():
                routes[port] = tuple(self._route(c, assignment, holders) for c in stage_ids)
            spec = InstallSpec(self.run_id, i, self.stages[i], routes, i in self.first, env,
                               path, self.drop_key)
            ref = ray.put(spec)
            holders[i] = tuple([ref] for _ in range(s.replicas))
            self.spec_refs[i] = ref
        for i in self.elastic:
            self.replica_hosts[i] = [assignment[(i, r)].handle
                                     for r in range(self.plan.stages[i].replicas)]
            self.replica_specs[i] = list(holders[i])
            self.active[i] = [True] * self.plan.stages[i].replicas
        for i in self.source_meters:
            self.source_links[i] = [
                Link(self._route(c, assignment, holders), self.run_id, self._deliver,
                     self._unsendable) for c in self.consumers[i].get(None, [])]
        seen: dict[int, HostHandle] = {}
        for h in assignment.values():
            seen.setdefault(id(h), h)
        self.hosts = list(seen.values())
        calls = [(i, r, h.handle.install.remote(list(holders[i][r]), r))
                 for (i, r), h in assignment.items()]
        for i, r, ref in calls:
            h = assignment[(i, r)]
            deadline = time.monotonic() + INSTALL_WAIT_S
            while True:
                try:
                    done = await ref
                    break
                except ray_errors() as e:  # a pooled host still restarting (killed earlier)
                    if time.monotonic() > deadline:
                        raise cause(e) from None
                    await asyncio.sleep(0.1)
                    ref = h.handle.install.remote(list(holders[i][r]), r)
                except Exception as e:  # noqa: BLE001 - building the stage failed on the host
                    raise cause(e) from None
            h.node = done.node
            self.incarnations[id(h)] = done.incarnation
            self.replica_incarnations.setdefault((i, r), set()).add(done.replica)

    # -- the run --------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """This run's pipeline, id, ``{stage id: [(actor name, node id), ...]}`` (every
        operator id of a fused stage names the stage's actors), the active replicas per
        stage and its scale events so far (as ``RayRunStats.scale_events``)."""
        stages: dict[str, list[tuple[str, str | None]]] = {}
        for (i, _), h in sorted(self.assignment.items()):
            for o in self.plan.stages[i].ops:
                if o.op.kind != "sink":
                    stages.setdefault(o.id, []).append((h.name, h.node))
        active = {self.plan.stages[i].id: sum(a) for i, a in self.active.items()}
        return {"pipeline": self.plan.name, "run_id": self.run_id, "stages": stages,
                "active_replicas": active, "scale_events": list(self.scale_events)}

    async def execute(self) -> None:
        finished = False
        try:
            await self._install()
            if self.on_ready is not None:
                self.on_ready()
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                drains = [tg.create_task(self._drain(h)) for h in self.hosts]
                if self.drop_key is not None:
                    drains.append(tg.create_task(self._watch_cancels()))
                if self.elastic:
                    drains.append(tg.create_task(self._autoscale()))
                async with asyncio.TaskGroup() as sources:
                    for i in self.source_meters:
                        sources.create_task(self._source(i))
                # every source batch is acknowledged end to end: all records are out
                await self._finish()
                finished = True
                for t in drains + list(self._steps.values()):  # only meter snapshots
                    t.cancel()  # may be left, and finish had them
        except BaseExceptionGroup as eg:
            raise cause(eg.exceptions[0]) from None
        finally:
            if not finished:  # failed or interrupted: release the replicas, don't wait
                for h in self.hosts:
                    h.handle.finish.remote(self.run_id)

    async def _finish(self) -> None:
        """End the run on every host and keep the replicas' final meter snapshots."""
        for rid in list(self.parked):  # their pieces had every chance to arrive
            self._unpark(rid)
        for ref in [h.handle.finish.remote(self.run_id) for h in self.hosts]:
            try:
                reports = await ref
            except ray_errors():  # died at the very end: its last snapshots must do
                continue
            for rep in reports:
                self._report(rep, final=True)

    def _report(self, rep: MeterReport, final: bool = False) -> None:
        self.latest[(rep.stage, rep.replica)] = rep
        key = (rep.stage, rep.replica, rep.incarnation)
        self.replica_incarnations.setdefault(key[:2], set()).add(rep.incarnation)
        if final:
            self.final.add(key)
        elif key in self.final:  # an older snapshot drained after the final one
            return
        self.reports[key] = rep

    async def _drain(self, host: HostHandle) -> None:
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
                    self._reroute_host(host)  # it forgot how elastic stages scaled
                self.incarnations[id(host)] = d.incarnation
            for e in d.entries:
                if type(e) is MeterReport:
                    self._report(e)
                elif type(e) is Pieces:
                    self._stream(e.pieces)
                elif type(e) is Commit:
                    self._hand_over(self.ledger.commit(e))
                else:
                    self._hand_over(self.ledger.offer(e))
            ack = d.last_seq
            if d.closed:
                return

    # -- autoscaling of elastic stages --------------------------------------------------
    async def _autoscale(self) -> None:
        """Scale each elastic stage between its bounds on load (see ``SCALE_UP_S``,
        ``SCALE_DOWN_S``): one replica at a time, then wait for its effect."""
        loop = asyncio.get_running_loop()
        up: dict[int, float | None] = dict.fromkeys(self.elastic)
        down: dict[int, float | None] = dict.fromkeys(self.elastic)
        while True:
            await asyncio.sleep(SCALE_TICK_S)
            waiting, admitted = await self._admission_backlog()
            now = loop.time()
            for i in self.elastic:
                busy, idle = self._load(i, waiting, admitted)
                t_up = up[i] = (up[i] or now) if busy else None
                t_down = down[i] = (down[i] or now) if idle else None
                step = self._steps.get(i)
                if step is not None and not step.done():  # a replica is being placed
                    continue
                if t_up is not None and now - t_up >= SCALE_UP_S \
                        and sum(self.active[i]) < self.plan.stages[i].max_replicas:
                    up[i] = down[i] = None
                    # in the background: a replica waiting for resources (the Ray
                    # autoscaler adding a node) must not stop the other stages' scaling
                    assert self._tg is not None
                    self._steps[i] = self._tg.create_task(self._scale_out(i))
                elif t_down is not None and now - t_down >= SCALE_DOWN_S \
                        and sum(self.active[i]) > self.plan.stages[i].replicas:
                    up[i] = down[i] = None
                    await self._scale_in(i)

    async def _admission_backlog(self) -> tuple[int, int]:
        """Requests waiting at the admission gate now, and admitted ones (0, 0 without a
        gate)."""
        if self.admission is None:
            return 0, 0
        try:
            st = await asyncio.to_thread(self.admission.statistics)
            return int(st.queued), int(st.in_flight)
        except Exception:  # noqa: BLE001 - a gate without figures (or gone): no signal
            return 0, 0

    def _load(self, i: int, waiting: int, admitted: int) -> tuple[bool, bool]:
        """``(busy, idle)`` of elastic stage ``i`` from its replicas' latest reports
        and the gate's backlog (it counts when more requests are admitted than the stage
        has replicas: with fewer, another replica would have nothing to do)."""
        got = [self.latest.get((i, r)) for r, a in enumerate(self.active[i]) if a]
        reps = [rep for rep in got if rep is not None]
        if len(reps) < len(got):  # a new replica has not reported yet
            return False, False
        busy = all(rep.depth > 0 and not rep.blocked for rep in reps) or (
            waiting > 0 and admitted > len(reps) and i in self.first
            and all(rep.running and not rep.blocked for rep in reps))
        idle = any(rep.depth == 0 and not rep.running for rep in reps)
        return busy, idle

    async def _scale_out(self, i: int) -> None:
        """One more replica for stage ``i``: a retired one takes pushes again, or a new
        one is installed on a host of the pool (created and placed by Ray if needed)."""
        active = self.active[i]
        if False in active:
            active[active.index(False)] = True
        else:
            r = len(active)
            pl = self.placements.get(i, StagePlacement())
            host = await asyncio.to_thread(host_pool().add, i, r, pl, self.assignment)
            holder = [self.spec_refs[i]]
            try:
                done = await host.handle.install.remote(holder, r)
            except Exception:  # noqa: BLE001 - not placed or failed: try again later
                return
            known = any(h is host for h in self.hosts)
            self.assignment[(i, r)] = host
            host.node = done.node
            self.replica_incarnations.setdefault((i, r), set()).add(done.replica)
            self.replica_hosts[i].append(host.handle)
            self.replica_specs[i].append(holder)
            active.append(True)
            if not known:
                self.incarnations[id(host)] = done.incarnation
                self.hosts.append(host)
                assert self._tg is not None
                self._tg.create_task(self._drain(host))
            # its links to elastic consumers must know how they scaled
            await asyncio.gather(*[host.handle.reroute.remote(self.run_id, j, *self._routes(j))
                                   for j in self.elastic if j != i], return_exceptions=True)
        await self._reroute(i)

    async def _scale_in(self, i: int) -> None:
        """One replica fewer for stage ``i``: its idle replica with the highest index
        stops taking new pushes (it finishes what it holds; its actor stays)."""
        active = self.active[i]
        for r in reversed(range(len(active))):
            rep = self.latest.get((i, r))
            if active[r] and rep is not None and rep.depth == 0 and not rep.running:
                active[r] = False
                break
        await self._reroute(i)

    def _routes(self, i: int) -> tuple[tuple, tuple, tuple[bool, ...]]:
        return tuple(self.replica_hosts[i]), tuple(self.replica_specs[i]), tuple(self.active[i])

    async def _reroute(self, i: int) -> None:
        """Tell every producer of stage ``i`` how it is scaled now."""
        routes = self._routes(i)
        self.scale_events.append((time.time(), self.plan.stages[i].id, sum(routes[2])))
        for links in self.source_links.values():
            for link in links:
                if link.route.target == i:
                    link.reroute(*routes)
        producers = {id(h): h for (j, _), h in self.assignment.items()
                     if any(i in c for c in self.consumers[j].values())}
        await asyncio.gather(*[h.handle.reroute.remote(self.run_id, i, *routes)
                               for h in producers.values()], return_exceptions=True)

    def _reroute_host(self, host: HostHandle) -> None:
        """A restarted host: send it how every elastic stage is scaled now."""
        for i in self.elastic:
            host.handle.reroute.remote(self.run_id, i, *self._routes(i))

    # -- sources --------------------------------------------------------------------------
    async def _source(self, i: int) -> None:
        s = self.plan.stages[i]
        op = s.ops[0]
        data: Any = op.params.get("data")
        if data is None:
            data = self.inputs[op.id]
        meter = self.source_meters[i]
        links = self.source_links[i]
        pending: set[asyncio.Task] = set()
        seq = 0

        async def send(records: list) -> None:
            nonlocal seq
            key = (i, seq)
            seq += 1
            acks: list = []
            if self.drop_key is not None:
                records = detach(records, self.drop_key, self.held)
            await self._send(links, key, records, time.time(), acks)
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

    async def _send(self, links: list[Link], key: BatchKey, records: list, born: float,
                    acks: list) -> None:
        """Push one source batch (lineage ids: its positions) to the first stages."""
        lin = range(len(records))
        if len(links) == 1:
            await links[0].send(key, records, lin, born, acks)
            return
        for link in links:  # each consumer gets a copy: a hop of its own
            await link.send(key + (link.route.target,), records, lin, born, acks)

    async def _admitted(self, i: int, data: Any, links: list[Link],
                        meter: StageMeter) -> None:
        """Admission at the source (``ingress.read_admitted``), at most
        ``ADMISSION_WAITS`` (or the first edge's window) records waiting at once. An
        admitted record is sent as a one-record source batch; its ticket is released
        once, when that batch is acknowledged end to end (output, error or drop) or the
        run ends."""
        counter = count()
        gate = self.admission
        # a served request carries its class and deadline to the engines (batch runs'
        # records reach the caller's sinks: they get no transient field)
        urgency = getattr(gate, "urgency", None) if self.drop_key is not None else None
        k = (max(1, min([ADMISSION_WAITS] + [link.window.size for link in links]))
             if self.drop_key is None else 1 << 20)

        async def send(x: Any, ticket: Any, arrived: float) -> Any:
            key = (i, next(counter))
            acks: list = []
            born = time.time() - (perf_counter() - arrived)  # latency counts the wait
            u = urgency(ticket) if urgency is not None else None
            if u is not None:
                x = {**x, "_urgent": u}
            records = [x] if self.drop_key is None else detach([x], self.drop_key, self.held)
            try:
                await self._send(links, key, records, born, acks)
            except BaseException:
                self.ledger.settle(key)
                self._forget(records)
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
            if self.on_drop is not None:
                k = self.drop_key
                gone = [r for r in records
                        if type(r) is dict and r.get(k) not in self.answered]
                if gone:
                    self.on_drop(self.droppers, gone)
        finally:
            self.ledger.settle(key)
            if self.drop_key is not None:
                self._forget(records)
            if ticket is not None:
                self.admission.done(ticket)

    # -- a served run's live fields (see the module doc) ----------------------------------
    def _forget(self, records: list) -> None:
        k = self.drop_key
        for r in records:
            if type(r) is dict:
                rid = r.get(k)
                self.answered.discard(rid)
                self.cancels_sent.discard(rid)
                if rid not in self.parked:  # else its stream lives until it is delivered
                    self.held.pop(rid, None)
                    self.streamed.pop(rid, None)

    def _stream(self, pieces: dict) -> None:
        """Streamed pieces from a host: to each caller's ``_stream``, in order, each
        position once (a record replayed after an actor died streams its first pieces
        again); an output that waited for them goes on once they are all in."""
        for rid, (first, got) in pieces.items():
            live = self.held.get(rid)
            s = live[1] if live is not None else None
            if s is not None:
                had = self.streamed.get(rid, 0)
                for piece in got[max(0, had + 1 - first):]:
                    s(piece)
                n = self.streamed[rid] = max(had, first + len(got) - 1)
                waiting = self.parked.get(rid)
                if waiting is not None and n >= waiting[0]:
                    self._unpark(rid)

    def _park(self, target: int, records: list, expected: dict, born: float,
              sent: float) -> list:
        """The records whose streamed pieces are all in; the others wait for them
        (``_stream``), at most ``PIECES_WAIT_S``."""
        k = self.drop_key
        ready = []
        for r in records:
            rid = r.get(k) if type(r) is dict else None
            n = expected.get(rid, 0)
            if n <= self.streamed.get(rid, 0):
                ready.append(r)
                continue
            self.parked.setdefault(rid, (n, []))[1].append((target, r, born, sent))
            asyncio.get_running_loop().call_later(PIECES_WAIT_S, self._unpark, rid)
        return ready

    def _unpark(self, rid: Any) -> None:
        waiting = self.parked.pop(rid, None)
        if waiting is None:
            return
        for target, r, born, sent in waiting[1]:
            self._sink(target, [r], born, sent)
        if rid not in self.answered:  # settled meanwhile: forget it now
            self.held.pop(rid, None)
            self.streamed.pop(rid, None)

    async def _watch_cancels(self) -> None:
        """Tell every host about callers that gave up (their records' flags get set)."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            sent = self.cancels_sent
            rids = [rid for rid, (c, _) in list(self.held.items())
                    if c is not None and rid not in sent and c.is_set()]
            if rids:
                sent.update(rids)
                for h in self.hosts:
                    h.handle.cancel.remote(self.run_id, rids)

    # -- sinks and errors (in the driver) -------------------------------------------------
    def _hand_over(self, entries: list) -> None:
        """Entries the ledger let through: to the sinks and the error handler."""
        k = self.drop_key
        for e in entries:
            if type(e) is Delivery:
                records = e.records
                if k is not None:
                    expected = reattach(records, k, self.held)
                    self.answered.update(r.get(k) for r in records if type(r) is dict)
                    if expected:
                        records = self._park(e.target, records, expected, e.born, e.sent)
                if records:
                    self._sink(e.target, records, e.born, e.sent)
            elif type(e) is Failures:
                if k is not None:
                    inputs = [err.input for err in e.errors]
                    reattach(inputs, k, self.held)
                    self.answered.update(x.get(k) for x in inputs if type(x) is dict)
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

    def _deliver(self, target: int, key: BatchKey, records: list, lin: Lineage,
                 born: float) -> asyncio.Future:
        """A source feeding a sink directly: no actor in between."""
        self._hand_over(self.ledger.offer(Delivery(target, key, records, lin, born,
                                                   time.time())))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def _errors(self, errors: list) -> None:
        for err in errors:
            self.errors += 1
            self.on_error(err)

    def _unsendable(self, key: BatchKey, records: list, lin: Lineage,
                    exc: BaseException) -> None:
        sid = self.plan.stages[key[0]].ops[0].id
        self._hand_over(self.ledger.offer(Failures(key[0], key, [
            ErrorRecord.from_exception(sid, x, TypeError(
                f"record cannot be sent to a Ray actor: {exc}")) for x in records], lin)))

    # -- statistics -----------------------------------------------------------------------
    def stats(self, wall: float, interrupted: bool) -> RayRunStats:
        """The run's statistics, in the local runtime's format (plus restarts, nodes)."""
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
            incarnations=self.replica_incarnations, scale_events=tuple(self.scale_events))
