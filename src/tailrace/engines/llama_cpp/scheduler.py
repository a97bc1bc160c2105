"""Which requests hold the engine's sequence slots, and which prompt chunks go into a step.

A request waits for a slot as a ``Job`` and holds one as a ``Seq``, which moves
PREFILLING -> DECODING -> DONE; preemption moves a PREFILLING or DECODING one to PAUSED
(it keeps its KV stream) and back. Rank is (-class, deadline, arrival): lower is more
urgent, so ``min`` picks the most urgent and ``max`` the least. The decode loop asks the
scheduler before every step; it only keeps lists and decides (no model, no llama.cpp), so
its rules (docs/engines.md, "Priorities inside the engine") are tested on their own.
Streams in use = active + paused, so preemption needs ``n_streams > n_active`` (the
engine's ``cache_sequences``).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..base import GenerationRequest
from ..call import Call

#: a sort key: (-priority, deadline, arrival); lower is more urgent
Rank = tuple[int, float, int]


class State(enum.Enum):
    PREFILLING = "prefilling"  # prompt chunks still to be sent
    DECODING = "decoding"  # one token a step
    PAUSED = "paused"  # preempted: keeps its stream (and KV) until it resumes
    DONE = "done"  # finished: its slot is free, its result given to its call


@dataclass(slots=True, eq=False)
class Job:
    """One request of a ``generate`` call, waiting for a sequence slot."""

    call: Call
    index: int  # the request's place in its call
    request: GenerationRequest
    prompt: Any  # numpy int32 token ids
    grammar: Any = None  # its grammar sampler (response_format); whoever drops it frees it
    rank: Rank = (0, math.inf, 0)  # set by the scheduler when the job arrives


@dataclass(slots=True, eq=False)
class Seq:
    """One request occupying a sequence slot (a KV stream) while it is prefilled and
    generated."""

    job: Job
    slot: int  # its KV stream, also its llama.cpp seq_id
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    sampler: Any = None  # its ``sampling.Sampler``
    stream: Any = None  # its ``sampling.TextStream``
    state: State = field(init=False, default=State.PREFILLING)
    n_prompt: int = field(init=False, default=0)
    fed: int = field(init=False, default=0)  # prompt tokens already sent to the model
    pos: int = field(init=False, default=0)  # position of the next token sent for it
    last: int = field(init=False, default=-1)  # the last sampled token, sent next step
    n_gen: int = field(init=False, default=0)
    row: int | None = field(init=False, default=None)  # batch index of its logits this
    # step (None: none)
    grammar: Any = field(init=False, default=None)  # the job's grammar sampler

    def __post_init__(self) -> None:
        self.n_prompt = len(self.job.prompt)
        self.fed = self.pos = self.cached
        self.grammar, self.job.grammar = self.job.grammar, None  # the sequence owns it now

    @property
    def rank(self) -> Rank:
        return self.job.rank

    @property
    def priority(self) -> int:
        return self.job.request.priority

    @property
    def prompt(self) -> Any:
        return self.job.prompt

    def resume(self) -> None:
        """Go on where it stopped (its KV kept in its stream)."""
        self.state = State.DECODING if self.fed == self.n_prompt else State.PREFILLING

    def feed(self, n: int) -> None:
        """``n`` more prompt tokens go into this step's batch."""
        self.fed += n
        self.pos = self.fed
        if self.fed == self.n_prompt:
            self.state = State.DECODING


