"""Virtual engine replicas: the transports a real ``EnginePool`` drives in a simulation.

The pool (``engines/pool/pool.py``) batches, dispatches, retries and restarts exactly as
it does for real; only its replicas are virtual (``EnginePool(transport=...)``). Two kinds,
by the engine's profile:

- ``ContinuousReplica``: a continuously batching generation engine (llama.cpp). Its
  decode loop is the real one's, step for step: arrivals go to the real ``Scheduler``
  (``engines/llama_cpp/scheduler.py``), which starts, preempts and resumes sequences and
  allots prompt chunks; each sequence starts in the stream the real ``PrefixCache``
  picks, so prefix hits are the cache's own. Only the step itself is virtual: it lasts
  ``model(const=1, decoding=D, prefill=P, starts=S)`` seconds (S: sequences started
  in it: a request's own set-up) and then advances each sequence as
  the real decoder does (a prompt's last chunk yields the first token).
- ``CallReplica``: any other engine: one call at a time, each lasting
  ``model(items=n, tokens=t)`` seconds.

A replica can be killed (its in-flight work is lost, the pool retries it elsewhere and
restarts it after the real back-off) and slowed (every duration times a factor).
"""

from __future__ import annotations

import itertools
import random
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

from ..engines.base import Generation, GenerationRequest
from ..engines.call import Call
from ..engines.llama_cpp.prefix_cache import PrefixCache
from ..engines.llama_cpp.scheduler import Job, Scheduler, Seq, State
from ..engines.pool.messages import (
    BatchResult,
    Cancel,
    EmbedBatch,
    Exited,
    GenerateBatch,
    Ready,
    Shutdown,
)
from .events import Loop
from .profile import EngineProfile, LinearModel

_PIDS = itertools.count(1_000_000)
#: the most steps planned as one event (those drawn past a cut are wasted)
MAX_RUN = 256


@dataclass(slots=True)
class Shape:
    """What the simulator knows of one generation request: its prompt's token ids (a
    shared prefix then its own) and how many tokens it will generate."""

    tokens: Any  # numpy int32
    output: int


class Shapes:
    """Request -> ``Shape``, by identity: the pool hands replicas the very request
    objects it was given (thread transports do not copy)."""

    def __init__(self) -> None:
        self._by_id: dict[int, Shape] = {}

    def put(self, req: GenerationRequest, shape: Shape) -> None:
        self._by_id[id(req)] = shape

    def get(self, req: GenerationRequest) -> Shape:
        return self._by_id[id(req)]

    def drop(self, req: GenerationRequest) -> None:
        self._by_id.pop(id(req), None)


class Replica:
    """The transport protocol of ``engines/pool/replicas.py``, on the virtual clock."""

    def __init__(self, loop: Loop, profile: EngineProfile, deliver: Any, node: int,
                 slow: dict[int, float], kind: str, rng: Any = None):
        self.loop, self.profile, self.deliver, self.node = loop, profile, deliver, node
        self.rng = rng if rng is not None else random.Random(0)
        self._slow = slow  # node -> factor (shared: a node slowed later slows it too)
        self.kind = kind
        self.dead = self.stopped = False
        self.busy_s = 0.0  # virtual seconds spent running steps or calls

    def factor(self) -> float:
        return self._slow.get(self.node, 1.0)

    def start(self) -> None:
        self.loop.after(self.profile.start_s, self._ready)

    def _ready(self) -> None:
        if not self.dead and not self.stopped:
            self.deliver(Ready(next(_PIDS), "simulated", None, None, True))

    def alive(self) -> bool:
        return not self.dead

    def cut(self) -> None:
        """Something changed that durations already drawn did not know (its node's
        speed): replicas that plan ahead plan again from the step in progress."""

    def kill(self) -> None:
        """The replica's process dies now: what it runs is lost (the pool hears
        ``Exited``, as from a real process's reader thread)."""
        if self.dead:
            return
        self.dead = True
        self.deliver(Exited(-9))

    def request_stop(self) -> None:
        self.stopped = True

    def stop(self) -> None:
        self.stopped = True


