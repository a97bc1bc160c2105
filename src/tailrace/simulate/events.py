"""The virtual clock: a heap of timed callbacks, run in time order.

``now()`` is what every real policy the simulator drives reads as its clock (admission
policies, the engine pool, the batcher), so nothing in them knows it is simulated.

    >>> loop = Loop(); seen = []
    >>> loop.after(2.0, seen.append, "b"); loop.after(1.0, seen.append, "a")
    >>> loop.run(); seen, loop.now()
    (['a', 'b'], 2.0)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Loop:
    """Timed callbacks in time order (ties: in the order they were scheduled)."""

    __slots__ = ("_t", "_heap", "_seq", "events")

    def __init__(self) -> None:
        self._t = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0  # callbacks run so far

    def now(self) -> float:
        """Virtual seconds since the simulation began."""
        return self._t

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (now, if ``t`` is in the past)."""
        heapq.heappush(self._heap, (t if t > self._t else self._t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` ``dt`` virtual seconds from now."""
        self.at(self._t + dt, fn, *args)

    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Run callbacks in time order until none is left, the next is after ``until``
        or ``stop()`` is true (checked after each)."""
        heap, pop = self._heap, heapq.heappop
        while heap:
            t, _, fn, args = heap[0]
            if until is not None and t > until:
                self._t = until
                return
            pop(heap)
            self._t = t
            fn(*args)
            self.events += 1
            if stop is not None and stop():
                return
