"""What the decode loop schedules: a request waiting for a slot (``Job``) and a request
holding one (``Seq``) in one of four named states.

A ``Seq`` moves PREFILLING -> DECODING -> DONE; the scheduler may move a PREFILLING or
DECODING one to PAUSED (preempted: it keeps its KV stream) and back to where it was.
Rank is (class, deadline, arrival): lower is more urgent, so ``min`` picks the most
urgent and ``max`` the least.
"""

from __future__ import annotations

import enum
import math
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

    def pause(self) -> None:
        self.state = State.PAUSED

    def resume(self) -> None:
        """Go on where it stopped (its KV kept in its stream)."""
        self.state = State.DECODING if self.fed == self.n_prompt else State.PREFILLING

    def feed(self, n: int) -> None:
        """``n`` more prompt tokens go into this step's batch."""
        self.fed += n
        self.pos = self.fed
        if self.fed == self.n_prompt:
            self.state = State.DECODING
