"""A run's statistics, built one way for both runtimes.

Every stage replica meters its operators (``StageWorker.meters``); a run's statistics
add up, per operator, the meters of its replicas. Locally they are read in place (a
live snapshot for a served pipeline: ``live_stats``); on Ray, stage replicas send
cumulative meter snapshots (per incarnation: an actor restart starts a new one) while
they run and a final one when the run ends, and the driver adds up the latest snapshot
of every incarnation. ``RayStageStats`` and ``RayRunStats`` are the local types plus
what only a cluster has: restarts and the nodes replicas ran on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from time import perf_counter
from typing import Any

from ..compiler import Plan
from ..observability import Histogram, RunStats, StageMeter, StageStats
from .stage import stage_meter


@dataclass(frozen=True)
class RayStageStats(StageStats):
    """``StageStats`` plus, on Ray, how often the stage's replicas were rebuilt after their
    actor died (``restarts``) and the Ray node ids they ran on (``nodes``, per replica)."""

    restarts: int = 0
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RayRunStats(RunStats):
    """``RunStats`` plus ``actor_restarts`` (host actors that restarted during the run),
    ``duplicates`` (replayed records the sinks dropped: each record is delivered once) and
    ``scale_events``: ``(unix time, stage id, active replicas after)`` each time an
    elastic stage scaled out or in, in order."""

    actor_restarts: int = 0
    duplicates: int = 0
    scale_events: tuple[tuple[float, str, int], ...] = ()


def _extend(base: StageStats, **extra: object) -> RayStageStats:
    return RayStageStats(**{f.name: getattr(base, f.name) for f in fields(StageStats)},
                         **extra)  # type: ignore[arg-type]


def sum_counters(counted: list[dict[str, float]]) -> dict[str, float]:
    """Operator counters of several replicas, added up by name."""
    total: dict[str, float] = {}
    for c in counted:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def local_stats(run: Any, wall: float, interrupted: bool) -> RunStats:
    """The statistics of a local run (``LocalRun``), read in place."""
    stages: list[StageStats] = []
    for s in run.plan.stages:
        if s.id in run.source_meters:
            stages.append(run.source_meters[s.id].statistics())
            continue
        workers = run.workers[s.id]
        workers[0].meters[0].max_queue_depth = run.channels[s.id].max_depth
        for i in range(len(s.ops)):
            st = StageMeter.combined([w.meters[i] for w in workers]).statistics()
            counted = [w.rts[i].counters() for w in workers if w.rts[i].counters is not None]
            if counted:
                st = replace(st, counters=sum_counters(counted))
            stages.append(st)
    return RunStats(tuple(stages), run.records_in, run.records_out, run.errors, wall,
                    run.latency.statistics(), interrupted, run.scheduling.statistics())


def live_stats(run: Any, started: float) -> RunStats:
    """A live snapshot of a local run that is still going (a served pipeline): counters
    are read without stopping the stages, and a source's records count in as they
    arrive (the runtime counts them when the source ends, which a service's never does).

    started: the run's start (``perf_counter()``).
    """
    if run is None:
        return RunStats((), 0, 0, 0, 0.0)
    stats = local_stats(run, perf_counter() - started, False)
    arrived = {sid: m.records_out for sid, m in run.source_meters.items()}
    stages = tuple(replace(s, records_in=arrived[s.stage]) if s.stage in arrived else s
                   for s in stats.stages)
    return replace(stats, stages=stages, records_in=sum(arrived.values()))


def build_stats(plan: Plan, reports: dict[tuple, Any], *,
                source_meters: dict[int, StageMeter], sink_meters: dict[int, StageMeter],
                sink_depth: dict[int, int], totals: tuple[int, int, int], wall: float,
                latency: Histogram, scheduling: Histogram, interrupted: bool,
                actor_restarts: int, duplicates: int,
                incarnations: dict[tuple[int, int], set[str]],
                scale_events: tuple[tuple[float, str, int], ...] = ()) -> RayRunStats:
    """One ``RayRunStats`` from the latest report of every replica incarnation.

    reports:       ``(stage, replica, incarnation) -> MeterReport`` (Ray's messages).
    source_meters: the driver's meters of source stages, by stage index.
    sink_meters:   the driver's meters of sink operators, by stage index.
    sink_depth:    peak records in flight to each sink stage on one edge (all producers).
    totals:        records in, records out, errors of the whole run.
    incarnations:  ``(stage, replica) -> incarnations seen``: more than one is a restart.
    """
    by_stage: dict[int, list[Any]] = {}
    sched = Histogram()
    sched.merge(scheduling)
    depth = dict(sink_depth)
    for rep in reports.values():
        by_stage.setdefault(rep.stage, []).append(rep)
        sched.merge(rep.scheduling)
        for target, d in rep.sink_depth.items():
            depth[target] = max(depth.get(target, 0), d)
    stages: list[StageStats] = []
    for i, s in enumerate(plan.stages):
        if i in source_meters:
            stages.append(source_meters[i].statistics())
            continue
        reps = by_stage.get(i, [])
        restarts = sum(len(incs) - 1 for (si, _), incs in incarnations.items() if si == i)
        latest = {r.replica: r.node for r in reps}  # reports arrive in incarnation order
        nodes = tuple(latest[r] for r in sorted(latest))
        n_host = sum(1 for o in s.ops if o.op.kind != "sink")
        for j in range(n_host):
            st = StageMeter.combined([r.meters[j] for r in reps],
                                     stage_meter(s, j)).statistics()
            counted = [r.counters[j] for r in reps if len(r.counters) > j and r.counters[j]]
            if counted:  # every incarnation's own counts, added up
                st = replace(st, counters=sum_counters(counted))
            if s.elastic:  # the replicas it had: it may have scaled out during the run
                st = replace(st, replicas=max(st.replicas, len(nodes)))
            stages.append(_extend(st, restarts=restarts, nodes=nodes))
        if s.ops[-1].op.kind == "sink":
            m = sink_meters[i]
            if n_host == 0:
                m.max_queue_depth = depth.get(i, 0)
            stages.append(_extend(m.statistics(), restarts=restarts, nodes=nodes))
    return RayRunStats(tuple(stages), *totals, wall, latency.statistics(), interrupted,
                       sched.statistics(), actor_restarts, duplicates, scale_events)
