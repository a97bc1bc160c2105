"""The event loop of a ``PipelineService`` started on a thread of its own, and its lock.

The loop holds the lock at all times except while it waits in ``select``. A caller
thread that takes it without blocking has the whole run to itself and may run a lone
record through an idle inline first stage on its own stack (``PipelineService.submit``):
no thread hand-off and no wake-up of a halted vCPU (~200 us each on an idle VM;
spinning does not help in Python). The loop pays one uncontended release and acquire
per iteration. Measurements and alternatives: docs/design.md.
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
