"""Admission at pipeline ingress: admit now, queue, or reject with a reason and a retry-after.

A policy is a budget with ``try_admit(request) -> Ticket | None``, like mini-sglang's
``PrefillAdder.try_add_one``. The caller's loop only orchestrates:

1. ``try_admit(request)`` on arrival: a ``Ticket`` means run it now; ``None`` means it waits
   in the policy's queue, or was rejected (``last_rejection`` says why, ``on_reject`` hears it).
   A newcomer never overtakes a waiting request: it is admitted at once only when nothing waits.
2. ``release(ticket, seconds)`` when the work is done: frees capacity, calibrates the cost model.
3. ``poll()`` after every release and periodically: admits waiting requests that now fit, in
   the policy's order, and rejects those that can no longer meet their deadline.

Time is read from an injected ``clock``; tests pass a virtual one. Not thread-safe: one
control loop owns a policy. The policies (``simultaneous``, ``fcfs``, ``slo``) and their
registry live in ``policies.py``; SLOs and the cost model in ``slo.py``.

>>> from tailrace.control import Request, make_policy
>>> policy = make_policy("fcfs", max_in_flight=1, max_queue=0, clock=lambda: 0.0)
>>> ticket = policy.try_admit(Request("r1", "qa", arrival=0.0, max_tokens=50))
>>> policy.try_admit(Request("r2", "qa", arrival=0.0, max_tokens=50)) is None
True
>>> policy.last_rejection.reason, policy.last_rejection.retry_after
('queue_full', 1.005)
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import TailraceError
from .slo import CostModel, PipelineSLO, is_count, is_number, is_priority, rank_of, require

QUEUE_FULL = "queue_full"  # the waiting room is full
DEADLINE_UNMEETABLE = "deadline_unmeetable"  # predicted queueing + service overshoot the deadline
DEADLINE_EXPIRED = "deadline_expired"  # it waited until its deadline could no longer be met
MIN_RETRY_AFTER = 0.01  # seconds; a retry-after is never zero


class AdmissionRejected(TailraceError):
    """Over budget: admission turned the request away; the caller may retry later.

    message: what was rejected and why, in one line.
    reason: one of QUEUE_FULL, DEADLINE_UNMEETABLE, DEADLINE_EXPIRED.
    retry_after: seconds after which a retry is predicted to succeed (HTTP ``Retry-After``).
    request_id: the rejected request's id.
    """

    def __init__(self, message: str, *, reason: str, retry_after: float,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    """One unit of work asking for admission to a pipeline."""

    id: str  # the caller's request id, echoed in rejections
    pipeline: str  # its SLO sets the default deadline, class and weight
    arrival: float  # in the policy clock's seconds
    prompt_tokens: int = 0  # prompt length in tokens (for the cost model)
    max_tokens: int = 0  # output tokens to generate at most (for the cost model)
    deadline: float | None = None  # absolute, clock seconds; None: arrival + the SLO's p99
    priority: str | int | None = None  # its own class (a name or an int); None: the SLO's

    def __post_init__(self) -> None:
        where = f"request {self.id!r}"
        require(isinstance(self.pipeline, str) and self.pipeline != "", where, "pipeline",
                "a non-empty string", self.pipeline)
        require(is_number(self.arrival), where, "arrival", "a finite number of clock seconds",
                self.arrival)
        for name in ("prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            require(is_count(value), where, name, "a non-negative integer", value)
        require(self.deadline is None or is_number(self.deadline), where, "deadline",
                "a finite number of clock seconds or None", self.deadline)
        require(self.priority is None or is_priority(self.priority), where, "priority",
                "'interactive', 'standard', 'batch', an integer class or None",
                self.priority)


class Verdict(enum.Enum):
    """What admission does with a request now."""

    ADMIT = "admit"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True)
class Decision:
    """A policy's verdict on a request; a rejection carries its reason and retry-after."""

    verdict: Verdict
    reason: str = ""
    retry_after: float = 0.0


