"""The run's statistics from every actor, in the local runtime's table and JSON format.

Stage replicas send cumulative meter snapshots (per incarnation: an actor restart starts
a new one) while they run and a final one when the run ends; the driver adds up the
latest snapshot of every incarnation. ``RayStageStats`` and ``RayRunStats`` are the local
types plus what only a cluster has: restarts and the nodes replicas ran on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ...compiler import Plan
from ...observability import Histogram, RunStats, StageMeter, StageStats
from .messages import MeterReport


@dataclass(frozen=True)
class RayStageStats(StageStats):
    """``StageStats`` plus, on Ray, how often the stage's replicas were rebuilt after their
    actor died (``restarts``) and the Ray node ids they ran on (``nodes``, per replica)."""

    restarts: int = 0
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RayRunStats(RunStats):
    """``RunStats`` plus ``actor_restarts`` (host actors that restarted during the run) and
    ``duplicates`` (replayed records the sinks dropped: each record is delivered once)."""

    actor_restarts: int = 0
    duplicates: int = 0


def _extend(base: StageStats, **extra: object) -> RayStageStats:
    return RayStageStats(**{f.name: getattr(base, f.name) for f in fields(StageStats)},
                         **extra)  # type: ignore[arg-type]


def merge_meters(meters: list[StageMeter], template: StageMeter) -> StageMeter:
    """The sum of several replicas' (or incarnations') meters of one operator.

    meters:   the meters to add up.
    template: gives the labels (stage, op, replicas, bound, fusion) of the result.
    """
    return StageMeter.combined(meters, template)


def stage_meter(plan: Plan, i: int, j: int) -> StageMeter:
    """A fresh meter for operator ``j`` of stage ``i``, labelled as the local runtime does.

    plan: the compiled plan.
    i:    the stage's index.
    j:    the operator's index within the stage.
    """
    s = plan.stages[i]
    o = s.ops[j]
    return StageMeter(o.id, o.op.name, replicas=s.replicas,
                      queue_bound=s.queue if j == 0 else 0,
                      fused_into=s.id if len(s.ops) > 1 else None)


def build_stats(plan: Plan, reports: dict[tuple, MeterReport], *,
                source_meters: dict[int, StageMeter], sink_meters: dict[int, StageMeter],
                sink_depth: dict[int, int], totals: tuple[int, int, int], wall: float,
                latency: Histogram, scheduling: Histogram, interrupted: bool,
                actor_restarts: int, duplicates: int,
                incarnations: dict[tuple[int, int], set[str]]) -> RayRunStats:
    """One ``RayRunStats`` from the latest report of every replica incarnation.

    reports:       ``(stage, replica, incarnation) -> MeterReport``.
    source_meters: the driver's meters of source stages, by stage index.
    sink_meters:   the driver's meters of sink operators, by stage index.
    sink_depth:    peak records in flight to each sink stage on one edge (all producers).
    totals:        records in, records out, errors of the whole run.
    incarnations:  ``(stage, replica) -> incarnations seen``: more than one is a restart.
    """
    by_stage: dict[int, list[MeterReport]] = {}
    for rep in reports.values():
        by_stage.setdefault(rep.stage, []).append(rep)
    sched = Histogram()
    sched.merge(scheduling)
    depth = dict(sink_depth)
    for rep in reports.values():
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
            m = merge_meters([r.meters[j] for r in reps], stage_meter(plan, i, j))
            stages.append(_extend(m.statistics(), restarts=restarts, nodes=nodes))
        if s.ops[-1].op.kind == "sink":
            m = sink_meters[i]
            if n_host == 0:
                m.max_queue_depth = depth.get(i, 0)
            stages.append(_extend(m.statistics(), restarts=restarts, nodes=nodes))
    return RayRunStats(tuple(stages), *totals, wall, latency.statistics(), interrupted,
                       sched.statistics(), actor_restarts, duplicates)