class Scheduler:
    """Waiting jobs, active and paused sequences of one engine; used by its decode loop's
    thread only."""

    def __init__(self, n_active: int, n_streams: int, chunk: int, n_batch: int):
        """n_active:  most sequences decoded at once (``n_seq_max``).
        n_streams: KV streams; a started or paused sequence holds one.
        chunk:     prompt tokens a sequence sends per step (``prefill_chunk``).
        n_batch:   most tokens in one step.
        """
        self.n_active, self.n_streams, self.chunk, self.n_batch = (
            n_active, n_streams, chunk, n_batch)
        self._waiting: list[tuple[Rank, Job]] = []  # a heap, most urgent first
        self.active: list[Seq] = []  # kept sorted by slot (see ``schedule``)
        self.paused: list[Seq] = []
        self._arrivals = itertools.count()
        self.preemptions = 0  # sequences paused for a more urgent request

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def idle(self) -> bool:
        """Nothing waits, runs or is paused."""
        return not (self._waiting or self.active or self.paused)

    def add(self, job: Job) -> None:
        """A request arrives: it is ranked by (class, deadline, arrival)."""
        r = job.request
        deadline = r.deadline if r.deadline is not None else math.inf
        job.rank = (-r.priority, deadline, next(self._arrivals))
        heapq.heappush(self._waiting, (job.rank, job))

    def schedule(self, start: Callable[[Job], Seq | None]) -> None:
        """Preempt, resume and start sequences until the decoding slots are full or
        nothing else may run. ``start`` puts a job into a free stream (None: its call
        already failed, the job is dropped)."""
        self._preempt()
        changed = False
        while len(self.active) < self.n_active and self._try_add_one(start):
            changed = True
        if changed:  # llama.cpp splits per-sequence streams into ubatches of consecutive
            self.active.sort(key=lambda s: s.slot)  # seq ids: keep the batch in that order

    def _spare(self) -> bool:
        return len(self.active) + len(self.paused) < self.n_streams

    def _preempt(self) -> None:
        """Pause the least urgent sequences while a more urgent request waits, every
        decoding slot is taken and a stream is spare for it."""
        while self._waiting and len(self.active) >= self.n_active and self._spare():
            victim = max(self.active, key=lambda s: s.rank)
            if -self._waiting[0][0][0] <= victim.priority:
                return
            self.active.remove(victim)
            victim.state = State.PAUSED
            self.paused.append(victim)
            self.preemptions += 1

    def _try_add_one(self, start: Callable[[Job], Seq | None]) -> bool:
        """Resume the most urgent paused sequence or start the most urgent waiting job,
        whichever ranks first; False when neither can run now."""
        if not (self._waiting or self.paused):
            return False
        back = min(self.paused, key=lambda s: s.rank) if self.paused else None
        if back is not None and (not self._waiting or not self._spare()
                                 or back.rank <= self._waiting[0][0]):
            self.paused.remove(back)
            back.resume()
            self.active.append(back)
            return True
        if not self._spare():
            return False
        _, job = heapq.heappop(self._waiting)
        seq = start(job)
        if seq is not None:
            self.active.append(seq)
        return True

    def prefill(self) -> dict[Seq, int]:
        """The prompt tokens each prefilling sequence sends in this step: a chunk each,
        most urgent first, for the most urgent class with an active sequence, and no more
        than the step has room for beside the decoding sequences' tokens. While that
        class only decodes, one chunk of the most urgent less urgent prompt goes in too
        (a background chunk: the urgent tokens pay one chunk a step, the slots the
        others hold do not sit idle)."""
        active = self.active
        top = max(s.priority for s in active)
        budget = self.n_batch - sum(1 for s in active if s.state is State.DECODING)
        allot: dict[Seq, int] = {}
        for s in sorted((s for s in active if s.state is State.PREFILLING),
                        key=lambda s: s.rank):
            if s.priority < top and (allot or any(
                    o.priority == top and o.state is State.PREFILLING for o in active)):
                break  # sorted: every one after it is less urgent still
            c = min(self.chunk, s.n_prompt - s.fed)
            if c > budget:
                continue
            allot[s] = c
            budget -= c
        return allot

    def retire(self) -> None:
        """Forget the sequences that finished in the last step."""
        if any(s.state is State.DONE for s in self.active):
            self.active = [s for s in self.active if s.state is not State.DONE]

    def drain(self) -> tuple[list[Seq], list[Job]]:
        """Everything it holds (active and paused sequences, waiting jobs), now forgotten:
        after the loop failed, for their calls to get the error."""
        seqs, jobs = self.active + self.paused, [j for _, j in self._waiting]
        self.active, self.paused, self._waiting = [], [], []
        return seqs, jobs
