"""Admission policies behind one interface: ``simultaneous``, ``fcfs``, ``slo``; a registry.

docs/control.md has the table of what each admits, queues and rejects. Under ``slo``,
dispatch picks, among the pipelines within ``max_lead`` of the most-behind one in
weighted virtual time (predicted seconds admitted / weight), the highest class waiting,
then the earliest deadline: saturated pipelines split capacity by weight whatever their
class, an idle pipeline banks no credit, and a lower class never starves. A system with
room admits at once, whatever the prediction.
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
from .slo import is_count, is_number, require

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
        require(max_in_flight is None or is_count(max_in_flight) and max_in_flight > 0, where,
                "max_in_flight", "a positive integer or None", max_in_flight)
        require(max_cost is None or is_number(max_cost) and max_cost > 0, where, "max_cost",
                "a positive number of seconds or None", max_cost)
        if max_in_flight is None and max_cost is None:
            raise ValueError(f"{where}: set max_in_flight or max_cost "
                             f"(with neither, use 'simultaneous')")
        require(is_count(max_queue), where, "max_queue", "a non-negative integer", max_queue)
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
class _Band:
    """The waiting requests of one priority class in one pipeline: a deadline heap."""

    heap: list[tuple[float, int, Pending]] = field(default_factory=list)
    cost: float = 0.0  # predicted seconds queued
    last_deadline: float = -math.inf  # at least the latest deadline queued


@dataclass(slots=True)
class _Flow:
    """One pipeline's waiting requests (a band per priority class) and its fair-share
    account. Requests take their pipeline's class unless they chose their own."""

    weight: float
    bands: dict[int, _Band] = field(default_factory=dict)  # rank -> band; none empty
    top: int = 0  # the highest rank with a band (while any waits)
    waiting: int = 0
    queued_cost: float = 0.0
    vtime: float = 0.0  # virtual time: predicted seconds admitted / weight

    def cost_from(self, rank: int) -> float:
        """Predicted seconds queued in classes ``rank`` and above."""
        if len(self.bands) == 1:
            return self.queued_cost if self.top >= rank else 0.0
        return sum(b.cost for r, b in self.bands.items() if r >= rank)


