"""One admission gate for the cluster: a named Ray actor owning the policy, and its client.

Several driver processes (e.g. Serve ingress replicas) share one ``max_in_flight`` only if
one policy sees all of them: the ``GateActor`` (``tailrace-gate-NAME``, created by the
first client, found by the others) owns it inside an ``AdmissionGate``; ``ClusterGate`` is
the client, with ``AdmissionGate``'s protocol. Ticket ids, leases and failures: docs/ray.md,
"One gate for the cluster".
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
import weakref
from functools import cache
from operator import itemgetter
from typing import Any

from ...control.admission import AdmissionRejected, AdmissionStatistics, Ticket
from ...control.admission import Request as Asking
from ...control.gate import AdmissionGate, approx_prompt_tokens
from ...control.policies import make_policy
from ...errors import TailraceError
from ...request import REQUEST, Request, request_of
from .connect import import_ray

NAMESPACE = "tailrace"
CANCELLED = "cancelled"  # rejection reason: the caller gave up while it waited


class GateUnavailable(TailraceError):
    """The cluster's gate actor is gone: nothing is admitted until it is replaced (HTTP 503;
    ``retry_after`` seconds)."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GateActor:
    """The cluster's admission policy (``make_policy(policy, **options)``) behind one actor.

    ``admit`` answers ``("admitted", cost, deadline_in, seq)``, ``("rejected", reason,
    retry_after, message)`` or ``("invalid", message)``; ``release`` and ``cancel`` are
    idempotent per ticket id.
    """

    def __init__(self, policy: str, options: dict[str, Any], max_tokens: dict[str, int],
                 lease_s: float = 10.0, poll_s: float = 0.005) -> None:
        self.gate = AdmissionGate(make_policy(policy, **options), max_tokens=max_tokens,
                                  prompt_tokens=itemgetter("prompt_tokens"), poll_s=poll_s)
        self.tickets: dict[str, Ticket] = {}  # ticket id -> admitted, not yet released
        self.pending: dict[str, asyncio.Task] = {}  # ticket id -> waiting for admission
        self.cancelled: set[str] = set()  # cancels that arrived before their admit
        self.counters = {"released": 0, "repeated_releases": 0, "cancelled": 0, "expired": 0}
        self.lease_s = lease_s
        self.seen: dict[str, float] = {}  # owner -> when it last admitted or renewed
        self._reaper: asyncio.Task | None = None

    async def admit(self, key: str, pipeline: str, prompt_tokens: int,
                    urgency: dict[str, Any] | None) -> tuple:
        self._touch(owner_of(key))
        if key in self.cancelled:
            self.cancelled.discard(key)
            return ("rejected", CANCELLED, 0.0, f"request {key!r}: its caller gave up")
        fields = {"prompt_tokens": prompt_tokens, REQUEST: Request(asked=urgency)}
        task = asyncio.current_task()  # cancel() cancels it: the gate frees what it admitted
        assert task is not None
        self.pending[key] = task
        try:
            ticket = await self.gate.admit(pipeline, fields)
        except AdmissionRejected as e:
            return ("rejected", e.reason, e.retry_after, str(e))
        except asyncio.CancelledError:
            self.counters["cancelled"] += 1
            return ("rejected", CANCELLED, 0.0, f"request {key!r}: its caller gave up")
        except ValueError as e:
            return ("invalid", str(e))
        finally:
            self.pending.pop(key, None)
        if key in self.cancelled:  # cancelled after the policy admitted it, before now
            self.cancelled.discard(key)
            self.counters["cancelled"] += 1
            self.gate.done(ticket)
            return ("rejected", CANCELLED, 0.0, f"request {key!r}: its caller gave up")
        self.tickets[key] = ticket
        return ("admitted", ticket.cost, ticket.deadline - ticket.admitted_at, ticket.seq)

    def release(self, key: str, service_seconds: float | None = None) -> bool:
        """Give ticket ``key`` back; False (and counted) when it was already given back."""
        ticket = self.tickets.pop(key, None)
        if ticket is None:
            self.counters["repeated_releases"] += 1
            return False
        self.counters["released"] += 1
        self.gate.done(ticket, service_seconds)
        return True

    def cancel(self, key: str) -> None:
        """The caller of ``key`` gave up: stop its wait, or free its ticket if admitted."""
        task = self.pending.get(key)
        if task is not None and task.cancel():
            return  # the gate frees it if the policy admits it meanwhile
        if key in self.tickets:
            self.release(key)
        else:
            self.cancelled.add(key)

    async def renew(self, owner: str) -> None:
        """``owner`` (a client) is alive: its tickets stay held ``lease_s`` more seconds."""
        self._touch(owner)

    def _touch(self, owner: str) -> None:  # on the actor's loop
        self.seen[owner] = time.monotonic()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Free the tickets and waits of owners not heard from for ``lease_s``."""
        while True:
            await asyncio.sleep(self.lease_s / 4)
            now = time.monotonic()
            gone = {o for o, t in self.seen.items() if now - t > self.lease_s}
            if not gone:
                continue
            for o in gone:
                del self.seen[o]
            for key in [k for k in self.pending if owner_of(k) in gone]:
                self.pending[key].cancel()
            for key in [k for k in self.tickets if owner_of(k) in gone]:
                self.counters["expired"] += 1
                self.gate.done(self.tickets.pop(key))

    def statistics(self) -> AdmissionStatistics:
        return self.gate.statistics()

    def gate_counters(self) -> dict[str, int]:
        """Releases, repeated releases (no-ops), cancelled waits, tickets now held."""
        return {**self.counters, "held": len(self.tickets), "waiting": len(self.pending),
                "owners": len(self.seen)}

    async def ping(self, *args: Any) -> tuple:
        """A bare round trip answering its arguments (the benchmark's baselines)."""
        return args


def owner_of(key: str) -> str:
    """The client that named ticket ``key`` (``OWNER-N``)."""
    return key.rsplit("-", 1)[0]


@cache
def gate_actor_class() -> Any:
    """``GateActor`` as a Ray actor class (Ray is imported only when this is called)."""
    ray = import_ray()
    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=10_000)(GateActor)


