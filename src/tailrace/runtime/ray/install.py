"""Installing a Ray run: ship its stages, place them on the pool's hosts, build replicas.

``preflight`` pickles every operator that will run in an actor before any actor starts
(a failure is a ``PlanError`` naming the stage); ``install`` places the stages on hosts
(``placement.py``), sends each replica its ``InstallSpec`` (routes to its consumers,
the driver's ``TAILRACE_*`` environment and import path) and waits for every replica
to be built, retrying a pooled host that is still restarting; the sources get their
links to the first stages.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ...compiler import Plan, PlanOp, PlanStage
from ...errors import PlanError
from .credits import Link, cause, ray_errors
from .host import open_shared_engine
from .instance import HostedWorker
from .messages import InstallSpec, Route
from .placement import host_pool

if TYPE_CHECKING:
    from .driver import RayRun

#: Seconds an install waits for a stage host that is restarting (a pooled host killed
#: by an earlier run) before the run fails.
INSTALL_WAIT_S = 30.0


def shipped(stage: PlanStage) -> PlanStage:
    """The stage as sent to a host: sink targets (the caller's lists/writers) removed."""
    def strip(o: PlanOp) -> PlanOp:
        if o.op.kind != "sink":
            return o
        return replace(o, params={**o.params, "target": None},
                       spec=replace(o.spec, params={**o.spec.params, "target": None}))

    return replace(stage, ops=tuple(strip(o) for o in stage.ops))


def preflight(plan: Plan, host_stages: list[int]) -> dict[int, PlanStage]:
    """Serialise every operator of the stages ``host_stages`` (those that run in
    actors); a failure is a ``PlanError`` naming the stage, raised before any actor
    starts. Returns the stages to ship."""
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


def route(run: RayRun, consumer: int, assignment: dict, holders: dict,
          sink: bool = False) -> Route:
    """The edge into stage ``consumer``: its sink the driver runs (``sink``, or a stage
    that is only a sink), its replica in the driver, or its replicas on hosts."""
    s = run.plan.stages[consumer]
    assert s.execution is not None, "a source has no pushes into it"
    edge = (s.queue, s.execution.push, s.id)  # window, records per push, label
    if sink or (consumer not in run.local and consumer not in run.host_stages):
        return Route(consumer, True, (), (), *edge)
    if consumer in run.local:
        return Route(consumer, False, (None,), ([],), *edge, run.local[consumer])
    hosts = tuple(assignment[(consumer, r)].handle for r in range(s.replicas))
    return Route(consumer, False, hosts, holders[consumer], *edge)


def routes(run: RayRun, i: int, assignment: dict,
           holders: dict) -> dict[str | None, tuple[Route, ...]]:
    """Stage ``i``'s output edges by port (its own sink, if fused, under None)."""
    out: dict[str | None, tuple[Route, ...]] = {}
    if run.plan.stages[i].ops[-1].op.kind == "sink":
        out[None] = (route(run, i, assignment, holders, sink=True),)
    for port, stage_ids in run.consumers[i].items():
        out[port] = tuple(route(run, c, assignment, holders) for c in stage_ids)
    return out


async def install(run: RayRun) -> None:
    """Place the run's stages on the pool's hosts and install every replica (its
    engines open there); sources get their links to the first stages."""
    import ray

    assignment = host_pool().assign(run.plan, run.host_stages, run.placements)
    run.assignment = assignment
    env = {k: v for k, v in os.environ.items() if k.startswith("TAILRACE_")}
    path = tuple(p for p in sys.path if p and os.path.isdir(p))
    holders: dict[int, tuple[list, ...]] = {}
    for i in reversed(run.host_stages):  # consumers first: routes name their specs
        spec = InstallSpec(run.run_id, i, run.stages[i], routes(run, i, assignment, holders),
                           i in run.first, env, path, run.served is not None)
        ref = ray.put(spec)
        holders[i] = tuple([ref] for _ in range(run.plan.stages[i].replicas))
        run.spec_refs[i] = ref
    run.elastic.installed(assignment, holders)
    node = ray.get_runtime_context().get_node_id()
    for i in sorted(run.in_driver, reverse=True):  # the driver's stages, consumers first
        spec = InstallSpec(run.run_id, i, run.plan.stages[i],
                           routes(run, i, assignment, holders), i in run.first)
        run.local[i] = HostedWorker(spec, 0, run.box, node, open_shared_engine)
    for i in run.source_meters:
        run.source_links[i] = [
            Link(route(run, c, assignment, holders), run.run_id, run.box.deliver,
                 run.unsendable) for c in run.consumers[i].get(None, [])]
    run.hosts = list({id(h): h for h in assignment.values()}.values())
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
        run.incarnations[id(h)] = done.incarnation
        run.replica_incarnations.setdefault((i, r), set()).add(done.replica)
