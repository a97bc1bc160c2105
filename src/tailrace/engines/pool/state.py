"""The bookkeeping of an engine pool: items, batches, replica state, statistics.

Owned by the pool's loop thread (under the pool's lock); only ``ReplicaState.piece`` and
``Call.wait`` (``engines/call.py``) run on other threads, and they touch nothing the loop
reorganises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..call import Call, Streamed
from .dispatch import Affinity, ReplicaLoad
from .messages import Cancel, TokenPiece
from .replicas import Replica


@dataclass(frozen=True)
class ReplicaStatistics:
    """One replica: its load now and what happened to it so far."""

    id: int
    endpoint: str | None
    pid: int | None
    healthy: bool
    down: bool  # it failed to start ``max_restarts`` times in a row and gets no more work
    outstanding_work: int  # predicted tokens of the batches it is running
    in_flight: int  # batches it is running
    calls: int  # engine calls (batches) it answered
    requests: int  # the requests in them
    failures: int  # deaths, failed starts and batches that came back with errors
    restarts: int  # times it was started again after a failure
    last_error: str | None
    prompt_tokens: int = 0  # prompt tokens of the generations it returned
    cached_tokens: int = 0  # of those, read from its engine's prefix cache
    # (``Generation.extra["cached_tokens"]``) instead of computed

    @property
    def cache_hit_ratio(self) -> float:
        """The share of its prompt tokens served from its prefix cache (0.0 before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class PoolStatistics:
    """A pool: its replicas, the batches formed and what became of failed calls."""

    name: str
    replicas: tuple[ReplicaStatistics, ...]
    batches: int  # batches formed (retries not counted again)
    mean_batch_size: float  # requests per batch on average
    shared_batches: int  # batches holding requests of more than one caller
    queued: int  # requests waiting for a batch or a replica
    retries: int  # batches sent again after a replica failed them
    failed_calls: int  # callers that got an error


class Item:
    """One request (or text) of a call, as the batcher and the replicas see it."""

    __slots__ = ("call", "index", "payload", "tokens", "streamed", "affinity")

    def __init__(self, call: Call, index: int, payload: Any, tokens: int,
                 affinity: Affinity | None = None):
        self.call, self.index, self.payload, self.tokens = call, index, payload, tokens
        self.affinity = affinity  # its prefix keys and session, for prefix_affinity
        self.streamed = Streamed()  # its text the caller has, over all attempts


@dataclass(eq=False)
class Batch:
    """Items sent together as one engine call; ``tried`` are the replicas it failed on."""

    id: int
    items: list[Item]
    attempts: int = 0
    tried: set[int] = field(default_factory=set)

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self.items)


class ReplicaState:
    """What the pool knows of one replica and the transport of its current incarnation."""

    def __init__(self, rid: int, endpoint: str | None, max_in_flight: int):
        self.id, self.endpoint, self.max_in_flight = rid, endpoint, max_in_flight
        self.transport: Replica | None = None
        self.incarnation = 0
        self.healthy = self.down = False
        self.pid: int | None = None
        self.in_flight: dict[int, Batch] = {}
        self.outstanding = 0
        self.calls = self.requests = self.failures = self.restarts = self.failed_starts = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.first_try = self.spawned_at = self.restart_at = 0.0
        self.last_error: str | None = None

    def load(self) -> ReplicaLoad:
        up = self.healthy and not self.down and self.transport is not None
        return ReplicaLoad(self.id, up, self.outstanding, len(self.in_flight), self.max_in_flight)

    def statistics(self) -> ReplicaStatistics:
        return ReplicaStatistics(
            self.id, self.endpoint, self.pid, self.healthy, self.down, self.outstanding,
            len(self.in_flight), self.calls, self.requests, self.failures, self.restarts,
            self.last_error, self.prompt_tokens, self.cached_tokens)

    def piece(self, msg: TokenPiece) -> None:
        """Hand a streamed piece to its caller, skipping text an earlier attempt streamed."""
        batch = self.in_flight.get(msg.batch_id)
        if batch is None or msg.index >= len(batch.items):
            return
        item = batch.items[msg.index]
        text = item.streamed.fresh(msg.text)
        if not text:
            return
        if not item.call.emit(item.index, text) and self.transport is not None:
            self.transport.send(Cancel(msg.batch_id, msg.index))  # free the engine sequence
