"""The discrete-event simulation of compiled plans on a virtual clock.

What is real and what is modelled (docs/simulate.md, "What is simulated"):

- real: the compiled plans (``compile_pipeline``: stages, fusion, bounds, execution), the
  admission policy (``make_policy`` with the virtual clock), the engine pools
  (``EnginePool``: its batcher, dispatch policy, retries and restarts, driven turn by
  turn), the llama.cpp scheduler and prefix cache (``engines.ContinuousReplica``);
- modelled: how long a stage's operator and an engine's step or call take (the
  profile), network hops (a fixed latency with jitter), replica start-up time.

A record is admitted at the door, crosses the plan's stages through bounded queues (a
full queue holds its producer: backpressure), calls its engines through the pools and
ends at a sink: every record ends exactly once, as an output, an error (its engine call
failed) or a rejection, and every admission ticket is released once.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..compiler.plan import Plan, PlanStage
from ..control import Request, make_policy
from ..engines.base import GenerationRequest
from ..engines.call import Call
from ..engines.opener import split_pool
from ..engines.pool import EnginePool
from ..observability.stats import StageMeter
from ..serving.binding import admission_setup
from .engines import (
    CallReplica,
    ContinuousReplica,
    Replica,
    SequenceReplica,
    Shape,
    Shapes,
)
from .events import Loop
from .profile import EngineProfile, Profile, ProfileError, StageProfile
from .workload import Arrival

MAINTAIN_S = 0.25  # the pool loop's upkeep period (``pool._TICK_S``)
POLL_S = 0.005  # the admission gate's poll period while requests wait (``AdmissionGate``)


@dataclass
class Config:
    """How the simulated deployment looks.

    nodes:        machines; every node runs each stage's replicas and each engine's
                  ``replicas`` (per node).
    replicas:     engine name -> replicas per node (default: the spec's ``replicas``, 1).
    admission:    the admission policy, with ``max_in_flight`` (fcfs, slo; default 8 as
                  ``tailrace run``) and any other options in ``admission_options``.
    dispatch:     the pools' dispatch policy (default: the spec's, ``least_work``).
    hop_ms:       one network hop (a stage to another node's stage, a call to an engine
                  and back): ``hop_ms`` x (1 + U(-jitter, jitter)); default 0 on one
                  node, 1.0 on several.
    runtime:      ``local`` (the default: every node runs the whole plan, its engines'
                  replicas are one pool per engine across the nodes) or ``ray``
                  (``--runtime ray``'s topology: each stage's ``replicas`` placed once on
                  the cluster, each engine one shared actor holding its spec's
                  ``replicas``; every stage's input crosses an actor, one hop, and
                  every engine call two; ``hop_ms`` defaults to 1.0).
    kills:        (time, engine, replica id): that replica's process dies at that time.
    slow:         (time, node, factor): from that time, that node's engines run
                  ``factor`` times slower.
    """

    nodes: int = 1
    replicas: dict[str, int] = field(default_factory=dict)
    admission: str = "simultaneous"
    max_in_flight: int = 8
    admission_options: dict[str, Any] = field(default_factory=dict)
    dispatch: str | None = None
    hop_ms: float | None = None
    jitter: float = 0.2
    runtime: str = "local"
    kills: list[tuple[float, str, int]] = field(default_factory=list)
    slow: list[tuple[float, int, float]] = field(default_factory=list)
    seed: int = 0


class SimRecord:
    """One request in flight through a plan."""

    __slots__ = ("id", "pipe", "arrival", "prompt_tokens", "output_tokens", "ticket",
                 "copies", "failed", "urgency", "ended")

    def __init__(self, rid: int, pipe: SimPipeline, a: Arrival, prompt: int, output: int):
        self.id, self.pipe, self.arrival = rid, pipe, a.t
        self.prompt_tokens, self.output_tokens = prompt, output
        self.ticket: Any = None
        self.copies = 1  # copies still in the plan (a fan-out makes more)
        self.failed = False
        self.urgency: tuple[int, float] = (0, math.inf)
        self.ended = False


class SimCall(Call):
    """An engine call whose end the simulator hears of (``Call.wait`` never blocks)."""

    __slots__ = ("on_end",)

    def __init__(self, n: int, on_end: Callable[[SimCall], None]):
        super().__init__(n)
        self.on_end = on_end

    def complete(self, index: int, output: Any) -> None:
        was = self.done.is_set()
        super().complete(index, output)
        if not was and self.done.is_set():
            self.on_end(self)

    def fail(self, exc: BaseException) -> bool:
        if super().fail(exc):
            self.on_end(self)
            return True
        return False


class PoolDriver:
    """Turns a real ``EnginePool`` on the virtual clock: a turn whenever something was
    sent to it (coalesced per instant), at the batcher's deadline, and upkeep every
    ``MAINTAIN_S`` while the simulation runs."""

    def __init__(self, sim: Simulation, name: str, spec: dict[str, Any], profile: EngineProfile,
                 replicas: int, options: dict[str, Any]):
        self.sim, self.name, self.profile = sim, name, profile
        self.replicas: list[Replica] = []
        self._due = math.inf  # the earliest turn already scheduled
        cls = {"continuous": ContinuousReplica, "sequences": SequenceReplica}.get(
            profile.kind, CallReplica)

        def transport(spec: dict, kind: str, deliver: Any, label: str, endpoint: Any,
                      max_in_flight: int) -> Replica:
            rid = int(label.rsplit("-", 1)[1])  # pool labels end with the replica id

            def tell(msg: Any) -> None:
                deliver(msg)
                self.poke()

            rep = cls(sim.loop, profile, tell, rid % sim.config.nodes, sim.slow, kind,
                      sim.rng, shapes=sim.shapes)
            while len(self.replicas) <= rid:
                self.replicas.append(rep)
            self.replicas[rid] = rep
            return rep

        self.pool = EnginePool(name, spec, replicas=replicas, clock=sim.loop.now,
                               transport=transport, isolation="thread", **options)
        self.pool.start_driven()

    def poke(self) -> None:
        now = self.sim.loop.now()
        if self._due > now:
            self._due = now
            self.sim.loop.at(now, self._turn)

    def _turn(self) -> None:
        self._due = math.inf
        nxt = self.pool.turn(maintain=False)
        if nxt is not None and nxt < self._due:
            self._due = nxt
            self.sim.loop.at(nxt, self._turn)

    def maintain(self) -> None:
        self.pool.turn(maintain=True)


class SimStage:
    """One plan stage: its workers (replicas x calls in flight x nodes), its bounded
    input queue and how it calls its operator."""

    def __init__(self, sim: Simulation, pipe: SimPipeline, stage: PlanStage,
                 prof: StageProfile, pool: PoolDriver | None):
        self.sim, self.pipe, self.stage, self.prof, self.pool = sim, pipe, stage, prof, pool
        ex = stage.execution
        assert ex is not None
        nodes = sim.config.nodes if sim.config.runtime == "local" else 1  # Ray places them
        self.workers = stage.replicas * max(ex.in_flight, 1) * nodes
        self.bound = stage.queue * stage.replicas * nodes
        self.max_batch = ex.max_batch if ex.call != "per_record" else 1
        self.max_wait = ex.max_wait_ms / 1000.0 if ex.call == "collect" else 0.0
        self.queue: deque[tuple[float, SimRecord]] = deque()
        self.busy = 0
        self.blocked: deque[Callable[[], None]] = deque()  # producers waiting for room
        self.consumers: list[SimStage] = []
        self.meter = StageMeter(stage.id, stage.ops[0].op.name, replicas=stage.replicas,
                                queue_bound=self.bound)
        self._timer = False
        op = next((o for o in stage.ops if o.params.get("engine")), None)
        self.kind = pool.pool.kind if pool is not None else None
        self.max_tokens = int(op.params.get("max_tokens") or 0) if op is not None else 0
        self.shared = prof.shared_tokens

    # -- input ----------------------------------------------------------------------
    def offer(self, rec: SimRecord) -> bool:
        """Queue ``rec``; False (nothing queued) when the queue is full."""
        if len(self.queue) >= self.bound:
            return False
        self.queue.append((self.sim.loop.now(), rec))
        m = self.meter
        m.records_in += 1
        if len(self.queue) > m.max_queue_depth:
            m.max_queue_depth = len(self.queue)
        self.try_start()
        return True

    def try_start(self) -> None:
        loop = self.sim.loop
        while self.busy < self.workers and self.queue:
            now = loop.now()
            n = min(len(self.queue), self.max_batch)
            if self.max_wait and n < self.max_batch and now < self.queue[0][0] + self.max_wait:
                if not self._timer:
                    self._timer = True
                    loop.at(self.queue[0][0] + self.max_wait, self._waited)
                return
            batch = [self.queue.popleft() for _ in range(n)]
            self.busy += 1
            for t, _ in batch:
                self.meter.queue_wait.record((now - t) * 1e6)
            self.meter.batch_size.record(n)
            self._room()
            self._run([r for _, r in batch], now)

    def _waited(self) -> None:
        self._timer = False
        self.try_start()

    def _room(self) -> None:
        """Records left the queue: wake producers waiting for room, oldest first."""
        while self.blocked and len(self.queue) < self.bound:
            self.blocked.popleft()()

    # -- a call -------------------------------------------------------------------------
    def _run(self, recs: list[SimRecord], start: float) -> None:
        tokens = sum(r.prompt_tokens for r in recs)
        own = self.prof.service.draw(self.sim.rng, records=len(recs), tokens=tokens)
        if self.sim.stage_hops:  # its input came from another actor (held as a send is)
            own += self.sim.hop()
        if self.pool is None:
            self.sim.loop.after(own, self._done, recs, start, False)
            return
        hop = self.sim.hop()

        def ended(call: SimCall) -> None:
            self.sim.loop.after(hop + own, self._done, recs, start, call.error is not None)

        self.sim.loop.after(hop, self._call, recs, ended)

    def _call(self, recs: list[SimRecord], ended: Callable[[SimCall], None]) -> None:
        pool = self.pool
        assert pool is not None
        if self.kind == "embed":
            pool.pool.submit_embed(["x" * (4 * r.prompt_tokens) for r in recs],
                                   SimCall(len(recs), ended))
        else:
            reqs = [self.sim.request(self, r) for r in recs]

            def forget(call: SimCall) -> None:
                if call.error is None:  # all answered: no replica reads their shapes again
                    for req in reqs:  # (a failed call's others may still be in flight)
                        self.sim.shapes.drop(req)
                ended(call)

            pool.pool.submit_generate(reqs, SimCall(len(recs), forget))
        pool.poke()

    def _done(self, recs: list[SimRecord], start: float, failed: bool) -> None:
        now = self.sim.loop.now()
        m = self.meter
        m.service.record((now - start) * 1e6 / len(recs), len(recs))
        if failed:
            m.errors += len(recs)
            for r in recs:
                r.failed = True
                self.sim.end_copy(r)
            self.busy -= 1
            self.try_start()
            return
        m.records_out += len(recs)
        self._push(deque((r, c) for r in recs for c in self.consumers) if self.consumers
                   else deque(), recs)

    def _push(self, todo: deque[tuple[SimRecord, SimStage]], recs: list[SimRecord]) -> None:
        """Hand each record to each consumer; a full one holds this worker until room."""
        while todo:
            rec, nxt = todo[0]
            if not nxt.offer(rec):
                nxt.blocked.append(lambda: self._push(todo, recs))
                return
            todo.popleft()
        if not self.consumers:
            for r in recs:
                self.sim.end_copy(r)
        self.busy -= 1
        self.try_start()


class SimPipeline:
    """A compiled plan's stages, wired, with its profile."""

    def __init__(self, sim: Simulation, plan: Plan, profile: Profile):
        self.sim, self.plan, self.name = sim, plan, plan.name
        self.stages: list[SimStage] = []
        self.input_tokens = round(profile.input_tokens)
        by_index: dict[int, SimStage] = {}
        consumers = plan.consumers()
        for i, s in enumerate(plan.stages):
            if s.ops[0].op.kind == "source":
                continue
            prof = profile.stages.get(s.id)
            if prof is None:
                raise ProfileError(f"profile of pipeline {plan.name!r} has no stage "
                                   f"{s.id!r} (profile the plan as it compiles now: "
                                   f"tailrace profile {plan.pipeline.source_file or 'P.yaml'})")
            pool = sim.pool_for(plan, s, prof, profile)
            st = SimStage(sim, self, s, prof, pool)
            by_index[i] = st
            self.stages.append(st)
        first = plan.first_stages()
        self.first = [by_index[i] for i in sorted(first)]
        for i, ports in consumers.items():
            if set(ports) - {None}:
                raise ProfileError(f"pipeline {plan.name!r}: stage {plan.stages[i].id!r} "
                                   "sends records by port (branch); the simulator sends "
                                   "every record down every edge and does not model ports")
            if i in by_index:
                by_index[i].consumers = [by_index[c] for c in ports.get(None, [])]


