"""Bounded channels that move records between stages in micro-batches.

A ``Channel`` lives in one event loop. Its ``bound`` is the most records it buffers:
``put`` waits while adding a micro-batch would exceed it, so a full channel blocks
its producer and memory stays bounded however fast the source is (docs/design.md).
Consumers never wait for a batch to fill: ``get`` returns whatever is buffered (up
to ``max_n`` records) as soon as anything is. Blocking calls have ``*_nowait`` twins.
"""

from __future__ import annotations

import asyncio
from collections import deque
from time import perf_counter


class Channel:
    """Bounded FIFO of records, handed over as lists; closes when its producers do.

    bound:     most records buffered (>= 1).
    producers: how many upstream edges feed it; the channel ends when all ``close``.
    """

    __slots__ = ("bound", "depth", "max_depth", "_q", "_getters", "_putters", "_producers",
                 "_loop")

    def __init__(self, bound: int, producers: int = 1) -> None:
        if bound < 1:
            raise ValueError(f"channel bound must be >= 1, got {bound}")
        self.bound = bound
        self.depth = 0
        self.max_depth = 0
        self._q: deque = deque()  # (enqueue time, born time, records)
        self._getters: deque = deque()
        self._putters: deque = deque()  # (future, records to put), in arrival order
        self._producers = producers
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def closed(self) -> bool:
        """True once every producer has closed (buffered records may remain)."""
        return self._producers <= 0

    def put_nowait(self, records: list, born: float) -> bool:
        """Buffer ``records`` if they fit under the bound; False if not (``put`` waits,
        and splits lists longer than the bound)."""
        n = len(records)
        depth = self.depth
        if depth + n > self.bound:
            return False
        self._q.append((perf_counter(), born, records))
        depth += n
        self.depth = depth
        if depth > self.max_depth:
            self.max_depth = depth
        getters = self._getters
        while getters:
            fut = getters.popleft()
            if not fut.done():
                fut.set_result(None)
                break
        return True

    async def put(self, records: list, born: float) -> None:
        """Buffer ``records``, waiting for room; lists longer than ``bound`` are split."""
        bound = self.bound
        if len(records) > bound:
            for i in range(0, len(records), bound):
                await self.put(records[i:i + bound], born)
            return
        while not self.put_nowait(records, born):
            fut = self._future()
            self._putters.append((fut, len(records)))
            try:
                await fut
            except asyncio.CancelledError:
                if self._putters and self.depth < self.bound:
                    self._wake_putters()  # pass on a wake-up this producer took
                raise

    def get_nowait(self, max_n: int) -> tuple[float, float, list] | None:
        """Up to ``max_n`` buffered records as ``(enqueued, born, records)``, or None."""
        q = self._q
        if not q:
            return None
        enq, born, recs = q[0]
        if len(recs) > max_n:
            taken = recs[:max_n]
            q[0] = (enq, born, recs[max_n:])
        else:
            q.popleft()
            taken = recs
            if q and len(taken) + len(q[0][2]) <= max_n:
                taken = list(taken)  # lists may be shared (fan-out): never mutate in place
                while q and len(taken) + len(q[0][2]) <= max_n:
                    _, b2, r2 = q.popleft()
                    taken.extend(r2)
                    if b2 < born:
                        born = b2
        self.depth -= len(taken)
        if self._putters:
            self._wake_putters()
        return enq, born, taken

    def _wake_putters(self) -> None:
        """Wake waiting producers in order, only as many as now fit (a woken producer
        that still finds no room waits again; nobody is woken just to fail)."""
        putters = self._putters
        room = self.bound - self.depth
        while putters:
            fut, n = putters[0]
            if fut.done():  # its producer gave up
                putters.popleft()
                continue
            if n > room:
                return
            putters.popleft()
            fut.set_result(None)
            room -= n

    async def get(self, max_n: int) -> tuple[float, float, list] | None:
        """Wait for records; None once the channel is closed and drained."""
        while True:
            item = self.get_nowait(max_n)
            if item is not None:
                return item
            if self._producers <= 0:
                return None
            fut = self._future()
            self._getters.append(fut)
            await fut

    async def wait_readable(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for records or the close (for batch windows)."""
        if self._q or self._producers <= 0 or timeout <= 0:
            return
        fut = self._future()
        self._getters.append(fut)
        handle = fut.get_loop().call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            handle.cancel()

    def close(self) -> None:
        """One producer is done; when all are, waiting consumers see the end."""
        self._producers -= 1
        if self._producers <= 0:
            while self._getters:
                fut = self._getters.popleft()
                if not fut.done():
                    fut.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Waiting consumers raise ``exc`` (a runtime failure met outside them ends the
        stage as if they had met it). Safe from another thread that has the loop to
        itself (a caller that borrowed an idle run)."""
        while self._getters:
            fut = self._getters.popleft()
            fut.get_loop().call_soon_threadsafe(_raise_in, fut, exc)

    def _future(self) -> asyncio.Future:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.create_future()


def _raise_in(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