@dataclass(frozen=True)
class Ticket:
    """An admitted request: run it, then hand it back with ``release``."""

    request: Request
    admitted_at: float
    cost: float  # predicted service seconds at admission
    deadline: float  # absolute, in clock seconds
    seq: int  # the policy's bookkeeping id

    @property
    def wait(self) -> float:
        """Seconds between arrival and admission."""
        return self.admitted_at - self.request.arrival


@dataclass(frozen=True)
class Rejection:
    """An explicit refusal: which request, why, and when a retry may succeed."""

    request: Request
    reason: str
    retry_after: float
    at: float

    def error(self) -> AdmissionRejected:
        """The exception to raise (or turn into HTTP 429 with ``Retry-After``)."""
        return AdmissionRejected(
            f"request {self.request.id!r} for pipeline {self.request.pipeline!r} rejected "
            f"({self.reason}); retry after {self.retry_after:.3g}s",
            reason=self.reason, retry_after=self.retry_after, request_id=self.request.id)


@dataclass(frozen=True)
class AdmissionStatistics:
    """A snapshot of a policy's counters; ``queued`` and ``in_flight`` are current values."""

    policy: str
    admitted: int
    completed: int
    queued: int
    in_flight: int
    in_flight_cost: float
    mean_wait: float  # seconds from arrival to admission, over admitted requests
    rejected: dict[str, int] = field(default_factory=dict)  # by reason
    queue_depth: dict[str, int] = field(default_factory=dict)  # by pipeline
    admitted_cost: dict[str, float] = field(default_factory=dict)  # predicted seconds, by pipeline


@dataclass(slots=True)
class Pending:
    """A request with its predicted cost and deadline, while admission decides on it."""

    request: Request
    cost: float
    deadline: float
    seq: int
    rank: int = 1  # its priority class: the request's own, else its pipeline's


