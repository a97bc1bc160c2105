"""Where stage replicas run: placement options, and the pool of ``StageHost`` actors.

Stages without placement options share general-purpose hosts (no reserved resources;
up to one per cluster CPU, more only when a stage has more replicas); a stage that
reserves resources gets a host of its own per replica; ``strategy: spread`` pins replica
*i* to the *i*-th alive node (docs/ray.md, "Placement"). Hosts are kept per Ray session
and reused by later runs of this process. ``where: driver`` runs a stage in the driver's
process (``driver_stages``): a served run puts qualifying stages there by default, since
a request pays every actor hop in its latency, while a batch run keeps them on hosts so
that the driver's one core feeds them instead of doing their work.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...compiler import Plan, PlanStage
from ...compiler.validate import placement_problem
from ...errors import PlanError
from .host import MAX_CONCURRENCY, actor_class


@dataclass(frozen=True)
class StagePlacement:
    """Resources one replica of a stage reserves, and how replicas spread over nodes."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    memory: int = 0
    resources: tuple[tuple[str, float], ...] = ()
    strategy: str = "pack"
    where: str = ""  # "driver", "host" or "" (the run decides: ``driver_stages``)

    @property
    def dedicated(self) -> bool:
        """Reserves something: each replica gets a host of its own."""
        return bool(self.num_cpus or self.num_gpus or self.memory or self.resources)


def parse_placement(plan: Plan, placement: dict | None) -> dict[int, StagePlacement]:
    """Stage index -> placement: each stage's ``placement`` contract, overridden by
    ``{stage or operator id: {option: value}}`` given to the run.

    plan:      the compiled plan (ids of fused operators name their stage).
    placement: the run's options; ``"*"`` sets the default for every stage.
    """
    placement = {} if placement is None else placement
    if not isinstance(placement, dict):
        raise PlanError(f"placement must be a mapping of stage id to options, got "
                        f"{type(placement).__name__}")
    ids = [o.id for s in plan.stages for o in s.ops]
    for sid, opts in placement.items():
        if sid != "*" and sid not in ids:
            raise PlanError(f"placement names unknown stage '{sid}'; stages: {', '.join(ids)}")
        problem = placement_problem(opts)
        if problem:
            raise PlanError(problem, stage=None if sid == "*" else sid)
    out: dict[int, StagePlacement] = {}
    for i, s in enumerate(plan.stages):
        if s.ops[0].op.kind == "source" or all(o.op.kind == "sink" for o in s.ops):
            continue
        opts = dict(placement.get("*") or {})
        for o in s.ops:
            opts.update(o.contract.placement or {})
            opts.update(placement.get(o.id) or {})
        if opts:
            out[i] = StagePlacement(
                num_cpus=float(opts.get("num_cpus", 0)), num_gpus=float(opts.get("num_gpus", 0)),
                memory=int(opts.get("memory", 0)),
                resources=tuple(sorted((str(k), float(v))
                                       for k, v in (opts.get("resources") or {}).items())),
                strategy=opts.get("strategy", "pack"), where=opts.get("where", ""))
    driver_stages(plan, out, served=False)  # a stage that cannot run there fails now
    return out


def driver_stages(plan: Plan, placements: dict[int, StagePlacement], served: bool) -> set[int]:
    """Indexes of the stages that run in the driver's process (see the module doc).

    plan:       the compiled plan (stages in topological order).
    placements: stage index -> placement (``parse_placement``).
    served:     a served run: qualifying stages without ``where`` run there too.
    Raises ``PlanError`` for a stage that says ``where: driver`` and cannot.
    """
    index = {s.id: i for i, s in enumerate(plan.stages)}
    out: set[int] = set()
    for i, s in enumerate(plan.stages):
        if s.ops[0].op.kind == "source" or all(o.op.kind == "sink" for o in s.ops):
            continue
        pl = placements.get(i)
        where = pl.where if pl is not None else ""
        if where == "host" or (where == "" and not served):
            continue
        producers = [index[u.partition(".")[0]] for u in s.upstream]
        fed_here = all(p in out or plan.stages[p].ops[0].op.kind == "source"
                       for p in producers)
        why = _not_in_driver(s, pl, fed_here)
        if why is None:
            out.add(i)
        elif where == "driver":
            raise PlanError(f"placement where: driver: {why}; the driver runs single-replica "
                            "stages of inline code fed by a source or by another such stage",
                            stage="+".join(o.id for o in s.ops if o.op.kind != "sink"))
    return out