class Simulation:
    """Build with the plans, their profiles and a ``Config``; ``run(arrivals)``."""

    def __init__(self, plans: Sequence[Plan], profiles: Sequence[Profile], config: Config):
        if config.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {config.nodes}")
        if config.runtime not in ("local", "ray"):
            raise ValueError(f"runtime must be local or ray, got {config.runtime!r}")
        self.config = config
        ray = config.runtime == "ray"
        self.stage_hops = ray
        self.loop = Loop()
        self.rng = random.Random(f"tailrace-simulate-{config.seed}")  # not the arrivals' stream
        self.shapes = Shapes()
        self.slow: dict[int, float] = {}
        self.hop_s = (config.hop_ms if config.hop_ms is not None
                      else (1.0 if config.nodes > 1 or ray else 0.0)) / 1000.0
        self.pools: dict[str, PoolDriver] = {}
        self._engines: dict[str, EngineProfile] = {}
        for prof in profiles:
            self._engines.update(prof.engines)
        by_name = {p.pipeline: p for p in profiles}
        options, self.max_tokens = admission_setup(config.admission, list(plans),
                                                   config.max_in_flight)
        options.update(config.admission_options)
        self.policy = make_policy(config.admission, clock=self.loop.now, **options)
        self.policy.on_reject = self._rejected
        self.pipelines: dict[str, SimPipeline] = {}
        for plan in plans:
            found = by_name.get(plan.name) or (profiles[0] if len(profiles) == 1 else None)
            if found is None:
                raise ProfileError(f"no profile for pipeline {plan.name!r}; profiles given "
                                   f"for: {', '.join(by_name) or 'none'}")
            self.pipelines[plan.name] = SimPipeline(self, plan, found)
        for _, engine, rid in config.kills:
            d = self.pools.get(engine)
            if d is None:
                raise ValueError(f"--kill: no engine {engine!r}; engines: "
                                 f"{', '.join(self.pools) or 'none'}")
            if not 0 <= rid < len(d.replicas):
                raise ValueError(f"--kill: engine {engine!r} has replicas "
                                 f"0..{len(d.replicas) - 1}")
        for _, node, factor in config.slow:
            if not 0 <= node < config.nodes or not factor > 0:
                raise ValueError(f"--slow: node must be in 0..{config.nodes - 1} and the "
                                 f"factor > 0, got node {node}, factor {factor}")
        self._waiting: dict[str, SimRecord] = {}
        self._polling = False
        self._ids = 0
        self.live = 0  # records arrived and not ended
        self.results: list[tuple[str, float, float, str]] = []  # pipeline, arrival, end, outcome
        self.tickets_out = 0
        self._pending = 0  # requests ``run`` was given

    # -- engines ----------------------------------------------------------------------
    def pool_for(self, plan: Plan, stage: PlanStage, prof: StageProfile,
                 profile: Profile) -> PoolDriver | None:
        name = prof.engine
        if name is None:
            return None
        if name in self.pools:
            return self.pools[name]
        eprof = self._engines.get(name)
        if eprof is None:
            raise ProfileError(f"profile of pipeline {plan.name!r} has no engine {name!r}")
        spec = dict(plan.pipeline.engines.get(name) or {})
        base, options = split_pool(spec) if spec else ({"backend": "onnx"}, {})
        per_node = self.config.replicas.get(name, options.pop("replicas", 1))
        options.pop("endpoints", None)
        options.pop("isolation", None)
        if self.config.dispatch is not None:
            options["dispatch"] = self.config.dispatch
            if self.config.dispatch != "prefix_affinity":
                options.pop("affinity_slack", None)
        if "replicas" not in spec and "endpoints" not in spec:
            # no pool in a real run: the stage calls the engine itself, which takes every
            # call at once (llama.cpp queues them in its scheduler) and never merges two
            # callers' calls into one (so none waits for another's requests to finish)
            options.setdefault("max_in_flight", 1 if eprof.kind == "calls" else 1024)
            options.setdefault("max_batch_size", 1)
        if "cluster" in base:
            raise ProfileError(f"engine {name!r}: cluster: (a Ray Serve deployment with "
                               "its own router) is not simulated; give it replicas: N")
        total = per_node * (self.config.nodes if self.config.runtime == "local" else 1)
        driver = PoolDriver(self, name, base, eprof, total, options)
        self.pools[name] = driver
        return driver

    def request(self, stage: SimStage, rec: SimRecord) -> GenerationRequest:
        """The generation request a stage sends for ``rec``, its shape remembered."""
        import numpy as np

        prof = stage.prof
        rng = self.rng
        n = max(int(round(prof.prompt_tokens.draw(rng, tokens=rec.prompt_tokens)))
                if prof.prompt_tokens is not None else rec.prompt_tokens, 1)
        out = rec.output_tokens or max(
            prof.output_samples[int(rng.random() * len(prof.output_samples))]
            if prof.output_samples else int(round(prof.output_tokens)), 1)
        shared = min(stage.shared, n)
        base = rec.id % (1 << 30)  # at any position, two records' own tokens differ
        tokens = np.concatenate([np.arange(shared, dtype=np.int32) - (1 << 30),
                                 (np.arange(n - shared, dtype=np.int32) + base)])
        text = "s" * (4 * shared) + f"{rec.id:x} ".ljust(4 * (n - shared) or 1, ".")
        pri, deadline = rec.urgency
        req = GenerationRequest(prompt=text, max_tokens=max(stage.max_tokens, out),
                                priority=pri, deadline=None if math.isinf(deadline)
                                else deadline)
        self.shapes.put(req, Shape(tokens, out))
        return req

    def hop(self) -> float:
        if not self.hop_s:
            return 0.0
        j = self.config.jitter
        return self.hop_s * (1 + self.rng.uniform(-j, j))

    # -- the door -----------------------------------------------------------------------
    def arrive(self, a: Arrival) -> None:
        pipe = self.pipelines.get(a.pipeline)
        if pipe is None:
            raise ValueError(f"arrival for pipeline {a.pipeline!r}, which is not simulated")
        self._ids += 1
        rec = SimRecord(self._ids, pipe, a, a.prompt_tokens if a.prompt_tokens is not None
                        else pipe.input_tokens, a.output_tokens or 0)
        self.live += 1
        req = Request(str(rec.id), pipe.name, arrival=self.loop.now(),
                      prompt_tokens=rec.prompt_tokens,
                      max_tokens=self.max_tokens.get(pipe.name, 64))
        ticket = self.policy.try_admit(req)
        if ticket is not None:
            self._enter(rec, ticket)
            return
        rej = self.policy.last_rejection
        if rej is not None and rej.request is req:
            self._finish(rec, "rejected")
            return
        self._waiting[req.id] = rec
        if not self._polling:
            self._polling = True
            self.loop.after(POLL_S, self._poll)

    def _rejected(self, rej: Any) -> None:
        rec = self._waiting.pop(rej.request.id, None)
        if rec is not None:
            self._finish(rec, "rejected")

    def _poll(self) -> None:
        self._admit(self.policy.poll())
        if self._waiting:
            self.loop.after(POLL_S, self._poll)
        else:
            self._polling = False

    def _admit(self, tickets: list[Any]) -> None:
        for t in tickets:
            self._enter(self._waiting.pop(t.request.id), t)

    def _enter(self, rec: SimRecord, ticket: Any) -> None:
        rec.ticket = ticket
        self.tickets_out += 1
        if self.policy.orders_by_urgency:
            req = ticket.request
            rank = self.policy.slo_for(req.pipeline).rank
            rec.urgency = (rank, ticket.deadline)
        first = rec.pipe.first
        rec.copies = len(first)
        for st in first:
            self._offer_from_source(st, rec)

    def _offer_from_source(self, st: SimStage, rec: SimRecord) -> None:
        if not st.offer(rec):  # the source waits for room (backpressure reaches the door)
            st.blocked.append(lambda: self._offer_from_source(st, rec))

    def end_copy(self, rec: SimRecord) -> None:
        rec.copies -= 1
        if rec.copies <= 0:
            self._finish(rec, "error" if rec.failed else "ok")

    def _finish(self, rec: SimRecord, outcome: str) -> None:
        if rec.ended:
            raise AssertionError(f"record {rec.id} ended twice")
        rec.ended = True
        self.live -= 1
        now = self.loop.now()
        self.results.append((rec.pipe.name, rec.arrival, now, outcome))
        if rec.ticket is not None:
            self.tickets_out -= 1
            self.policy.release(rec.ticket, now - rec.ticket.admitted_at)
            self._admit(self.policy.poll())

    def _slow_node(self, node: int, factor: float) -> None:
        self.slow[node] = factor
        for driver in self.pools.values():
            for rep in driver.replicas:
                if rep.node == node:
                    rep.cut()

    # -- the run --------------------------------------------------------------------------
    def run(self, arrivals: Sequence[Arrival]) -> None:
        """Simulate ``arrivals`` until every request has ended."""
        loop = self.loop
        for a in arrivals:
            loop.at(a.t, self.arrive, a)
        for t, engine, rid in self.config.kills:
            loop.at(t, self._kill, engine, rid)
        for t, node, factor in self.config.slow:
            loop.at(t, self._slow_node, node, factor)
        self._pending = len(arrivals)
        if self.pools:
            loop.after(MAINTAIN_S, self._maintain)
        loop.run(stop=lambda: len(self.results) >= self._pending)
        if len(self.results) != self._pending or self.tickets_out:
            raise AssertionError(f"simulation ended with {self._pending - len(self.results)} "
                                 f"requests unfinished and {self.tickets_out} tickets held")

    def _maintain(self) -> None:
        for d in self.pools.values():
            d.maintain()
        if len(self.results) < self._pending:
            self.loop.after(MAINTAIN_S, self._maintain)

    def _kill(self, engine: str, rid: int) -> None:
        self.pools[engine].replicas[rid].kill()  # (checked in __init__)

    def stage_meters(self) -> list[StageMeter]:
        return [st.meter for p in self.pipelines.values() for st in p.stages]

