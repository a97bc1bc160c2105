"""Admission policies behind one interface: ``simultaneous``, ``fcfs``, ``slo``; a registry.

- ``simultaneous`` admits everything at once: the baseline admission is measured against.
- ``fcfs`` admits up to a concurrency limit; the rest wait in arrival order in a bounded queue;
  a full queue rejects (``queue_full``) with the time until the next predicted completion.
- ``slo`` keeps one deadline-ordered queue per pipeline. Dispatch picks, among the pipelines
  within ``max_lead`` of the most-behind one in weighted virtual time (predicted seconds
  admitted / weight), the highest priority class, then the earliest deadline. Saturated
  pipelines therefore split capacity by weight whatever their class, an idle pipeline banks
  no credit, a higher class jumps the line only within its lead, and a lower class never
  starves. A request whose predicted queueing delay plus cost overshoots its deadline is
  rejected at once (``deadline_unmeetable``; retry after the overshoot); one that waited
  until it can no longer finish in time is rejected at dispatch (``deadline_expired``).
  A system with room admits at once, whatever the prediction.
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .admission import (
    DEADLINE_EXPIRED,
    DEADLINE_UNMEETABLE,
    MIN_RETRY_AFTER,
    QUEUE_FULL,
    AdmissionPolicy,
    Decision,
    Pending,
    Verdict,
)
from .slo import is_count as _is_count
from .slo import is_number as _is_number
from .slo import require

ADMIT = Decision(Verdict.ADMIT)
QUEUE = Decision(Verdict.QUEUE)


def _refuse(reason: str, retry_after: float) -> Decision:
    return Decision(Verdict.REJECT, reason, max(retry_after, MIN_RETRY_AFTER))


class SimultaneousPolicy(AdmissionPolicy):
    """Admit everything at once: the no-admission baseline. Options: the common ones."""

    name = "simultaneous"

    def _decide(self, entry: Pending, now: float) -> Decision:
        return ADMIT


class _Limited(AdmissionPolicy):
    """A budget of concurrent work: requests in flight and/or predicted seconds in flight.

    max_in_flight: most requests admitted at once; None means no count limit.
    max_cost: most predicted service seconds in flight; None means no limit (too big: runs alone).
    max_queue: most requests waiting (fcfs: in all, slo: per pipeline); 0 means never wait.
    common: clock, cost_model, slos, default_slo, on_reject (see ``AdmissionPolicy``).
    """

    def __init__(self, *, max_in_flight: int | None = 8, max_cost: float | None = None,
                 max_queue: int = 1024, **common: Any) -> None:
        super().__init__(**common)
        where = f"admission policy {self.name!r}"
        require(max_in_flight is None or _is_count(max_in_flight) and max_in_flight > 0, where,
                "max_in_flight", "a positive integer or None", max_in_flight)
        require(max_cost is None or _is_number(max_cost) and max_cost > 0, where, "max_cost",
                "a positive number of seconds or None", max_cost)
        if max_in_flight is None and max_cost is None:
            raise ValueError(f"{where}: set max_in_flight or max_cost "
                             f"(with neither, use 'simultaneous')")
        require(_is_count(max_queue), where, "max_queue", "a non-negative integer", max_queue)
        self.max_in_flight, self.max_cost, self.max_queue = max_in_flight, max_cost, max_queue

    def _fits(self, cost: float) -> bool:
        n = len(self._in_flight)
        if n == 0:
            return True  # a request bigger than the whole budget runs alone rather than never
        if self.max_in_flight is not None and n >= self.max_in_flight:
            return False
        return self.max_cost is None or self._in_flight_cost + cost <= self.max_cost * (1 + 1e-9)


class FCFSPolicy(_Limited):
    """First come, first served under a concurrency limit, with a bounded waiting line.

    options: max_in_flight, max_cost, max_queue (total) and the common ones (see ``_Limited``).
    """

    name = "fcfs"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._queue: deque[Pending] = deque()
        self._depth: dict[str, int] = {}

    def _decide(self, entry: Pending, now: float) -> Decision:
        if not self._queue and self._fits(entry.cost):
            return ADMIT
        if len(self._queue) >= self.max_queue:
            return _refuse(QUEUE_FULL, self._next_completion(now))
        return QUEUE

    def _enqueue(self, entry: Pending, now: float) -> None:
        self._queue.append(entry)
        pipe = entry.request.pipeline
        self._depth[pipe] = self._depth.get(pipe, 0) + 1

    def _next(self, now: float) -> Pending | None:
        if not self._queue or not self._fits(self._queue[0].cost):
            return None
        entry = self._queue.popleft()
        self._depth[entry.request.pipeline] -= 1
        return entry

    def _queue_depths(self) -> dict[str, int]:
        return {pipe: n for pipe, n in self._depth.items() if n}


@dataclass(slots=True)
class _Flow:
    """One pipeline's waiting requests (a deadline heap) and its fair-share account."""

    weight: float
    rank: int
    heap: list[tuple[float, int, Pending]] = field(default_factory=list)
    queued_cost: float = 0.0
    vtime: float = 0.0  # virtual time: predicted seconds admitted / weight
    last_deadline: float = -math.inf  # at least the latest deadline queued