def _not_in_driver(s: PlanStage, pl: StagePlacement | None, fed_here: bool) -> str | None:
    """Why stage ``s`` cannot run in the driver (None: it can); ``fed_here``: every
    producer of it is a source or a stage in the driver."""
    if s.replicas != 1 or s.elastic:
        return "it has several replicas"
    if s.mode != "inline":
        return f"it runs {s.mode} code (only inline code runs on the driver's loop)"
    if pl is not None and pl.dedicated:
        return "it reserves resources"
    if not fed_here:
        return "a stage before it runs in an actor"
    return None


@dataclass
class HostHandle:
    """The driver's handle on one ``StageHost`` actor the pool keeps."""

    handle: Any
    name: str
    key: tuple
    node: str | None = None


@dataclass
class HostPool:
    """The hosts of this process on the current Ray session, by placement key."""

    session: str
    hosts: dict[tuple, list[HostHandle]] = field(default_factory=dict)
    created: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def assign(self, plan: Plan, stages: list[int],
               placements: dict[int, StagePlacement]) -> dict[tuple[int, int], HostHandle]:
        """(stage index, replica) -> host for one run; creates the hosts it lacks."""
        with self.lock:  # runs may start from several threads at once
            nodes, cap = _cluster()
            load: dict[int, int] = {}  # id(host) -> replicas assigned in this run
            out: dict[tuple[int, int], HostHandle] = {}
            for i in stages:
                pl = placements.get(i, StagePlacement())
                taken: set[int] = set()
                for r in range(plan.stages[i].replicas):
                    out[(i, r)] = self._place(r, pl, nodes, cap, load, taken)
            return out

    def add(self, stage: int, replica: int, pl: StagePlacement,
            assignment: dict[tuple[int, int], HostHandle]) -> HostHandle:
        """A host for a new replica of an elastic stage (a run's ``assignment`` so far):
        the least-loaded host of its kind that runs no replica of the stage yet, or a
        new one (Ray places it; one that needs resources no node has waits for the
        autoscaler to add a node)."""
        with self.lock:
            nodes, cap = _cluster()
            load: dict[int, int] = {}
            for h in assignment.values():
                load[id(h)] = load.get(id(h), 0) + 1
            taken = {id(h) for (i, _), h in assignment.items() if i == stage}
            return self._place(replica, pl, nodes, cap, load, taken)

    def _place(self, r: int, pl: StagePlacement, nodes: list[str], cap: int,
               load: dict[int, int], taken: set[int]) -> HostHandle:
        """The host for replica ``r`` of a stage (``taken``: hosts of its other
        replicas), counted in ``load`` and ``taken``; creates it when needed."""
        node = nodes[r % len(nodes)] if pl.strategy == "spread" and nodes else None
        key = (pl.num_cpus, pl.num_gpus, pl.memory, pl.resources, node)
        pool = self.hosts.setdefault(key, [])
        free = [h for h in pool if id(h) not in taken
                and not (pl.dedicated and load.get(id(h)))]
        limit = cap if node is None else 1
        if not free or (not pl.dedicated and len(pool) < limit
                        and min(load.get(id(h), 0) for h in free) > 0):
            host = self._create(key, pl, node)
            pool.append(host)
        else:
            host = min(free, key=lambda h: load.get(id(h), 0))
        taken.add(id(host))
        load[id(host)] = load.get(id(host), 0) + 1
        return host

    def _create(self, key: tuple, pl: StagePlacement, node: str | None) -> HostHandle:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.created += 1
        name = f"tailrace-host-{os.getpid()}-{uuid.uuid4().hex[:6]}-{self.created}"
        options: dict[str, Any] = {
            "name": name, "num_cpus": pl.num_cpus, "max_restarts": -1,
            "max_concurrency": MAX_CONCURRENCY}
        reserved = {"num_gpus": pl.num_gpus, "memory": pl.memory, "resources": dict(pl.resources)}
        options.update({k: v for k, v in reserved.items() if v})
        if node is not None:
            # hard affinity: soft affinity spilled replicas to busy nodes here (measured)
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        return HostHandle(actor_class().options(**options).remote(), name, key)


def _cluster() -> tuple[list[str], int]:
    """The alive nodes' ids (sorted) and the cluster's CPU count (at least 1)."""
    import ray

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    return nodes, max(1, int(ray.cluster_resources().get("CPU", 1)))


_POOL: HostPool | None = None


def host_pool() -> HostPool:
    """This process's pool for the connected Ray session (a new session: a new pool)."""
    global _POOL
    import ray

    session = ray.get_runtime_context().get_node_id() + ray.get_runtime_context().get_job_id()
    if _POOL is None or _POOL.session != session:
        _POOL = HostPool(session)
    return _POOL
