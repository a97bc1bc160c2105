"""Dynamic batching of engine calls across requests and pipelines: a pure policy.

``Batcher`` holds items in arrival order and says when a batch is due: when
``max_batch_size`` items wait, when their predicted tokens fill ``max_batch_tokens``, or
when the oldest has waited ``max_wait_ms``. It reads no clock of its own (every call
takes ``now``), so tests drive it with a virtual clock. A batch never exceeds the size or
the token budget, except that an item larger than the budget goes alone rather than
stuck forever. Items given a priority class or deadline go most urgent first (class,
deadline, arrival), one class a batch (its answers come back together: an urgent item
must not wait for a less urgent one's); without them it is first come, first served.

    >>> b = Batcher(max_batch_size=2, max_wait_ms=5)
    >>> b.add("a", tokens=10, now=0.0); b.ready(now=0.001)
    False
    >>> b.add("b", tokens=10, now=0.002); b.take(now=0.002)
    ['a', 'b']
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatcherStatistics:
    """What a ``Batcher`` has done: batches formed, items batched, items waiting."""

    batches: int
    items: int
    queued: int
    queued_tokens: int

    @property
    def mean_batch_size(self) -> float:
        """Items per batch on average (0.0 before the first batch)."""
        return self.items / self.batches if self.batches else 0.0


class Batcher:
    """Groups items into batches by size, token budget and waiting time (FIFO).

    Not thread-safe: one owner (the pool's loop) calls it.
    """

    def __init__(self, max_batch_size: int = 8, max_wait_ms: float = 2.0,
                 max_batch_tokens: int | None = None):
        """Create an empty batcher.

        max_batch_size:   the most items in one batch (>= 1).
        max_wait_ms:      the longest the oldest item waits for others to join (>= 0);
                          0 sends whatever is waiting at once.
        max_batch_tokens: the most predicted tokens in one batch (None: no budget).
        """
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens!r}")
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_batch_tokens = max_batch_tokens
        self._items: deque[tuple[Any, int, float]] = deque()  # (item, tokens, arrival)
        self._ranks: dict[int, tuple[int, float]] = {}  # id(item) -> (-class, deadline),
        # for items given either (the others rank (0, inf): class 0, no deadline)
        self._tokens = 0
        self._batches = 0
        self._batched = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Any, tokens: int, now: float, priority: int = 0,
            deadline: float | None = None) -> None:
        """Queue ``item`` (``take`` returns it unchanged) behind the items already waiting;
        ``tokens``: its predicted tokens (prompt + max_tokens), counted against the budget;
        ``now``: its arrival time in seconds; ``priority``/``deadline``: its request's
        class (higher first) and deadline (earlier first within a class)."""
        tokens = max(int(tokens), 0)
        self._items.append((item, tokens, now))
        if priority or deadline is not None:
            self._ranks[id(item)] = (-priority, math.inf if deadline is None else deadline)
        self._tokens += tokens

    def next_deadline(self) -> float | None:
        """When the oldest waiting item must be sent (seconds); None if nothing waits."""
        if not self._items:
            return None
        return self._oldest() + self.max_wait_s

    def _oldest(self) -> float:
        """The oldest waiting item's arrival (ranked items may be out of arrival order)."""
        if self._ranks:
            return min(e[2] for e in self._items)
        return self._items[0][2]

    def ready(self, now: float) -> bool:
        """Whether a batch is due: full by size or tokens, or its oldest item waited enough."""
        if not self._items:
            return False
        if len(self._items) >= self.max_batch_size:
            return True
        if self.max_batch_tokens is not None and self._tokens >= self.max_batch_tokens:
            return True
        return now >= self._oldest() + self.max_wait_s

    def take(self, now: float) -> list[Any]:
        """The next batch: the oldest items, within the size and token budget ([] if none);
        ``now`` only mirrors ``ready`` (callers pass one clock reading to both)."""
        batch: list[Any] = []
        used = 0
        budget = self.max_batch_tokens
        ranks, plain = self._ranks, (0, math.inf)
        if ranks:  # the most urgent first (a stable sort: arrival order within)
            self._items = deque(sorted(self._items,
                                       key=lambda e: ranks.get(id(e[0]), plain)))
        ranked = bool(ranks)  # (taking an item drops its rank)
        cls = ranks.get(id(self._items[0][0]), plain)[0] if self._items else 0
        while self._items and len(batch) < self.max_batch_size:
            item, tokens, _ = self._items[0]
            if batch and budget is not None and used + tokens > budget:
                break
            if ranked and ranks.get(id(item), plain)[0] != cls:
                break  # one class a batch: its answers come back together, so an urgent
                # request batched with a less urgent one would wait for that one's end
            self._items.popleft()
            self._ranks.pop(id(item), None)
            batch.append(item)
            used += tokens
        self._tokens -= used
        if batch:
            self._batches += 1
            self._batched += len(batch)
        return batch

    def drain(self) -> list[Any]:
        """Remove and return every waiting item, oldest first (not counted as a batch)."""
        items = [item for item, _, _ in self._items]
        self._items.clear()
        self._ranks.clear()
        self._tokens = 0
        return items

    def statistics(self) -> BatcherStatistics:
        """Batches formed, items batched, and what is waiting now."""
        return BatcherStatistics(self._batches, self._batched, len(self._items), self._tokens)
