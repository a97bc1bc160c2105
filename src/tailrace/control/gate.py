"""The admission gate: a thread-safe, awaitable door in front of an admission policy.

Every pipeline run in the process (each on its own loop or thread) enters through the
same gate, so one policy sees all the contention: ``admit(pipeline, record)`` turns a
record into a ``Request`` (its urgency from the record's ``Request.asked``) and waits
while the policy queues it, raising ``AdmissionRejected`` when it rejects it;
``done(ticket)`` when the record leaves. A background thread polls the policy so queued
requests whose deadline can no longer be met are rejected on time, not when capacity
frees up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engines.tokens import CHARS_PER_TOKEN, approx_tokens
from ..request import request_of
from .admission import AdmissionPolicy, AdmissionRejected, Rejection, Request, Ticket
from .slo import rank_of


def approx_prompt_tokens(record: Any) -> int:
    """Predicted prompt tokens of a record: its text fields at ~4 characters a token."""
    if isinstance(record, dict):
        return sum(len(v) for k, v in record.items()
                   if isinstance(v, str) and not k.startswith("_")) // CHARS_PER_TOKEN + 1
    return approx_tokens(str(record))


class AdmissionGate:
    """Shared admission for every pipeline in the process.

    policy:        an admission policy (``make_policy("slo", ...)``); the gate owns it.
    max_tokens:    pipeline name -> predicted output tokens per request (default 64).
    prompt_tokens: record -> predicted prompt tokens.
    poll_s:        how often queued requests are re-examined while any wait.
    """

    def __init__(self, policy: AdmissionPolicy, *, max_tokens: dict[str, int] | None = None,
                 prompt_tokens: Callable[[Any], int] = approx_prompt_tokens,
                 poll_s: float = 0.005) -> None:
        self.policy = policy
        self.max_tokens = dict(max_tokens or {})
        self.prompt_tokens = prompt_tokens
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._abandoned: set[str] = set()  # queued requests whose caller gave up
        self._wake = threading.Event()
        self._closed = False
        self._poller: threading.Thread | None = None
        policy.on_reject = self._rejected
        self._clock = getattr(policy, "clock", time.monotonic)

    # -- runtime protocol ------------------------------------------------------------
    async def admit(self, pipeline: str, record: Any) -> Ticket:
        """Wait until the policy admits ``record``; raises ``AdmissionRejected``. The
        urgency its request asked for (``Request.asked``: ``{"priority": CLASS,
        "deadline_ms": MS}``) replaces its pipeline SLO's class and deadline."""
        arrival = self._clock()
        asked = request_of(record)
        urgency = (asked.asked if asked is not None else None) or {}
        ms = urgency.get("deadline_ms")
        req = Request(f"{pipeline}-{next(self._ids)}", pipeline, arrival=arrival,
                      prompt_tokens=self.prompt_tokens(record),
                      max_tokens=self.max_tokens.get(pipeline, 64),
                      deadline=arrival + ms / 1000.0 if ms is not None else None,
                      priority=urgency.get("priority"))
        loop = asyncio.get_running_loop()
        with self._lock:
            ticket = self.policy.try_admit(req)
            if ticket is not None:
                return ticket
            rej = self.policy.last_rejection
            if rej is not None and rej.request.id == req.id:
                raise rej.error()
            fut = loop.create_future()
            self._waiters[req.id] = (loop, fut)
            self._ensure_poller()
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            # the caller gave up while it waited: a ticket admitted meanwhile (its
            # delivery finds the future cancelled) is released there; one still queued
            # is released the moment the policy admits it
            with self._lock:
                if self._waiters.pop(req.id, None) is not None:
                    self._abandoned.add(req.id)
                elif fut.done() and not fut.cancelled():
                    # delivered, but the cancellation reached this task first
                    self._give_back(fut.result())
            raise

    def urgency(self, ticket: Ticket) -> tuple[int, float] | None:
        """``(class, deadline)`` of an admitted request for the engines it calls: its
        own priority class or its pipeline's (as an int, higher is more urgent) and its
        deadline in wall-clock seconds (``time.time()``: engines may run elsewhere);
        None under a policy that ignores both (``orders_by_urgency``)."""
        if not self.policy.orders_by_urgency:
            return None
        req = ticket.request
        rank = (rank_of(req.priority) if req.priority is not None
                else self.policy.slo_for(req.pipeline).rank)
        return rank, time.time() + (ticket.deadline - self._clock())

    def done(self, ticket: Ticket, service_seconds: float | None = None) -> None:
        """The work ``admit`` let in left the pipeline: free its capacity, admit who fits.
        ``service_seconds`` (default: since admission) calibrates the policy's cost model."""
        if service_seconds is None:
            service_seconds = max(0.0, self._clock() - ticket.admitted_at)
        with self._lock:
            self._give_back(ticket, service_seconds)

    # -- internals ---------------------------------------------------------------------
    def _give_back(self, ticket: Ticket, service_seconds: float | None = None) -> None:
        """Under our lock: free a ticket's capacity and admit whoever now fits."""
        self.policy.release(ticket, service_seconds)
        self._resolve(self.policy.poll())

    def _resolve(self, tickets: list[Ticket]) -> None:  # under our lock
        while tickets:
            freed = False
            for t in tickets:
                rid = t.request.id
                waiter = self._waiters.pop(rid, None)
                if waiter is not None:
                    loop, fut = waiter
                    try:
                        loop.call_soon_threadsafe(self._deliver, fut, t)
                        continue
                    except RuntimeError:  # the waiter's loop is closed: nobody takes it
                        pass
                elif rid in self._abandoned:  # its caller left while it was queued
                    self._abandoned.discard(rid)
                else:
                    continue
                self.policy.release(t)
                freed = True
            # capacity a departed caller freed goes to whoever waits next
            tickets = self.policy.poll() if freed else []

    def _deliver(self, fut: asyncio.Future, ticket: Ticket) -> None:
        """On the waiter's loop: hand the ticket over, or give it back if the caller
        cancelled in between (so an admitted ticket is never lost)."""
        if fut.done():
            with self._lock:  # no service time to learn from
                self._give_back(ticket)
        else:
            fut.set_result(ticket)

    def _rejected(self, rej: Rejection) -> None:  # called by the policy under our lock
        rid = rej.request.id
        self._abandoned.discard(rid)
        waiter = self._waiters.pop(rid, None)
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):  # the waiter's loop is closed
                loop.call_soon_threadsafe(settle, fut, None, rej.error())

    def _ensure_poller(self) -> None:
        if self._poller is None or not self._poller.is_alive():
            self._poller = threading.Thread(target=self._poll_loop, name="tailrace-admission",
                                            daemon=True)
            self._poller.start()

    def _poll_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.poll_s)
            self._wake.clear()
            with self._lock:
                if self._waiters:
                    self._resolve(self.policy.poll())
                elif not self._closed:
                    self._poller = None
                    return

    def close(self) -> None:
        """Stop polling; waiting requests are rejected."""
        self._closed = True
        self._wake.set()
        with self._lock:
            for rid, (loop, fut) in list(self._waiters.items()):
                with contextlib.suppress(RuntimeError):  # that run's loop already ended
                    loop.call_soon_threadsafe(settle, fut, None, AdmissionRejected(
                        "admission gate closed", reason="closed", retry_after=1.0,
                        request_id=rid))
                self._abandoned.add(rid)  # still queued in the policy: free it if admitted
            self._waiters.clear()

    def statistics(self) -> Any:
        with self._lock:
            return self.policy.statistics()


def settle(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    """Resolve ``fut`` with ``value`` or ``exc`` unless it is already done (a caller that
    gave up); call it on the future's loop (``loop.call_soon_threadsafe(settle, ...)``)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
