"""The typed messages between an engine pool and its replicas, grouped by direction.

Small frozen dataclasses: they cross a process boundary (pickled over a Pipe) for process
replicas and are handed over as they are for thread replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..base import GenerationRequest

# -- down: pool -> replica -------------------------------------------------------------


@dataclass(frozen=True)
class GenerateBatch:
    """Run ``requests`` as one engine call; stream the pieces of the requests in ``stream``."""

    batch_id: int
    requests: tuple[GenerationRequest, ...]
    stream: tuple[int, ...] = ()


@dataclass(frozen=True)
class EmbedBatch:
    """Embed ``texts`` as one engine call."""

    batch_id: int
    texts: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    """Finish the current call, close the engine and exit."""


@dataclass(frozen=True)
class Cancel:
    """The caller of request ``index`` of batch ``batch_id`` went away: stop generating it."""

    batch_id: int
    index: int


ToReplica = GenerateBatch | EmbedBatch | Shutdown | Cancel

# -- up: replica -> pool ---------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine is open: the replica is healthy and takes batches."""

    pid: int
    model: str
    context_length: int | None = None
    dim: int | None = None
    chat: bool | None = None  # a generation engine that takes chat messages


@dataclass(frozen=True)
class StartFailed:
    """The engine could not be opened; ``error`` says why (one line)."""

    error: str


@dataclass(frozen=True)
class TokenPiece:
    """A piece of text of request ``index`` of batch ``batch_id``, as it is produced."""

    batch_id: int
    index: int
    text: str


@dataclass(frozen=True)
class ItemError:
    """Request ``index`` of a batch failed: ``kind`` is the exception class name."""

    index: int
    kind: str
    message: str


@dataclass(frozen=True)
class BatchResult:
    """The outputs of batch ``batch_id`` in request order (None where ``errors`` has one).

    outputs: ``list[Generation | None]`` for generation; for embedding a float32 array with
             one row per text (or a list of rows, None where a text failed).
    """

    batch_id: int
    outputs: Any
    errors: tuple[ItemError, ...] = ()


@dataclass(frozen=True)
class Exited:
    """The replica process ended (sent by the transport, not the worker)."""

    exitcode: int | None


FromReplica = Ready | StartFailed | TokenPiece | BatchResult | Exited
Deliver = Callable[[FromReplica], None]