class CallReplica(Replica):
    """An engine that runs one call at a time (an embedder, a plain server)."""

    def __init__(self, *args: Any, shapes: Shapes) -> None:
        super().__init__(*args)
        self._shapes = shapes
        self._queue: deque[Any] = deque()
        self._running = False

    def send(self, msg: Any) -> None:
        if self.dead or self.stopped or isinstance(msg, Shutdown | Cancel):
            return
        self._queue.append(msg)
        if not self._running:
            self._next()

    def _next(self) -> None:
        if not self._queue or self.dead:
            self._running = False
            return
        self._running = True
        msg = self._queue.popleft()
        if isinstance(msg, EmbedBatch):
            n, tokens = len(msg.texts), sum(len(t) // 4 + 1 for t in msg.texts)
        else:
            n = len(msg.requests)
            tokens = sum(len(self._shapes.get(r).tokens) for r in msg.requests)
        dt = self.profile.model.draw(self.rng, items=n, tokens=tokens) * self.factor()
        self.busy_s += dt
        self.loop.after(dt, self._done, msg)

    def _done(self, msg: Any) -> None:
        if self.dead:
            return
        if isinstance(msg, EmbedBatch):
            outputs: Any = [None] * len(msg.texts)
        else:
            outputs = []
            for r in msg.requests:
                s = self._shapes.get(r)
                outputs.append(Generation("", len(s.tokens), s.output, "length"))
        self.deliver(BatchResult(msg.batch_id, outputs))
        self._next()


class ContinuousReplica(Replica):
    """A continuously batching generation engine: the real scheduler and prefix cache,
    virtual decode steps."""

    def __init__(self, *args: Any, shapes: Shapes) -> None:
        super().__init__(*args)
        p = self.profile
        self._shapes = shapes
        streams = p.n_seq_max  # + cache_sequences: not profiled; the engine's default
        self.scheduler = Scheduler(p.n_seq_max, streams, p.chunk, max(p.n_batch, p.n_seq_max))
        self.cache = PrefixCache(streams, p.chunk, lambda *_: True)
        self._inbox: list[Job] = []
        self._output: dict[int, int] = {}  # id(job) -> tokens it generates
        self._batches: dict[int, tuple[int, Call]] = {}  # id(call) -> (batch id, call)
        self._stepping = False
        self._started = 0  # sequences started in the step being planned
        self.steps = 0
        # a run of steps planned as one event (``_run``): (its start, each step's end
        # from then and prompt chunks, its generation); ``_gen`` voids a cut run's event
        self._planned: tuple[float, list[float], list[dict[Seq, int]], int] | None = None
        self._gen = 0

    def send(self, msg: Any) -> None:
        if self.dead or self.stopped or isinstance(msg, Shutdown):
            return
        if isinstance(msg, Cancel):  # not simulated: callers never leave mid-call here
            return
        assert isinstance(msg, GenerateBatch)
        call = Call(len(msg.requests))
        self._batches[id(call)] = (msg.batch_id, call)
        for i, r in enumerate(msg.requests):
            shape = self._shapes.get(r)
            if not self.profile.ranks:  # a first-come-first-served engine: no rank
                r = _FIFO_REQUEST
            job = Job(call, i, r, shape.tokens)
            self._output[id(job)] = shape.output
            self._inbox.append(job)
        if self._planned is not None:
            self.cut()
        if not self._stepping:
            self._stepping = True
            self.loop.after(0.0, self._step)

    def _start(self, job: Job) -> Seq:
        slot, hit = self.cache.take(job.prompt)
        self._started += 1
        return Seq(job, slot, hit)

    def _step(self) -> None:
        """The decode loop's iteration: arrivals in, the scheduler's choice, one step (or
        the run of steps it would take before anything changes: see ``_run``)."""
        if self.dead:
            return
        sched = self.scheduler
        for job in self._inbox:
            sched.add(job)
        self._inbox.clear()
        if sched.idle():
            self._stepping = False
            return
        self._started = 0
        sched.schedule(self._start)
        if not sched.active:
            self._stepping = False
            return
        if self._settled():
            self._run()
            return
        allot = sched.prefill()
        decoding = sum(1 for s in sched.active if s.state is State.DECODING)
        dt = self.profile.model.draw(self.rng, decoding=decoding, prefill=sum(allot.values()),
                                     starts=self._started) * self.factor()
        self.busy_s += dt
        self.steps += 1
        self.loop.after(dt, self._stepped, list(sched.active), allot)

    def _settled(self) -> bool:
        """Whether the scheduler's next steps would start, resume or preempt nothing until
        a sequence ends or a request arrives: nothing paused, and nothing waiting or every
        slot and stream taken."""
        sched = self.scheduler
        n = len(sched.active)
        return not sched.paused and (not sched.waiting or (
            n >= sched.n_active and n >= sched.n_streams))

    def _run(self) -> None:
        """The steps the loop takes until the first sequence ends, while nothing arrives
        and nothing can start: each step's prompt chunks and tokens are the scheduler's
        (tried on the sequences, then undone), its duration drawn as one by one, and the
        run takes one event, not one a step. An arrival or a slowed node cuts it at the end
        of the step in progress (``cut``): the real loop takes arrivals only there."""
        sched, output = self.scheduler, self._output
        active = list(sched.active)
        saved = [(s.fed, s.pos, s.state, s.n_gen) for s in active]
        model, rng, f = self.profile.model, self.rng, self.factor()
        # the model's mean inlined (this runs once a virtual step); other models (the
        # driver counter of ``step_features``) are called
        inline = isinstance(model, LinearModel)
        c = model.coef if inline else {}
        c0, cd, cp, cs = (c.get(k, 0.0) for k in ("const", "decoding", "prefill", "starts"))
        ends: list[float] = []
        allots: list[dict[Seq, int]] = []
        t, starts, ended = 0.0, self._started, False
        prefilling = sum(1 for s in active if s.state is State.PREFILLING)
        while not ended and len(ends) < MAX_RUN:
            allot = sched.prefill() if prefilling else {}
            decoding = 0
            for s in active:
                if s.state is State.DECODING:
                    decoding += 1
                elif s in allot:
                    s.feed(allot[s])
                    if s.state is not State.DECODING:
                        continue  # no token yet
                    prefilling -= 1
                else:
                    continue
                s.n_gen += 1
                ended = ended or s.n_gen >= output[id(s.job)]
            prefill = sum(allot.values()) if allot else 0
            if inline:
                t += model.spread(rng, c0 + cd * decoding + cp * prefill + cs * starts) * f
            else:
                t += model.draw(rng, decoding=decoding, prefill=prefill, starts=starts) * f
            starts = 0
            ends.append(t)
            allots.append(allot)
        for s, (fed, pos, state, n_gen) in zip(active, saved, strict=True):
            s.fed, s.pos, s.state, s.n_gen = fed, pos, state, n_gen
        self.busy_s += t
        self.steps += len(ends)
        self._gen += 1
        self._planned = (self.loop.now(), ends, allots, self._gen)
        self.loop.after(t, self._advanced, self._gen, allots)

    def cut(self) -> None:
        """End the planned run of steps with the step in progress now (something
        arrived, or the node's speed changed): the steps after it are planned again."""
        plan, self._planned = self._planned, None
        if plan is None or self.dead:
            return
        start, ends, allots, gen = plan
        i = bisect_left(ends, self.loop.now() - start)  # the step in progress ends at ends[i]
        if i >= len(ends) - 1 or gen != self._gen:
            return
        self.busy_s -= ends[-1] - ends[i]
        self.steps -= len(ends) - 1 - i
        self._gen += 1
        self.loop.at(start + ends[i], self._advanced, self._gen, allots[:i + 1])

    def _advanced(self, gen: int, allots: list[dict[Seq, int]]) -> None:
        """The planned run's steps are done (the scheduler's prompt chunks for each in
        ``allots``): take them, as the loop would have."""
        if self.dead or gen != self._gen:
            return
        self._planned = None
        sched = self.scheduler
        for allot in allots:
            self._apply(sched.active, allot)
        sched.retire()
        self._step()

    def _stepped(self, active: list[Seq], allot: dict[Seq, int]) -> None:
        if self.dead:
            return
        self._apply(active, allot)
        self.scheduler.retire()
        self._step()

    def _apply(self, active: list[Seq], allot: dict[Seq, int]) -> None:
        for s in active:  # as the real decoder's batch fill and sampling
            if s.state is State.DECODING:
                self._token(s)
            elif s in allot:
                s.feed(allot[s])
                if s.state is State.DECODING:  # the prompt's last chunk: the first token
                    self._token(s)

    def _token(self, s: Seq) -> None:
        s.n_gen += 1
        job = s.job
        if s.n_gen >= self._output[id(job)]:
            del self._output[id(job)]
            self.cache.release(s.slot, s.prompt, s.fed)
            s.state = State.DONE
            job.call.complete(job.index, Generation("", s.n_prompt, s.n_gen, "length",
                                                    {"cached_tokens": s.cached}))
            if job.call.done.is_set():
                batch_id, call = self._batches.pop(id(job.call))
                self.deliver(BatchResult(batch_id, call.results))


class SequenceReplica(Replica):
    """A remote server that runs each request as its own sequence (the ``sequences``
    model): a request waits first come, first served for one of ``n_seq_max`` slots;
    holding one, its prompt takes ``const + prefill x P`` seconds without delaying the
    others, then each of its tokens ``tokens + crowd x (active - 1)`` seconds, where
    ``active`` is the slots held meanwhile (the sequences share the server's decode).
    Tokens advance continuously between changes of ``active`` (processor sharing)."""

    def __init__(self, *args: Any, shapes: Shapes) -> None:
        super().__init__(*args)
        self._shapes = shapes
        self._waiting: deque[tuple[Any, int, int, int]] = deque()  # call, index, P, O
        self._active: list[list[Any]] = []  # [call, index, P, O, tokens left or None]
        self._calls: dict[int, int] = {}  # id(call) -> batch id
        self._t = 0.0
        self._version = 0

    def send(self, msg: Any) -> None:
        if self.dead or self.stopped or isinstance(msg, Shutdown | Cancel):
            return
        call = Call(len(msg.requests))
        self._calls[id(call)] = msg.batch_id
        for i, r in enumerate(msg.requests):
            shape = self._shapes.get(r)
            self._waiting.append((call, i, len(shape.tokens), shape.output))
        self._advance()
        self._admit()
        self._reschedule()

    def _per_token(self) -> float:
        c = self.profile.model.coef
        return (c.get("tokens", 0.0) + c.get("crowd", 0.0) * (len(self._active) - 1)) \
            * self.factor()

    def _advance(self) -> None:
        now = self.loop.now()
        dt, self._t = now - self._t, now
        if dt > 0 and self._active:
            per = self._per_token()
            done = dt / per if per > 0 else float("inf")
            for s in self._active:
                if s[4] is not None:
                    s[4] -= done
            self.busy_s += dt

    def _admit(self) -> None:
        c = self.profile.model.coef
        while self._waiting and len(self._active) < self.profile.n_seq_max:
            call, i, p, o = self._waiting.popleft()
            seq = [call, i, p, o, None]
            self._active.append(seq)
            mean = (c.get("const", 0.0) + c.get("prefill", 0.0) * p) * self.factor()
            k = self.profile.model.cv
            dt = mean if k <= 0 or mean <= 0 else self.rng.gammavariate(1 / k / k, mean * k * k)
            self.loop.after(dt, self._prefilled, seq)

    def _prefilled(self, seq: list[Any]) -> None:
        if self.dead:
            return
        self._advance()
        seq[4] = float(seq[3])
        self._reschedule()

    def _reschedule(self) -> None:
        self._version += 1
        left = [s[4] for s in self._active if s[4] is not None]
        if left:
            self.loop.after(max(min(left), 0.0) * self._per_token(), self._finish,
                            self._version)

    def _finish(self, version: int) -> None:
        if version != self._version or self.dead:
            return
        self._advance()
        done = [s for s in self._active if s[4] is not None and s[4] <= 1e-9]
        self._active = [s for s in self._active if not (s[4] is not None and s[4] <= 1e-9)]
        for call, i, p, o, _ in done:
            call.complete(i, Generation("", p, o, "length"))
            if call.done.is_set():
                self.deliver(BatchResult(self._calls.pop(id(call)), call.results))
        self._admit()
        self._reschedule()


_FIFO_REQUEST = GenerationRequest(prompt="")  # class 0, no deadline: arrival order


def sequence_features(shapes: list[tuple[int, int]]) -> dict[str, float]:
    """The ``sequences`` model's drivers for one call of requests shaped ``(prompt
    tokens, output tokens)`` alone on an idle server (all within its slots, in step):
    its longest request's prefill and tokens, and the crowd those tokens shared."""
    n = len(shapes)
    p, o = max(shapes, key=lambda x: x[1])
    return {"const": 1.0, "prefill": float(p), "tokens": float(o),
            "crowd": float(o * (n - 1))}


def step_features(profile: EngineProfile, shapes: list[tuple[int, int]]) -> dict[str, float]:
    """What one call of requests shaped ``(prompt tokens, output tokens)``, alone on an
    idle engine, adds up to in the step model's drivers (``const`` steps, ``decoding``
    tokens, ``prefill`` tokens), replayed on the real scheduler without a cache hit:
    ``tailrace profile`` fits the step model to measured calls with these."""
    import numpy as np

    loop = Loop()
    counter = _Counter()
    probe = EngineProfile(profile.kind, cast(Any, counter), profile.n_seq_max, profile.chunk,
                          profile.n_batch, 0.0)
    store = Shapes()
    reqs = []
    for k, (p, o) in enumerate(shapes):
        r = GenerationRequest(prompt=str(k), max_tokens=o)
        store.put(r, Shape(np.arange(k * 100_000, k * 100_000 + max(p, 1), dtype=np.int32),
                           max(o, 1)))
        reqs.append(r)
    rep = ContinuousReplica(loop, probe, lambda msg: None, 0, {}, "generate", shapes=store)
    rep.send(GenerateBatch(0, tuple(reqs)))
    loop.run()
    return dict(counter.totals)


class _Counter:
    """A step model that costs nothing and counts its drivers (``step_features``)."""

    def __init__(self) -> None:
        self.totals = {"const": 0.0, "decoding": 0.0, "prefill": 0.0, "starts": 0.0}

    def draw(self, rng: Any, **x: float) -> float:
        return self(**x)

    def __call__(self, **x: float) -> float:
        self.totals["const"] += 1
        for k, v in x.items():
            self.totals[k] += v
        return 0.0
