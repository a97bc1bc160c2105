"""Operator registry: YAML ``op:`` names -> operator definitions.

An ``OpDef`` declares the operator's parameters (checked at compile time), state kind,
fusability, the fields it reads and writes, and ``build``, which makes fresh runtime
callables for one replica of one run. Operators backed by models or indexes open them
inside ``build`` (heavy libraries load when a run starts, never at import), engines
through the ``BuildContext``: the runtime decides where an engine lives.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..api.pipeline import Contract


@dataclass(frozen=True)
class Param:
    """One operator parameter: accepted types, required or its default, a doc line."""

    name: str
    types: tuple[type, ...]
    required: bool = False
    default: Any = None
    doc: str = ""
    want: str = ""  # how the error message describes the accepted values
    callable: bool = False  # a Python callable is accepted too (resolved at compile time)
    check: Callable[[Any], bool] | None = None  # extra value check; fails with ``want``


@dataclass
class OpRuntime:
    """What the runtime calls for one operator in one replica of one run.

    kind:      "map" (list -> list), "branch" (list -> (trues, falses)), "collect"
               (list -> one record), "sink", "source".
    batch_fn:  ``batch_fn(records, errors) -> outputs``; appends ``(record, exc)``
               to ``errors`` for each record that failed; None means identity.
    record_fn: one record -> list of outputs (branch: -> bool); used when a stage
               has retries or a timeout, and for async operators.
    is_async:  ``record_fn`` is a coroutine function.
    counters:  ``counters() -> {name: number}``: what the operator counted in this run
               (e.g. tokens per engine), read once when stats are gathered — never per
               record — and summed over replicas into ``StageStats.counters``.
    close:     ``close()`` releases what ``build`` opened for this replica (server
               connections, subprocesses); the runtime calls it once when the replica
               stops (the run ends, the served pipeline stops); None: nothing to release.
    """

    kind: str
    batch_fn: Callable[[list, list], Any] | None = None
    record_fn: Callable[[Any], Any] | None = None
    is_async: bool = False
    whole_batch: bool = False  # batch contract: record_fn takes the whole list
    counters: Callable[[], dict[str, float]] | None = None
    abandoned: int = 0  # runtime bookkeeping: timed-out blocking calls still running
    close: Callable[[], None] | None = None


@dataclass
class LinkContext:
    """What ``OpDef.prepare`` sees at compile time: the pipeline's engine specs and,
    for each record field, the stages that write it (``(stage id, op name, params)``)."""

    engines: dict[str, Any]
    writers: dict[str, list[tuple[str, str, dict[str, Any]]]]


@dataclass(frozen=True)
class Answers:
    """What serving needs to know about an operator that can answer a chat or completion
    request (it generates the request's text); serving asks these, never the name.

    Each takes the stage's compiled params.
    output_tokens: most tokens the stage may generate for one record (all its engine
                   calls: a cascade's levels, a tool conversation's rounds).
    max_tokens:    the ceiling of one answer (a request's ``max_tokens`` is cut to it).
    engine:        the engine spec that counts its text's tokens (None: estimate).
    usage_field:   the record field it writes its own usage to, or None.
    enforces:      the ``response_format`` types its engine enforces.
    pieces:        most text pieces one attempt streams (None: ``max_tokens``, a piece
                   per token).
    budgets:       whether it spends a request's budget: ``"required"`` (a request must
                   bring one), ``"optional"``, or None (a budget is refused: a 400).
    tools:         why it cannot answer a request's client tools (``tools``), or None:
                   it can (it passes them to its engine and answers in the call form).
    converses:     whether a served chat's conversation (system messages, earlier turns)
                   reaches its model; False: its YAML opted out (``messages: false``).
    """

    output_tokens: Callable[[dict[str, Any]], int]
    max_tokens: Callable[[dict[str, Any]], int]
    engine: Callable[[dict[str, Any]], Any] = field(default=lambda p: p.get("_engine"))
    usage_field: Callable[[dict[str, Any]], str | None] = field(default=lambda p: None)
    enforces: Callable[[dict[str, Any]], frozenset[str]] = field(
        default=lambda p: frozenset())
    pieces: Callable[[dict[str, Any]], int] | None = None
    budgets: Callable[[dict[str, Any]], str | None] = field(default=lambda p: None)
    tools: Callable[[dict[str, Any]], str | None] = field(
        default=lambda p: "it does not pass client tools to a model")
    converses: Callable[[dict[str, Any]], bool] = field(
        default=lambda p: p.get("messages") is not False)

    def stream_pieces(self, params: dict[str, Any]) -> int:
        """Most text pieces one attempt of the stage streams."""
        return (self.pieces or self.max_tokens)(params)


@dataclass(frozen=True)
class BuildContext:
    """What ``OpDef.build`` gets besides its params, for one replica of one run.

    contract:    the stage's contract (batching, timeout, retries, ...).
    open_engine: ``open_engine(spec) -> engine`` for an engine spec the compiler linked
                 (``_name`` names it): the runtime's opener. The local runtime passes
                 ``tailrace.engines.open_engine`` (shared in the process); a Ray stage host
                 passes a handle on the cluster's shared engine actor.
    """

    contract: Contract
    open_engine: Callable[[dict[str, Any]], Any]


@dataclass(frozen=True)
class OpDef:
    """The definition of an operator, as the compiler sees it."""

    name: str
    kind: str
    build: Callable[[dict[str, Any], BuildContext], OpRuntime]
    params: tuple[Param, ...] = ()
    state: str = "stateless"  # stateless | keyed | shared
    fusable: bool = True
    batchable: bool = False  # accepts the batch contract
    # (params) -> (fields read, fields written); None means "the whole record".
    fields: Callable[[dict[str, Any]], tuple[tuple[str, ...] | None, tuple[str, ...] | None]] \
        = field(default=lambda params: (None, None))
    doc: str = ""
    blocking: bool = False  # the operator blocks (model calls, I/O): run it in a thread
    # compile-time linking (engines, indexes): returns params; raises ValueError/TailraceError
    prepare: Callable[[dict[str, Any], LinkContext], dict[str, Any]] | None = None
    # (params) -> most records per call; None: the ``max_batch`` param if there is one
    max_batch: Callable[[dict[str, Any]], int | None] | None = None
    # it can answer a served chat/completion request: what serving needs (None: cannot)
    answers: Answers | None = None
    # (params) -> the engine it calls batches concurrent calls itself (llama.cpp, a remote
    # server): it is their one batcher, so a ``batch`` contract sets the most records per
    # call and never waits for more (docs/design.md, "One batcher per engine kind")
    engine_batches: Callable[[dict[str, Any]], bool] | None = None


_REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Make an operator available to YAML ``op:`` by its name."""
    if op.name in _REGISTRY:
        raise ValueError(f"operator {op.name!r} is already registered")
    _REGISTRY[op.name] = op
    return op


def known_ops() -> list[str]:
    return sorted(_REGISTRY)


def lookup(name: str) -> OpDef:
    """The operator named ``name``: a registered name, or a dotted path to an
    ``Operator`` subclass. Raises LookupError naming the known operators."""
    op = _REGISTRY.get(name)
    if op is not None:
        return op
    if "." in name:
        from .custom import custom_op

        return custom_op(resolve(name))
    raise LookupError(f"unknown operator '{name}'")


def resolve(fn: Any) -> Any:
    """A callable (or class) from a callable or a dotted path ``pkg.module.attr``.

    Raises ValueError with the reason when the path cannot be imported."""
    if not isinstance(fn, str):
        if not callable(fn):
            raise ValueError(f"expected a callable or a dotted path, got {type(fn).__name__}")
        return fn
    module, _, attr = fn.rpartition(".")
    if not module:
        raise ValueError(f"'{fn}' is not a dotted path like 'mypkg.module.function'")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"cannot import module '{module}' for '{fn}': {e}") from None
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise ValueError(f"module '{module}' has no attribute '{attr}'") from None
    if not callable(obj):
        raise ValueError(f"'{fn}' is not callable")
    return obj


def qualname(fn: Any) -> str:
    """A stable printable name of a callable (``module.qualname``) for plans."""
    if isinstance(fn, str):
        return fn
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{mod}.{name}"


def is_async_callable(fn: Any) -> bool:
    """True for coroutine functions and objects whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
