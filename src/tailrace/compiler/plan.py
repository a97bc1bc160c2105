"""Pipeline -> Plan: validate, choose how each stage runs, fuse chains, bound every edge.

A ``PlanStage`` is what the runtime schedules: one or more operators (``PlanOp``)
fused into one loop, its replicas, the bound of its input channel and its
``Execution``: how the stage is called, decided here once (``tailrace plan`` prints it)
and never derived again by a runtime. Fusion joins a chain of stateless single-replica
inline operators where each link has one producer and one consumer: records then cross
no channel between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..api.pipeline import Contract, Pipeline, StageSpec
from ..operators import OpDef
from ..operators.registry import is_async_callable
from .validate import check_contract, check_fields, check_graph, check_op, check_params, link_ops

#: Default bound (records) of a stage's input channel when its contract sets none.
DEFAULT_QUEUE = 1024
#: Largest micro-batch a source emits or a stage takes at once.
MAX_MICROBATCH = 1024
#: Most records in one push between Ray actors. A push costs ~0.5-1 ms of Ray overhead,
#: so pushes should be large; but an edge's window (its bound) is shared by every push in
#: flight downstream of it (acks are end to end), so it must hold several.
MAX_PUSH = 256
#: Pushes that fit in an edge's window (measured: 4 in flight left a 3-stage chain
#: waiting on Ray latency; 8 gave 1.35x the throughput, 16 no more).
PUSHES_IN_FLIGHT = 8
#: Most attempts of one stage worker still running after their timeout. A blocking call
#: cannot be killed; past this many, new calls fail at once instead of queueing behind
#: hung threads (so a timed blocking worker gets 1 + ABANDON_CAP threads).
ABANDON_CAP = 4
#: Calls a replica of a stage over a continuously batching engine has in flight at once
#: (``Execution.in_flight``): enough that what waits reaches the engine's own queue, where it
#: is ranked by class, rather than the stage's FIFO.
CALLS_IN_FLIGHT = 32


@dataclass(frozen=True)
class PlanOp:
    """One operator as compiled: its spec, definition and resolved parameters."""

    id: str
    op: OpDef
    params: dict[str, Any]
    contract: Contract
    spec: StageSpec = field(compare=False)


@dataclass(frozen=True)
class Execution:
    """How a stage is called, for every runtime (local, Ray, serving).

    call:      ``chain`` (each micro-batch through the fused operators' batch functions),
               ``per_record`` (the one operator record by record, under its timeout and
               retries, or a coroutine operator), ``collect`` (one call for a whole
               group: a ``batch`` stage or a batch contract).
    mode:      ``inline`` (on the event loop), ``thread`` (blocking code in the worker's
               own threads), ``async`` (coroutines awaited on the loop).
    max_batch: most records per call (a micro-batch, a group, an engine's batch).
    max_wait_ms: ``collect``: how long a group waits to fill after its first record (0
               for an operator whose engine batches its calls itself, ``engine_batches``).
    push:      records per push into the stage between Ray actors.
    timeout_ms, retries: per attempt / extra attempts (``per_record`` and ``collect``).
    cancel:    what a timeout does: ``none``, ``cancel`` (the coroutine is cancelled) or
               ``abandon`` (a blocking call's ``_cancel`` is set, its thread left to end).
    threads:   worker threads per call in flight (0: none; 1 + ``ABANDON_CAP`` when a
               blocking call may be abandoned).
    in_flight: calls a replica has in flight at once. 1, except for an operator whose
               engine batches continuously (``engine_batches``): each record is its own
               call, up to ``CALLS_IN_FLIGHT`` at once, so a short answer is never held behind a
               long one in the same call and the engine merges and ranks them itself.
    """

    call: str
    mode: str
    max_batch: int
    max_wait_ms: float
    push: int
    timeout_ms: float | None
    retries: int
    cancel: str
    threads: int
    in_flight: int = 1

    def describe(self) -> str:
        """One line for ``tailrace plan``."""
        parts = [self.call, self.mode, f"batch<={self.max_batch}"]
        if self.call == "collect":
            parts.append(f"wait={self.max_wait_ms:g}ms")
        parts.append(f"push={self.push}")
        if self.timeout_ms is not None:
            parts.append(f"timeout={self.timeout_ms:g}ms ({self.cancel})")
        if self.retries:
            parts.append(f"retries={self.retries}")
        if self.threads:
            parts.append(f"threads={self.threads}")
        if self.in_flight > 1:
            parts.append(f"in_flight={self.in_flight}")
        return " ".join(parts)


@dataclass(frozen=True)
class PlanStage:
    """A schedulable unit: fused operators, replicas, mode, input bound, execution.

    mode: as ``Execution.mode``. execution: how the stage is called; None for a source.
    max_replicas: the most replicas the Ray runtime may scale the stage to on load
    (``replicas`` is the least); 0: fixed at ``replicas``.
    """

    id: str
    ops: tuple[PlanOp, ...]
    upstream: tuple[str, ...]
    replicas: int
    mode: str
    queue: int
    execution: Execution | None = None
    max_replicas: int = 0

    @property
    def elastic(self) -> bool:
        """Its replicas scale between ``replicas`` and ``max_replicas`` (on Ray)."""
        return self.max_replicas > self.replicas


@dataclass(frozen=True)
class Edge:
    """A bounded channel hop: ``src`` (``stage`` or ``stage.port``) -> ``dst``."""

    src: str
    dst: str
    bound: int


@dataclass(frozen=True)
class Plan:
    """The compiled pipeline the runtimes execute."""

    name: str
    stages: tuple[PlanStage, ...]
    edges: tuple[Edge, ...]
    fused: bool
    pipeline: Pipeline = field(compare=False, repr=False)

    def stage(self, sid: str) -> PlanStage:
        for s in self.stages:
            if s.id == sid:
                return s
        raise KeyError(sid)

    def to_dict(self) -> dict[str, Any]:
        from .render import plan_to_dict

        return plan_to_dict(self)

    def render(self, fmt: str = "text") -> str:
        from .render import render

        return render(self, fmt)

    def consumers(self) -> dict[int, dict[str | None, list[int]]]:
        """Stage index -> output port (None: its main output) -> the indexes of the stages
        reading it: the graph both runtimes wire their channels and links by."""
        index = {s.id: i for i, s in enumerate(self.stages)}
        out: dict[int, dict[str | None, list[int]]] = {i: {} for i in range(len(self.stages))}
        for i, s in enumerate(self.stages):
            for ref in s.upstream:
                src, _, port = ref.partition(".")
                out[index[src]].setdefault(port or None, []).append(i)
        return out

    def first_stages(self) -> set[int]:
        """Indexes of the stages that read a source directly (their records' scheduling
        delay is measured)."""
        return {c for i, ports in self.consumers().items()
                if self.stages[i].ops[0].op.kind == "source" for cs in ports.values() for c in cs}


def _mode(op: PlanOp) -> str:
    c = op.contract
    fn = op.params.get("fn")
    if op.op.kind not in ("source", "sink", "collect") and fn is not None \
            and is_async_callable(fn):
        return "async"
    if (c.blocking or op.op.blocking or max(c.replicas, c.max_replicas or 0) > 1
            or c.timeout_ms is not None):
        return "thread"
    return "inline"


def call_cap(op: PlanOp) -> int | None:
    """The most records the operator takes in one call (an engine's batch, an ordered
    memory read's 1), from its definition; None: no limit of its own."""
    cap = op.op.max_batch(op.params) if op.op.max_batch is not None \
        else op.params.get("max_batch")
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


def execution(first: PlanOp, replicas: int, queue: int, mode: str) -> Execution:
    """Decide how a (non-source) stage is called; see ``Execution``."""
    c = first.contract
    cap = call_cap(first)
    if first.op.kind == "collect" or c.batch is not None:
        call = "collect"
        max_n = c.batch.max_size if c.batch is not None else first.params["max_size"]
        wait = c.batch.max_wait_ms if c.batch is not None else first.params["max_wait_ms"]
        if cap is not None and c.batch is None:
            max_n = min(max_n, cap)
        if c.batch is not None and first.op.engine_batches is not None \
                and first.op.engine_batches(first.params):
            wait = 0  # the engine merges concurrent calls itself: one batcher, no wait here
    else:
        call = "per_record" if (mode == "async" or c.retries > 0
                                or c.timeout_ms is not None) else "chain"
        max_n = max(1, min(MAX_MICROBATCH, queue) // replicas)
        wait = 0.0
        if cap is not None:
            max_n = min(max_n, cap)
    in_flight = 1
    if call != "collect" and mode == "thread" and first.op.engine_batches is not None \
            and first.op.engine_batches(first.params):
        max_n, in_flight = 1, max(1, min(CALLS_IN_FLIGHT, queue // replicas))
    push = max(1, min(MAX_PUSH, queue // (PUSHES_IN_FLIGHT * replicas)))
    hint = c.batch.max_size if c.batch is not None \
        else cap if cap is not None else first.params.get("max_size")
    if isinstance(hint, int) and not isinstance(hint, bool) and 0 < hint < push:
        push = hint
    timed = c.timeout_ms is not None
    cancel = "none" if not timed else "cancel" if mode == "async" else "abandon"
    threads = 0 if mode != "thread" else 1 + (ABANDON_CAP if timed else 0)
    return Execution(call, mode, max_n, float(wait), push, c.timeout_ms, c.retries, cancel,
                     threads, in_flight)


def _fusable(op: PlanOp) -> bool:
    c = op.contract
    return (op.op.fusable and c.replicas == 1 and not c.max_replicas
            and c.timeout_ms is None and c.retries == 0
            and c.batch is None and _mode(op) == "inline")


def compile_pipeline(p: Pipeline, *, fuse: bool = True) -> Plan:
    """Validate ``p`` and compile it into a ``Plan``; raises ``PlanError``."""
    ops: dict[str, PlanOp] = {}
    io: dict[str, tuple] = {}
    for spec in p.stages:
        opdef = check_op(spec)
        params = check_params(spec, opdef)
        check_contract(spec, opdef)
        ops[spec.id] = PlanOp(spec.id, opdef, params, spec.contract, spec)
        io[spec.id] = opdef.fields(params)
    order = check_graph(p)
    check_fields(p, order, io)
    link_ops(p, ops, io)

    consumers: dict[str, list[str]] = {sid: [] for sid in ops}
    for spec in p.stages:
        for ref in spec.upstream:
            consumers[ref.partition(".")[0]].append(spec.id)

    # Fusion: extend a chain while the link is one-to-one and both ends are fusable.
    chain_of: dict[str, list[str]] = {}
    chains: list[list[str]] = []
    for sid in order:
        spec = ops[sid].spec
        head = None
        if fuse and len(spec.upstream) == 1 and _fusable(ops[sid]) \
                and ops[sid].contract.queue is None:
            up = spec.upstream[0]
            if "." not in up and len(consumers[up]) == 1 and up in chain_of \
                    and _fusable(ops[up]) and ops[up].op.kind == "map":
                head = chain_of[up]
        if head is None:
            head = [sid]
            chains.append(head)
        else:
            head.append(sid)
        chain_of[sid] = head

    stage_of = {sid: "+".join(chain) for chain in chains for sid in chain}
    stages = []
    edges = []
    for chain in chains:
        first = ops[chain[0]]
        sid = stage_of[chain[0]]
        queue = first.contract.queue or DEFAULT_QUEUE
        ups = tuple(_remap(ref, stage_of) for ref in first.spec.upstream)
        stage_ops = tuple(ops[c] for c in chain)
        mode, replicas = _mode(first), first.contract.replicas
        most = max(replicas, first.contract.max_replicas or 0)
        # an elastic stage's pushes are sized for its most replicas: each can get work
        exe = None if first.op.kind == "source" else execution(first, most, queue, mode)
        stages.append(PlanStage(sid, stage_ops, ups, replicas, mode, queue, exe,
                                most if most > replicas else 0))
        edges += [Edge(u, sid, queue) for u in ups]
    return Plan(p.name, tuple(stages), tuple(edges), fuse, p)


def _remap(ref: str, stage_of: dict[str, str]) -> str:
    sid, dot, port = ref.partition(".")
    return stage_of[sid] + dot + port
