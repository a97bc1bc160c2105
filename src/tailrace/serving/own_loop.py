"""The event loop of a ``PipelineService`` started on a thread of its own, and its lock.

A lone query to such a service used to cross threads twice (the caller's loop wakes the
service's, which wakes the caller's back): on an idle VM each wake-up of a thread whose
vCPU has halted costs some 200 us, which made a query through four no-op maps take
~450 us. Spinning before sleeping would not remove that cost in Python: a thread that
waits for the GIL sleeps too (its vCPU halts), and a spinning thread that keeps taking
the GIL back starves the one it waits for.

So the service's loop holds a lock at all times except while it waits in ``select`` for
something to do. A caller thread that takes it without blocking has the whole run to
itself (no callback or task of the service's loop runs until it lets go) and may run a
lone record through an idle inline first stage on its own stack, as a caller on the
run's loop does (``PipelineService.submit``): no thread hand-off, no wake-up. The loop
pays one uncontended release and acquire per iteration; while a caller holds the lock,
a loop woken meanwhile waits for it (at most one inline step).
"""

from __future__ import annotations

import asyncio
import selectors
import threading
from typing import Any


class _HeldSelector(selectors.DefaultSelector):
    """The default selector, releasing ``lock`` only while it waits for events."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self._held = lock

    def select(self, timeout: float | None = None) -> Any:
        self._held.release()
        try:
            return super().select(timeout)
        finally:
            self._held.acquire()


def own_loop() -> tuple[asyncio.AbstractEventLoop, threading.Lock]:
    """A new event loop and its lock; the thread that runs the loop must hold the lock
    from before its first iteration to after its last."""
    lock = threading.Lock()
    return asyncio.SelectorEventLoop(_HeldSelector(lock)), lock
