"""Pipeline -> Plan: validate, choose how each stage runs, fuse chains, bound every edge.

A ``PlanStage`` is what the runtime schedules: one or more operators (``PlanOp``)
fused into one loop, its replicas, its execution mode and the bound of its input
channel. Fusion joins a chain of stateless single-replica inline operators where each
link has one producer and one consumer: records then cross no channel between them.
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


@dataclass(frozen=True)
class PlanOp:
    """One operator as compiled: its spec, definition and resolved parameters."""

    id: str
    op: OpDef
    params: dict[str, Any]
    contract: Contract
    spec: StageSpec = field(compare=False)


@dataclass(frozen=True)
class PlanStage:
    """A schedulable unit: fused operators, replicas, mode and input bound.

    mode: ``inline`` (runs on the event loop), ``thread`` (blocking code: worker
    threads), ``async`` (coroutine operators awaited on the loop).
    """

    id: str
    ops: tuple[PlanOp, ...]
    upstream: tuple[str, ...]
    replicas: int
    mode: str
    queue: int


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


def _mode(op: PlanOp) -> str:
    c = op.contract
    fn = op.params.get("fn")
    if op.op.kind in ("source", "sink", "collect"):
        base_async = False
    elif fn is not None:
        base_async = is_async_callable(fn)
    else:
        base_async = False
    if base_async:
        return "async"
    if c.blocking or op.op.blocking or c.replicas > 1 or c.timeout_ms is not None:
        return "thread"
    return "inline"


def _fusable(op: PlanOp) -> bool:
    c = op.contract
    return (op.op.fusable and c.replicas == 1 and c.timeout_ms is None and c.retries == 0
            and c.batch is None and _mode(op) == "inline")


def compile_pipeline(p: Pipeline, *, fuse: bool = True,
                     default_queue: int = DEFAULT_QUEUE) -> Plan:
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
        queue = first.contract.queue or default_queue
        ups = tuple(_remap(ref, stage_of) for ref in first.spec.upstream)
        stages.append(PlanStage(sid, tuple(ops[c] for c in chain), ups,
                                first.contract.replicas, _mode(first), queue))
        edges += [Edge(u, sid, queue) for u in ups]
    return Plan(p.name, tuple(stages), tuple(edges), fuse, p)


def _remap(ref: str, stage_of: dict[str, str]) -> str:
    sid, dot, port = ref.partition(".")
    return stage_of[sid] + dot + port