class AdmissionPolicy:
    """The shared interface and bookkeeping; subclasses decide, queue and dispatch.

    clock: returns the current time in seconds (``time.monotonic``; tests pass a virtual one).
    cost_model: predicts service seconds per request (default ``CostModel()``).
    slos: SLO per pipeline name; pipelines not listed get ``default_slo``.
    default_slo: the SLO of unlisted pipelines (default p99 60 s, standard, weight 1).
    on_reject: called with every ``Rejection``, at ``try_admit`` or at ``poll``.
    """

    name: ClassVar[str] = ""
    #: the policy orders by priority class and deadline; admitted requests then carry
    #: them into the engines (``AdmissionGate.urgency``); a policy that ignores them
    #: leaves the engines first come, first served too
    orders_by_urgency: ClassVar[bool] = False

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 cost_model: CostModel | None = None,
                 slos: Mapping[str, PipelineSLO] | None = None,
                 default_slo: PipelineSLO | None = None,
                 on_reject: Callable[[Rejection], None] | None = None) -> None:
        self.clock = clock
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.slos = dict(slos or {})
        for key, slo in self.slos.items():
            if not isinstance(slo, PipelineSLO):
                raise ValueError(f"slos[{key!r}] must be a PipelineSLO, got {slo!r}")
        self.default_slo = default_slo or PipelineSLO(p99_ms=60_000.0)
        self.on_reject = on_reject
        self.last_rejection: Rejection | None = None
        self._in_flight: dict[int, Ticket] = {}
        self._in_flight_cost = 0.0
        self._seq = itertools.count()
        self._admitted = self._completed = 0
        self._wait_sum = 0.0
        self._rejected: dict[str, int] = {}
        self._admitted_cost: dict[str, float] = {}

    def slo_for(self, pipeline: str) -> PipelineSLO:
        """The SLO that applies to the pipeline named ``pipeline``."""
        return self.slos.get(pipeline, self.default_slo)

    def _pending(self, request: Request) -> Pending:
        slo = self.slo_for(request.pipeline)
        deadline = (request.deadline if request.deadline is not None
                    else request.arrival + slo.p99_ms / 1000.0)
        rank = rank_of(request.priority) if request.priority is not None else slo.rank
        return Pending(request, self.cost_model.predict(request), deadline, next(self._seq),
                       rank)

    def decide(self, request: Request) -> Decision:
        """What ``try_admit`` would do with ``request`` now; changes nothing."""
        return self._decide(self._pending(request), self.clock())

    def try_admit(self, request: Request) -> Ticket | None:
        """Admit ``request`` now if capacity allows, else queue or reject it
        (``last_rejection``)."""
        now = self.clock()
        entry = self._pending(request)
        decision = self._decide(entry, now)
        if decision.verdict is Verdict.ADMIT:
            return self._admit(entry, now, immediate=True)
        if decision.verdict is Verdict.QUEUE:
            self._enqueue(entry, now)
        else:
            self._reject(request, decision.reason, decision.retry_after, now)
        return None

    def poll(self) -> list[Ticket]:
        """Admit waiting requests that now fit, in policy order; reject expired ones."""
        now = self.clock()
        tickets = []
        while (entry := self._next(now)) is not None:
            tickets.append(self._admit(entry, now, immediate=False))
        return tickets

    def release(self, ticket: Ticket, service_seconds: float | None = None) -> None:
        """Free the capacity of ``ticket`` (issued here, not released yet); a measured
        ``service_seconds`` (None: unknown) calibrates the cost model."""
        if self._in_flight.pop(ticket.seq, None) is None:
            raise ValueError(f"release: ticket for request {ticket.request.id!r} is not in "
                             f"flight here (released twice, or issued by another policy)")
        self._in_flight_cost = max(0.0, self._in_flight_cost - ticket.cost)
        self._completed += 1
        if service_seconds is not None:
            self.cost_model.observe(ticket.request, service_seconds)

    def statistics(self) -> AdmissionStatistics:
        """A frozen snapshot of the counters."""
        depth = self._queue_depths()
        return AdmissionStatistics(
            policy=self.name, admitted=self._admitted, completed=self._completed,
            queued=sum(depth.values()), in_flight=len(self._in_flight),
            in_flight_cost=self._in_flight_cost,
            mean_wait=self._wait_sum / self._admitted if self._admitted else 0.0,
            rejected=dict(self._rejected), queue_depth=depth,
            admitted_cost=dict(self._admitted_cost))

    # -- for subclasses ------------------------------------------------------------------

    def _decide(self, entry: Pending, now: float) -> Decision:
        raise NotImplementedError

    def _enqueue(self, entry: Pending, now: float) -> None:
        raise NotImplementedError(f"policy {self.name!r} never queues")

    def _next(self, now: float) -> Pending | None:
        """Dequeue the next request to admit, if it fits; reject expired ones on the way."""
        return None

    def _queue_depths(self) -> dict[str, int]:
        return {}

    def _charge(self, entry: Pending, immediate: bool) -> None:
        """Account an admission (fair-share bookkeeping); ``immediate`` means never queued."""

    def _admit(self, entry: Pending, now: float, *, immediate: bool) -> Ticket:
        self._charge(entry, immediate)
        ticket = Ticket(entry.request, now, entry.cost, entry.deadline, entry.seq)
        self._in_flight[entry.seq] = ticket
        self._in_flight_cost += entry.cost
        self._admitted += 1
        self._wait_sum += ticket.wait
        pipe = entry.request.pipeline
        self._admitted_cost[pipe] = self._admitted_cost.get(pipe, 0.0) + entry.cost
        return ticket

    def _reject(self, request: Request, reason: str, retry_after: float, now: float) -> None:
        rejection = Rejection(request, reason, max(retry_after, MIN_RETRY_AFTER), now)
        self._rejected[reason] = self._rejected.get(reason, 0) + 1
        self.last_rejection = rejection
        if self.on_reject is not None:
            self.on_reject(rejection)

    def _next_completion(self, now: float) -> float:
        """Predicted seconds until the first in-flight request finishes."""
        return min((max(0.0, t.admitted_at + t.cost - now) for t in self._in_flight.values()),
                   default=0.0)
