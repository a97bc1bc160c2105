"""Dispatch policies: which replica of an engine pool gets the next batch.

A policy is a small object with ``choose(loads, cost) -> replica id | None``; it reads a
snapshot of each replica's load (``ReplicaLoad``) and never touches the replicas itself,
so it is unit-tested with plain lists. ``None`` means every replica is down or full: the
pool keeps the batch until one frees up.

    >>> loads = [ReplicaLoad(0, outstanding_work=900, in_flight=1, max_concurrency=2),
    ...          ReplicaLoad(1, outstanding_work=100, in_flight=1, max_concurrency=2)]
    >>> make_dispatch("least_work").choose(loads, cost=50)
    1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ReplicaLoad:
    """What a dispatch policy sees of one replica.

    max_work: the most outstanding tokens it holds (memory / sequence limit); None for no
    limit. An idle replica takes any call, so a call larger than the limit still runs
    (alone) instead of waiting forever.
    """

    id: int  # the replica's id in its pool
    healthy: bool = True  # the replica is up and accepts work
    outstanding_work: int = 0  # predicted tokens (prompt + max_tokens) of the calls it runs
    in_flight: int = 0  # engine calls (batches) sent to it and not yet answered
    max_concurrency: int = 1  # the most engine calls it runs at once
    max_work: int | None = None

    def can_take(self, cost: int) -> bool:
        """Whether a call of ``cost`` predicted tokens may be sent to it now."""
        if not self.healthy or self.in_flight >= self.max_concurrency:
            return False
        return (self.max_work is None or self.in_flight == 0
                or self.outstanding_work + cost <= self.max_work)


class DispatchPolicy(Protocol):
    """Chooses a replica for a call of ``cost`` predicted tokens, or None if none can take it."""

    name: str

    def choose(self, loads: Sequence[ReplicaLoad], cost: int) -> int | None: ...


class LeastOutstandingWork:
    """The replica with the least predicted outstanding tokens that can take the call.

    Ties go to the replica with fewer calls in flight, then the lower id. Counting tokens
    rather than calls keeps one replica from collecting all the long generations when
    request sizes are skewed.

    >>> LeastOutstandingWork().choose([ReplicaLoad(0, outstanding_work=5),
    ...                                ReplicaLoad(1, healthy=False)], cost=1)
    0
    """

    name = "least_work"

    def choose(self, loads: Sequence[ReplicaLoad], cost: int) -> int | None:
        """The id of the least-loaded replica that can take ``cost``; None if none can."""
        best: ReplicaLoad | None = None
        for load in loads:
            if not load.can_take(cost):
                continue
            if best is None or ((load.outstanding_work, load.in_flight, load.id)
                                < (best.outstanding_work, best.in_flight, best.id)):
                best = load
        return None if best is None else best.id


class RoundRobin:
    """Replicas in turn, skipping those that are down or full (for comparison).

    >>> rr = RoundRobin()
    >>> loads = [ReplicaLoad(0), ReplicaLoad(1, healthy=False), ReplicaLoad(2)]
    >>> [rr.choose(loads, 1) for _ in range(3)]
    [0, 2, 0]
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, loads: Sequence[ReplicaLoad], cost: int) -> int | None:
        """The next replica in turn (``loads`` in a stable order) that can take ``cost``;
        None if none can."""
        n = len(loads)
        for step in range(n):
            load = loads[(self._next + step) % n]
            if load.can_take(cost):
                self._next = (self._next + step + 1) % n
                return load.id
        return None


#: policy name -> class; ``make_dispatch`` creates a fresh instance (policies keep state)
DISPATCH: dict[str, type[LeastOutstandingWork] | type[RoundRobin]] = {
    LeastOutstandingWork.name: LeastOutstandingWork,
    RoundRobin.name: RoundRobin,
}


def make_dispatch(name: str) -> DispatchPolicy:
    """A new dispatch policy by name: one of ``DISPATCH`` (``least_work``, ``round_robin``).

    >>> make_dispatch("fastest")
    Traceback (most recent call last):
    ...
    ValueError: unknown dispatch policy 'fastest'; known: least_work, round_robin
    """
    cls = DISPATCH.get(name)
    if cls is None:
        raise ValueError(f"unknown dispatch policy {name!r}; known: "
                         f"{', '.join(sorted(DISPATCH))}")
    return cls()