class SLOPolicy(_Limited):
    """Deadline- and priority-ordered admission with weighted fair share and early rejection.

    A request's class is its own (``Request.priority``) or else its pipeline's SLO class.
    Within a pipeline, a higher class goes first, then the earliest deadline; across
    pipelines, each pipeline competes with the class of its best waiting request.

    max_lead: weighted seconds a pipeline may run ahead of its fair share for urgency's sake.
    reserve: lanes (of max_in_flight) that lower priority classes may not take while a higher
        class has sent requests within ``reserve_window`` seconds: headroom so an urgent
        request rarely waits for a long one to finish (there is no preemption).
    reserve_window: seconds a priority class counts as active after its last arrival.
    overflow: lanes beyond max_in_flight that only the most urgent active class may take,
        and only while a less urgent request is in flight: for an engine that preempts the
        less urgent sequence, so no lane idles in advance as ``reserve`` lanes do
        (docs/control.md, "Reserve or overflow lanes").
    options: max_in_flight (required), max_cost, max_queue (per pipeline), the common ones.
    """

    name = "slo"
    orders_by_urgency = True

    def __init__(self, *, max_lead: float = 2.0, reserve: int = 0,
                 reserve_window: float = 10.0, overflow: int = 0, **options: Any) -> None:
        super().__init__(**options)
        where = "admission policy 'slo'"
        if self.max_in_flight is None:
            raise ValueError(f"{where}: max_in_flight must be a positive integer (the "
                             "parallelism behind its queueing-delay prediction), got None")
        require(is_number(max_lead) and max_lead >= 0, where, "max_lead",
                "a non-negative number of seconds", max_lead)
        self.max_lead = float(max_lead)
        require(is_count(reserve) and reserve < self.max_in_flight, where, "reserve",
                f"a non-negative integer below max_in_flight ({self.max_in_flight})", reserve)
        require(is_number(reserve_window) and reserve_window >= 0, where, "reserve_window",
                "a non-negative number of seconds", reserve_window)
        self.reserve, self.reserve_window = reserve, float(reserve_window)
        require(is_count(overflow), where, "overflow", "a non-negative integer", overflow)
        self.overflow = overflow
        self._ranks: dict[int, int] = {}  # in flight: ticket seq -> its class
        self._seen: dict[int, float] = {}  # priority rank -> time of its latest arrival
        self._lanes: int = self.max_in_flight
        self._flows: dict[str, _Flow] = {}
        self._waiting = 0
        self._vnow = 0.0  # virtual time of the latest admission

    def _flow(self, pipeline: str) -> _Flow:
        flow = self._flows.get(pipeline)
        if flow is None:
            flow = self._flows[pipeline] = _Flow(self.slo_for(pipeline).weight)
        return flow

    def _virtual_now(self) -> float:
        return min((f.vtime for f in self._flows.values() if f.waiting), default=self._vnow)

    def _predicted_delay(self, flow: _Flow, rank: int, cost: float, deadline: float,
                         now: float) -> float:
        """Seconds before a request of class ``rank``, ``cost`` and ``deadline`` in ``flow``
        is predicted to start: when a lane frees up and the work queued ahead of it (its
        flow's higher classes and earlier deadlines, plus each other backlogged flow's
        weighted share of its same or higher classes) has drained over the lanes."""
        ahead = 0.0
        band = flow.bands.get(rank)
        if band is not None:
            ahead = band.cost
            if deadline < band.last_deadline:  # EDF: only earlier deadlines go first
                ahead = sum(e.cost for d, _, e in band.heap if d <= deadline)
        if flow.top > rank:
            ahead += flow.cost_from(rank + 1)
        mine = ahead + cost
        for other in self._flows.values():
            if other is not flow and other.waiting and other.top >= rank:
                ahead += min(other.cost_from(rank), mine * other.weight / flow.weight)
        busy = len(self._in_flight) >= self._lanes
        first_free = self._next_completion(now) if busy else 0.0
        return first_free + ahead / self._lanes

    def _top_active(self, rank: int, now: float) -> bool:
        """Whether no class above ``rank`` has sent requests within ``reserve_window``."""
        active = (r for r, t in self._seen.items() if now - t <= self.reserve_window)
        return rank >= max(active, default=rank)

    def _room(self, rank: int, cost: float, now: float) -> bool:
        """Capacity for a request of class ``rank`` now, keeping ``reserve`` lanes for
        active higher classes; else an ``overflow`` lane, if it may take one."""
        if not self._fits(cost):
            return (len(self._in_flight) < self._lanes + self.overflow
                    and (self.max_cost is None
                         or self._in_flight_cost + cost <= self.max_cost * (1 + 1e-9))
                    and self._top_active(rank, now)
                    and any(r < rank for r in self._ranks.values()))
        if self.reserve and len(self._in_flight) >= self._lanes - self.reserve:
            return self._top_active(rank, now)
        return True

    def _decide(self, entry: Pending, now: float) -> Decision:
        flow = self._flow(entry.request.pipeline)
        rank = entry.rank
        self._seen[rank] = max(self._seen.get(rank, now), now)
        ahead = any(f.top >= rank for f in self._flows.values() if f.waiting)
        if not ahead and self._room(rank, entry.cost, now):
            # nothing of its class or above waits (lower classes wait behind it anyway);
            # never reject on a system with room: predictions are only predictions
            return ADMIT
        if flow.waiting >= self.max_queue:
            weights = sum(f.weight for f in self._flows.values() if f.waiting or f is flow)
            return _refuse(QUEUE_FULL, self._next_completion(now) * weights / flow.weight)
        delay = self._predicted_delay(flow, rank, entry.cost, entry.deadline, now)
        finish = now + delay + entry.cost
        if finish > entry.deadline:  # a retry that late meets its fresh default deadline
            return _refuse(DEADLINE_UNMEETABLE, finish - entry.deadline)
        return QUEUE

    def _enqueue(self, entry: Pending, now: float) -> None:
        flow = self._flow(entry.request.pipeline)
        if not flow.waiting:  # newly backlogged: no credit for the time it was idle
            flow.vtime = max(flow.vtime, self._virtual_now())
            flow.top = entry.rank
        band = flow.bands.get(entry.rank)
        if band is None:
            band = flow.bands[entry.rank] = _Band()
            flow.top = max(flow.top, entry.rank)
        heapq.heappush(band.heap, (entry.deadline, entry.seq, entry))
        band.last_deadline = max(band.last_deadline, entry.deadline)
        band.cost += entry.cost
        flow.queued_cost += entry.cost
        flow.waiting += 1
        self._waiting += 1

    def _pop(self, flow: _Flow, rank: int) -> Pending:
        band = flow.bands[rank]
        entry = heapq.heappop(band.heap)[2]
        band.cost -= entry.cost
        flow.waiting -= 1
        flow.queued_cost = flow.queued_cost - entry.cost if flow.waiting else 0.0
        if not band.heap:
            del flow.bands[rank]
            if rank == flow.top and flow.bands:
                flow.top = max(flow.bands)
        self._waiting -= 1
        return entry

    def _expire(self, now: float) -> None:
        """Reject queued requests that can no longer finish by their deadline (each
        band's heads first)."""
        for flow in list(self._flows.values()):
            if not flow.waiting:
                continue
            for rank, band in list(flow.bands.items()):
                while band.heap and now + band.heap[0][2].cost > band.heap[0][0]:
                    entry = self._pop(flow, rank)  # retry when a fresh one would make it
                    budget = entry.deadline - entry.request.arrival
                    finish = self._predicted_delay(flow, rank, entry.cost, math.inf,
                                                   now) + entry.cost
                    self._reject(entry.request, DEADLINE_EXPIRED, finish - budget, now)

    def _next(self, now: float) -> Pending | None:
        if not self._waiting:
            return None
        self._expire(now)
        backlogged = [f for f in self._flows.values() if f.waiting]
        if not backlogged:
            return None
        horizon = min(f.vtime for f in backlogged) + self.max_lead
        flow = min((f for f in backlogged if f.vtime <= horizon),
                   key=lambda f: (-f.top, f.bands[f.top].heap[0][0], f.vtime))
        head = flow.bands[flow.top].heap[0][2]
        if not self._room(flow.top, head.cost, now):
            return None  # the policy's pick waits for room; nothing overtakes it
        return self._pop(flow, flow.top)

    def release(self, ticket: Any, service_seconds: float | None = None) -> None:
        super().release(ticket, service_seconds)
        self._ranks.pop(ticket.seq, None)

    def _charge(self, entry: Pending, immediate: bool) -> None:
        self._ranks[entry.seq] = entry.rank
        flow = self._flow(entry.request.pipeline)
        if immediate:
            flow.vtime = max(flow.vtime, self._virtual_now())
        self._vnow = max(self._vnow, flow.vtime)
        flow.vtime += max(entry.cost, 1e-9) / flow.weight

    def _queue_depths(self) -> dict[str, int]:
        return {pipe: f.waiting for pipe, f in self._flows.items() if f.waiting}


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