class SLOPolicy(_Limited):
    """Deadline- and priority-ordered admission with weighted fair share and early rejection.

    max_lead: weighted seconds a pipeline may run ahead of its fair share for urgency's sake.
    reserve: lanes (of max_in_flight) that lower priority classes may not take while a higher
        class has sent requests within ``reserve_window`` seconds: headroom so an urgent
        request rarely waits for a long one to finish (there is no preemption).
    reserve_window: seconds a priority class counts as active after its last arrival.
    options: max_in_flight (required), max_cost, max_queue (per pipeline), the common ones.
    """

    name = "slo"

    def __init__(self, *, max_lead: float = 2.0, reserve: int = 0,
                 reserve_window: float = 10.0, **options: Any) -> None:
        super().__init__(**options)
        where = "admission policy 'slo'"
        if self.max_in_flight is None:
            raise ValueError(f"{where}: max_in_flight must be a positive integer (the "
                             "parallelism behind its queueing-delay prediction), got None")
        require(_is_number(max_lead) and max_lead >= 0, where, "max_lead",
                "a non-negative number of seconds", max_lead)
        self.max_lead = float(max_lead)
        require(_is_count(reserve) and reserve < self.max_in_flight, where, "reserve",
                f"a non-negative integer below max_in_flight ({self.max_in_flight})", reserve)
        require(_is_number(reserve_window) and reserve_window >= 0, where, "reserve_window",
                "a non-negative number of seconds", reserve_window)
        self.reserve, self.reserve_window = reserve, float(reserve_window)
        self._seen: dict[int, float] = {}  # priority rank -> time of its latest arrival
        self._lanes: int = self.max_in_flight
        self._flows: dict[str, _Flow] = {}
        self._waiting = 0
        self._vnow = 0.0  # virtual time of the latest admission

    def _flow(self, pipeline: str) -> _Flow:
        flow = self._flows.get(pipeline)
        if flow is None:
            slo = self.slo_for(pipeline)
            flow = self._flows[pipeline] = _Flow(slo.weight, slo.rank)
        return flow

    def _virtual_now(self) -> float:
        return min((f.vtime for f in self._flows.values() if f.heap), default=self._vnow)

    def _predicted_delay(self, flow: _Flow, cost: float, deadline: float, now: float) -> float:
        """Seconds before a request of ``cost`` and ``deadline`` in ``flow`` is predicted to start.

        It starts when a lane frees up (the earliest in-flight completion when all lanes are
        busy) and the work queued ahead of it has drained over the lanes: its flow's
        earlier-deadline requests, plus, from each other backlogged flow of the same or a
        higher priority class, its weight's share of that (capped by its queue). Lower
        classes wait behind it (within ``max_lead``), so they do not delay it.
        """
        ahead = flow.queued_cost
        if flow.heap and deadline < flow.last_deadline:  # EDF: only earlier deadlines go first
            ahead = sum(e.cost for d, _, e in flow.heap if d <= deadline)
        mine = ahead + cost
        for other in self._flows.values():
            if other is not flow and other.heap and other.rank >= flow.rank:
                ahead += min(other.queued_cost, mine * other.weight / flow.weight)
        busy = len(self._in_flight) >= self._lanes
        first_free = self._next_completion(now) if busy else 0.0
        return first_free + ahead / self._lanes

    def _room(self, flow: _Flow, cost: float, now: float) -> bool:
        """Capacity for ``flow`` now, keeping ``reserve`` lanes for active higher classes."""
        if not self._fits(cost):
            return False
        if self.reserve and len(self._in_flight) >= self._lanes - self.reserve:
            active = (r for r, t in self._seen.items() if now - t <= self.reserve_window)
            return flow.rank >= max(active, default=flow.rank)
        return True

    def _decide(self, entry: Pending, now: float) -> Decision:
        flow = self._flow(entry.request.pipeline)
        self._seen[flow.rank] = max(self._seen.get(flow.rank, now), now)
        ahead = any(f.heap for f in self._flows.values() if f.rank >= flow.rank)
        if not ahead and self._room(flow, entry.cost, now):
            # nothing of its class or above waits (lower classes wait behind it anyway);
            # never reject on a system with room: predictions are only predictions
            return ADMIT
        if len(flow.heap) >= self.max_queue:
            weights = sum(f.weight for f in self._flows.values() if f.heap or f is flow)
            return _refuse(QUEUE_FULL, self._next_completion(now) * weights / flow.weight)
        delay = self._predicted_delay(flow, entry.cost, entry.deadline, now)
        finish = now + delay + entry.cost
        if finish > entry.deadline:  # a retry that late meets its fresh default deadline
            return _refuse(DEADLINE_UNMEETABLE, finish - entry.deadline)
        return QUEUE

    def _enqueue(self, entry: Pending, now: float) -> None:
        flow = self._flow(entry.request.pipeline)
        if not flow.heap:  # newly backlogged: no credit for the time it was idle
            flow.vtime = max(flow.vtime, self._virtual_now())
        heapq.heappush(flow.heap, (entry.deadline, entry.seq, entry))
        flow.last_deadline = max(flow.last_deadline, entry.deadline)
        flow.queued_cost += entry.cost
        self._waiting += 1

    def _pop(self, flow: _Flow) -> Pending:
        entry = heapq.heappop(flow.heap)[2]
        flow.queued_cost = flow.queued_cost - entry.cost if flow.heap else 0.0
        flow.last_deadline = flow.last_deadline if flow.heap else -math.inf
        self._waiting -= 1
        return entry

    def _expire(self, now: float) -> None:
        """Reject queued requests that can no longer finish by their deadline (heads first)."""
        for flow in list(self._flows.values()):
            while flow.heap and now + flow.heap[0][2].cost > flow.heap[0][0]:
                entry = self._pop(flow)  # retry when a fresh one is predicted to make it
                budget = self.slo_for(entry.request.pipeline).p99_ms / 1000.0
                finish = self._predicted_delay(flow, entry.cost, math.inf, now) + entry.cost
                self._reject(entry.request, DEADLINE_EXPIRED, finish - budget, now)

    def _next(self, now: float) -> Pending | None:
        if not self._waiting:
            return None
        self._expire(now)
        backlogged = [f for f in self._flows.values() if f.heap]
        if not backlogged:
            return None
        horizon = min(f.vtime for f in backlogged) + self.max_lead
        flow = min((f for f in backlogged if f.vtime <= horizon),
                   key=lambda f: (-f.rank, f.heap[0][0], f.vtime))
        if not self._room(flow, flow.heap[0][2].cost, now):
            return None  # the policy's pick waits for room; nothing overtakes it
        return self._pop(flow)

    def _charge(self, entry: Pending, immediate: bool) -> None:
        flow = self._flow(entry.request.pipeline)
        if immediate:
            flow.vtime = max(flow.vtime, self._virtual_now())
        self._vnow = max(self._vnow, flow.vtime)
        flow.vtime += max(entry.cost, 1e-9) / flow.weight

    def _queue_depths(self) -> dict[str, int]:
        return {pipe: len(f.heap) for pipe, f in self._flows.items() if f.heap}


POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (SimultaneousPolicy, FCFSPolicy, SLOPolicy)}


def register_policy(cls: type[AdmissionPolicy]) -> type[AdmissionPolicy]:
    """Add an ``AdmissionPolicy`` subclass to the registry under its (non-empty) ``name``;
    usable as a decorator."""
    if not cls.name:
        raise ValueError(f"register_policy: {cls.__name__} needs a non-empty 'name'")
    POLICIES[cls.name] = cls
    return cls


def policy_options(name: str) -> list[str]:
    """The keyword options the policy registered as ``name`` takes."""
    names: set[str] = set()
    for klass in _lookup(name).__mro__:
        if "__init__" in klass.__dict__ and klass is not object:
            params = inspect.signature(klass.__dict__["__init__"]).parameters.values()
            names |= {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    return sorted(names)


def _lookup(name: str) -> type[AdmissionPolicy]:
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r}; "
                         f"known policies: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]


def make_policy(name: str, **config: Any) -> AdmissionPolicy:
    """Build an admission policy by registry name; unknown names and options raise ValueError.

    name: "simultaneous", "fcfs", "slo" or a registered name.
    config: the policy's keyword options (``policy_options(name)`` lists them).
    """
    cls = _lookup(name)
    known = policy_options(name)
    for key in config:
        if key not in known:
            raise ValueError(f"admission policy {name!r} has no option {key!r}; "
                             f"its options: {', '.join(known)}")
    return cls(**config)
