"""What crosses a Ray boundary: small typed messages, grouped by direction.

Every micro-batch carries a *route* (``BatchKey``): the source batch it descends from,
then a hop where a port copies records to several stages (the consumer's index) or where
a fan-out stage ran (``(stage, token)``); and one *lineage id* per record (``lineage.py``).
The driver's ledger keeps the first delivery of each id and drops replays, whatever
the replayed stages did differently (``ledger.py``): every record reaches a sink exactly
once even though delivery between actors is at-least-once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ...compiler import PlanStage

#: Route of a micro-batch: ``(source index, seq, hop, ...)``; a hop is a consumer stage
#: index (a copy) or ``(stage index, token)`` (an execution of a fan-out stage).
BatchKey = tuple[Any, ...]
#: Lineage ids of a micro-batch's records, one each (``range`` from a source).
Lineage = Sequence[Any]
#: Where one stage replica lives: ``(run id, stage index, replica)``.
InstanceKey = tuple[str, int, int]

#: ``StageHost.push`` answers: accepted and acknowledged end to end ...
PUSH_OK = 0
#: ... the host does not have this stage replica (it restarted): install, then push again ...
NEED_INSTALL = 1
#: ... the run is over on this host (a straggler after an abort): drop the batch.
RUN_CLOSED = 2

# -- driver -> host: what a stage replica needs to run ------------------------------------
@dataclass(frozen=True)
class Route:
    """One output edge of a stage: its consumer stage, where it runs, its credit window."""

    target: int  # plan index of the consuming stage
    sink: bool  # the consumer is a sink run by the driver (records leave through the outbox)
    hosts: tuple[Any, ...]  # actor handles of the consumer's replicas (empty for sinks)
    specs: tuple[list, ...]  # per replica, [its InstallSpec's ObjectRef]: to reinstall it
    window: int  # credit window in records (the edge's bound): most in flight, unacked
    chunk: int  # most records per push on this edge
    label: str = ""  # the consuming stage's id (for error messages)
    # the consumer's replica when it runs in the driver (``driver_stages``): pushes are
    # calls, no actor in between (such a route never leaves the driver)
    local: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class InstallSpec:
    """Everything a host needs to run the replicas of one stage in one run."""

    run_id: str
    index: int  # the stage's index in the plan
    stage: PlanStage  # the compiled stage (sink targets removed: sinks run in the driver)
    routes: dict[str | None, tuple[Route, ...]]  # port (None, "true", "false") -> edges
    first: bool  # fed by a source: the stage measures scheduling delay
    env: dict[str, str] = field(default_factory=dict)  # the driver's TAILRACE_* (index, models)
    sys_path: tuple[str, ...] = ()  # the driver's, so dotted ``fn:`` paths resolve alike
    served: bool = False  # a served run: the host binds its records' requests (served.py)


# -- host -> driver: the outbox, drained by the driver -----------------------------------
class Delivery(NamedTuple):
    """Records for the sink of stage ``target``, on route ``key``."""

    target: int
    key: BatchKey
    records: list
    lineage: Lineage
    born: float  # wall clock when the oldest record was read by the source
    sent: float  # wall clock when it entered the outbox


class Failures(NamedTuple):
    """Error records stage ``stage`` produced on route ``key`` (its input's route, plus
    its own hop when it fans out); ``lineage``: the failed records' ids."""

    stage: int
    key: BatchKey
    errors: list  # of ErrorRecord
    lineage: Lineage


class Unsendable(NamedTuple):
    """Records for the sink of stage ``target`` that cannot be serialised (their reprs)."""

    target: int
    key: BatchKey
    reprs: list
    lineage: Lineage
    reason: str


class Commit(NamedTuple):
    """Fan-out stage ``stage`` finished execution ``token`` of a push that came on route
    ``key`` with ids ``parents``: all it produced is acknowledged end to end."""

    stage: int
    key: BatchKey
    token: int
    parents: Lineage


class MeterReport(NamedTuple):
    """A snapshot of one stage replica's meters (cumulative for its incarnation)."""

    stage: int
    replica: int
    incarnation: str  # changes when the replica is rebuilt after its actor restarted
    node: str  # Ray node id of the host
    meters: list  # StageMeter per operator of the stage run on the host
    max_depth: int  # most records in the replica's input queue
    scheduling: Any  # Histogram: source read -> first operator start (first stages)
    sink_depth: dict  # sink stage index -> most records in flight to it from this replica
    depth: int = 0  # pushes' records waiting in its queue now (autoscaling reads it)
    running: bool = False  # a micro-batch is in its operators now
    blocked: bool = False  # its output waits for a consumer's credits (not its own work)
    counters: tuple = ()  # per operator: what it counted (``OpRuntime.counters``), or {}


class Pieces(NamedTuple):
    """Streamed text pieces for the driver, in order, by request key, each run of them
    with the position of its first (1, 2, ...: counted over the record's hosts, so
    pieces a replayed record streams again are known and skipped)."""

    pieces: dict  # request key -> (position of the first, [piece, ...])


class Drained(NamedTuple):
    """Answer to ``StageHost.drain``: new outbox entries since the last acknowledgement."""

    incarnation: str  # the host's; a new one means it restarted and forgot its outbox
    last_seq: int  # acknowledge up to this with the next drain call
    entries: list  # Pieces | Delivery | Failures | Unsendable | Commit | MeterReport
    closed: bool  # the run is finished on this host


class Installed(NamedTuple):
    """Answer to ``StageHost.install``."""

    incarnation: str  # the host's
    node: str
    pid: int
    replica: str = ""  # the stage replica's incarnation
