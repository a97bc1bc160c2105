"""Autoscaling of a Ray run's elastic stages (``replicas: {min, max}``).

One ``Elastic`` per run keeps what scaling needs: each elastic stage's replicas (their
hosts, install specs and whether each takes new pushes), the latest meter report of
each replica and the scale events so far. ``scale`` looks every ``SCALE_TICK_S`` and
adds or retires one replica at a time; producers learn the new shape by ``reroute``.
It reads the run (plan, hosts, links, gate) and never owns its records.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from .messages import MeterReport
from .placement import HostHandle, StagePlacement, host_pool

if TYPE_CHECKING:
    from .driver import RayRun

#: Seconds between autoscaling looks at an elastic stage (``replicas: {min, max}``).
SCALE_TICK_S = 0.25
#: An elastic stage gains a replica once, for this long, every replica that takes new
#: pushes has input queued (and is not itself waiting for its consumers' credits), or
#: it is a first stage, all its replicas are busy and requests wait at admission.
SCALE_UP_S = 1.0
#: It loses one (the replica stops taking new pushes) once one of them has been idle
#: (empty queue, nothing running) for this long.
SCALE_DOWN_S = 10.0


class Elastic:
    """The elastic stages of ``run`` and their scaling (see the module docstring)."""

    def __init__(self, run: RayRun) -> None:
        self.run = run
        self.stages = [i for i in run.host_stages if run.plan.stages[i].elastic]
        self.replica_hosts: dict[int, list] = {}
        self.replica_specs: dict[int, list] = {}
        self.active: dict[int, list[bool]] = {}  # stage -> which replicas take pushes
        self.latest: dict[tuple[int, int], MeterReport] = {}  # every replica's last
        self.events: list[tuple[float, str, int]] = []  # (time, stage id, replicas)
        self.steps: dict[int, asyncio.Task] = {}  # elastic stage -> its scale-out

    def installed(self, assignment: dict, holders: dict[int, Any]) -> None:
        """The run's replicas are placed: remember the elastic stages' ones."""
        plan = self.run.plan
        for i in self.stages:
            n = plan.stages[i].replicas
            self.replica_hosts[i] = [assignment[(i, r)].handle for r in range(n)]
            self.replica_specs[i] = list(holders[i])
            self.active[i] = [True] * n

    async def scale(self) -> None:
        """Scale each elastic stage between its bounds on load (see ``SCALE_UP_S``,
        ``SCALE_DOWN_S``): one replica at a time, then wait for its effect."""
        run = self.run
        loop = asyncio.get_running_loop()
        up: dict[int, float | None] = dict.fromkeys(self.stages)
        down: dict[int, float | None] = dict.fromkeys(self.stages)
        while True:
            await asyncio.sleep(SCALE_TICK_S)
            waiting, admitted = await self.backlog()
            now = loop.time()
            for i in self.stages:
                busy, idle = self.load(i, waiting, admitted)
                t_up = up[i] = (up[i] or now) if busy else None
                t_down = down[i] = (down[i] or now) if idle else None
                step = self.steps.get(i)
                if step is not None and not step.done():  # a replica is being placed
                    continue
                if t_up is not None and now - t_up >= SCALE_UP_S \
                        and sum(self.active[i]) < run.plan.stages[i].max_replicas:
                    up[i] = down[i] = None
                    # in the background: a replica waiting for resources (the Ray
                    # autoscaler adding a node) must not stop the other stages' scaling
                    assert run.tg is not None
                    self.steps[i] = run.tg.create_task(self.scale_out(i))
                elif t_down is not None and now - t_down >= SCALE_DOWN_S \
                        and sum(self.active[i]) > run.plan.stages[i].replicas:
                    up[i] = down[i] = None
                    await self.scale_in(i)

    async def backlog(self) -> tuple[int, int]:
        """Requests waiting at the admission gate now, and admitted ones (0, 0 without a
        gate)."""
        run = self.run
        if run.admission is None:
            return 0, 0
        try:
            st = await asyncio.to_thread(run.admission.statistics)
            return int(st.queued), int(st.in_flight)
        except Exception:  # noqa: BLE001 - a gate without figures (or gone): no signal
            return 0, 0

    def load(self, i: int, waiting: int, admitted: int) -> tuple[bool, bool]:
        """``(busy, idle)`` of elastic stage ``i`` from its replicas' latest reports
        and the gate's backlog (it counts when more requests are admitted than the stage
        has replicas: with fewer, another replica would have nothing to do)."""
        run = self.run
        got = [self.latest.get((i, r)) for r, a in enumerate(self.active[i]) if a]
        reps = [rep for rep in got if rep is not None]
        if len(reps) < len(got):  # a new replica has not reported yet
            return False, False
        busy = all(rep.depth > 0 and not rep.blocked for rep in reps) or (
            waiting > 0 and admitted > len(reps) and i in run.first
            and all(rep.running and not rep.blocked for rep in reps))
        idle = any(rep.depth == 0 and not rep.running for rep in reps)
        return busy, idle

    async def scale_out(self, i: int) -> None:
        """One more replica for stage ``i``: a retired one takes pushes again, or a new
        one is installed on a host of the pool (created and placed by Ray if needed)."""
        run = self.run
        active = self.active[i]
        if False in active:
            active[active.index(False)] = True
        else:
            r = len(active)
            pl = run.placements.get(i, StagePlacement())
            host = await asyncio.to_thread(host_pool().add, i, r, pl, run.assignment)
            holder = [run.spec_refs[i]]
            try:
                done = await host.handle.install.remote(holder, r)
            except Exception:  # noqa: BLE001 - not placed or failed: try again later
                return
            known = any(h is host for h in run.hosts)
            run.assignment[(i, r)] = host
            host.node = done.node
            run.replica_incarnations.setdefault((i, r), set()).add(done.replica)
            self.replica_hosts[i].append(host.handle)
            self.replica_specs[i].append(holder)
            active.append(True)
            if not known:
                run.incarnations[id(host)] = done.incarnation
                run.hosts.append(host)
                assert run.tg is not None
                run.tg.create_task(run.drain(host))
            # its links to elastic consumers must know how they scaled
            await asyncio.gather(*[host.handle.reroute.remote(run.run_id, j, *self.routes(j))
                                   for j in self.stages if j != i], return_exceptions=True)
        await self.reroute(i)

    async def scale_in(self, i: int) -> None:
        """One replica fewer for stage ``i``: its idle replica with the highest index
        stops taking new pushes (it finishes what it holds; its actor stays)."""
        active = self.active[i]
        for r in reversed(range(len(active))):
            rep = self.latest.get((i, r))
            if active[r] and rep is not None and rep.depth == 0 and not rep.running:
                active[r] = False
                break
        await self.reroute(i)

    def routes(self, i: int) -> tuple[tuple, tuple, tuple[bool, ...]]:
        return tuple(self.replica_hosts[i]), tuple(self.replica_specs[i]), tuple(self.active[i])

    async def reroute(self, i: int) -> None:
        """Tell every producer of stage ``i`` how it is scaled now."""
        run = self.run
        routes = self.routes(i)
        self.events.append((time.time(), run.plan.stages[i].id, sum(routes[2])))
        for links in run.source_links.values():
            for link in links:
                if link.route.target == i:
                    link.reroute(*routes)
        for inst in run.local.values():  # the driver's stages
            inst.reroute(i, *routes)
        producers = {id(h): h for (j, _), h in run.assignment.items()
                     if any(i in c for c in run.consumers[j].values())}
        await asyncio.gather(*[h.handle.reroute.remote(run.run_id, i, *routes)
                               for h in producers.values()], return_exceptions=True)

    def reroute_host(self, host: HostHandle) -> None:
        """A restarted host: send it how every elastic stage is scaled now."""
        run = self.run
        for i in self.stages:
            host.handle.reroute.remote(run.run_id, i, *self.routes(i))