def _renew(actor: Any, owner: str, stop: threading.Event, every: float) -> None:
    """Tell the gate actor that client ``owner`` lives, until ``stop`` is set."""
    while not stop.wait(every):
        actor.renew.remote(owner)


class ClusterGate:
    """Admission through the cluster's gate actor, with ``AdmissionGate``'s protocol.

    policy, options: ``make_policy(policy, **options)`` for the actor, used only by the
                     client that creates it (the first with this ``name``).
    name:            the actor is ``tailrace-gate-NAME`` in the ``tailrace`` namespace.
    max_tokens:      pipeline name -> predicted output tokens per request (default 64).
    prompt_tokens:   record -> predicted prompt tokens (computed here, in the driver).
    detached:        outlive the Ray job that created it (default: the job's lifetime).
    lease_s:         the actor frees the tickets of a client not heard from for this long
                     (a driver process that died); clients renew every ``lease_s / 4``.
                     Used by the client that creates the actor; give every client the same.
    """

    def __init__(self, policy: str = "fcfs", *, name: str = "default",
                 max_tokens: dict[str, int] | None = None,
                 prompt_tokens: Any = approx_prompt_tokens, detached: bool = False,
                 lease_s: float = 10.0, **options: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"ClusterGate name: expected a non-empty string, got {name!r}")
        if isinstance(lease_s, bool) or not isinstance(lease_s, int | float) or lease_s <= 0:
            raise ValueError(f"ClusterGate lease_s: expected seconds > 0, got {lease_s!r}")
        self.name = name
        self.prompt_tokens = prompt_tokens
        self._ray = ray = import_ray()
        self._errors = (ray.exceptions.RayError,)
        self.actor = gate_actor_class().options(
            name=f"tailrace-gate-{name}", namespace=NAMESPACE, get_if_exists=True,
            lifetime="detached" if detached else None,
        ).remote(policy, options, dict(max_tokens or {}), lease_s)
        self._owner = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._stop = threading.Event()
        weakref.finalize(self, self._stop.set)  # a client dropped unclosed stops renewing
        threading.Thread(target=_renew, args=(self.actor, self._owner, self._stop, lease_s / 4),
                         daemon=True, name=f"tailrace-gate-lease-{name}").start()

    def _unavailable(self, e: BaseException) -> GateUnavailable:
        return GateUnavailable(f"admission gate 'tailrace-gate-{self.name}' is unavailable "
                               f"({type(e).__name__}); nothing is admitted until it is "
                               "replaced")

    async def admit(self, pipeline: str, record: Any) -> Ticket:
        """One round trip to the gate actor; raises ``AdmissionRejected`` (429) or
        ``GateUnavailable`` (503). The urgency asked as in ``AdmissionGate.admit``."""
        arrival = time.monotonic()
        key = f"{self._owner}-{next(self._ids)}"
        asked = request_of(record)
        urgency = asked.asked if asked is not None else None
        try:
            answer = await self.actor.admit.remote(key, pipeline, self.prompt_tokens(record),
                                                   urgency)
        except asyncio.CancelledError:
            self.actor.cancel.remote(key)  # fire and forget: the actor frees it exactly once
            raise
        except self._errors as e:
            raise self._unavailable(e) from None
        if answer[0] == "rejected":
            _, reason, retry_after, message = answer
            raise AdmissionRejected(message, reason=reason, retry_after=retry_after,
                                    request_id=key)
        if answer[0] == "invalid":
            raise ValueError(answer[1])
        _, cost, deadline_in, seq = answer
        now = time.monotonic()
        return Ticket(Asking(key, pipeline, arrival=arrival), admitted_at=now, cost=cost,
                      deadline=now + deadline_in, seq=seq)

    def done(self, ticket: Ticket, service_seconds: float | None = None) -> None:
        """Give the ticket back (fire and forget); ``service_seconds`` default: since
        admission, measured here."""
        if service_seconds is None:
            service_seconds = max(0.0, time.monotonic() - ticket.admitted_at)
        self.actor.release.remote(ticket.request.id, service_seconds)

    def statistics(self, timeout: float = 10.0) -> AdmissionStatistics:
        try:
            return self._ray.get(self.actor.statistics.remote(), timeout=timeout)
        except self._errors as e:
            raise self._unavailable(e) from None

    def counters(self, timeout: float = 10.0) -> dict[str, int]:
        """The actor's ``gate_counters()``."""
        try:
            return self._ray.get(self.actor.gate_counters.remote(), timeout=timeout)
        except self._errors as e:
            raise self._unavailable(e) from None

    def close(self) -> None:
        """Stop renewing this client's lease (tickets it still holds are freed when the
        lease runs out); the actor is shared: ``shutdown()`` ends it."""
        self._stop.set()

    def shutdown(self) -> None:
        """Kill the gate actor (every client's admissions then fail with GateUnavailable)."""
        self._stop.set()
        self._ray.kill(self.actor)
