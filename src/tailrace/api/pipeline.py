"""Pipeline and Stream: the builder. Building records stage specs; it runs nothing.

    >>> import tailrace as tr
    >>> p = tr.Pipeline("double")
    >>> out = []
    >>> p.source(range(4)).map(lambda x: 2 * x).sink(out)
    >>> _ = tr.run(p)
    >>> out
    [0, 2, 4, 6]

Records are any Python objects. Stages that name record fields (``input=``,
``output=``, ``key=``) read and write dict records, as YAML pipelines do.
"""

from __future__ import annotations

import difflib
import math
import numbers
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlanError

#: The contract keys every stage accepts (YAML and Python alike).
CONTRACT_KEYS = ("replicas", "batch", "timeout_ms", "retries", "queue", "blocking", "placement")


@dataclass(frozen=True)
class BatchSpec:
    """Call the operator on lists: up to ``max_size`` records, waiting at most
    ``max_wait_ms`` after the first record of a batch for the rest to arrive."""

    max_size: int
    max_wait_ms: float = 0.0


@dataclass(frozen=True)
class Contract:
    """What a stage promises and needs; the compiler and runtime honour it.

    replicas:   parallel copies of the stage (stateless stages only); given as
                ``{min: 1, max: 4}`` the Ray runtime scales them between the bounds on
                load (``max_replicas`` holds the upper bound; other runtimes run ``min``).
    batch:      call the operator on lists (see ``BatchSpec``).
    timeout_ms: per-record (or per-batch) limit; the record becomes an error record.
    retries:    extra attempts after an exception or timeout.
    queue:      bound, in records, of the stage's input channel (None: plan default).
    blocking:   the operator blocks (I/O, native code): run it in a worker thread.
    placement:  where each replica runs on a cluster (``runtime="ray"``): ``{num_cpus,
                num_gpus, memory, resources, strategy: pack|spread}``; checked everywhere,
                used by the Ray runtime only.
    """

    replicas: int = 1
    batch: BatchSpec | None = None
    timeout_ms: float | None = None
    retries: int = 0
    queue: int | None = None
    blocking: bool = False
    placement: dict[str, Any] | None = None
    max_replicas: int | None = None


@dataclass(frozen=True)
class StageSpec:
    """One declared stage: operator name, parameters, upstream refs, contract.

    ``upstream`` holds stage ids, or ``"id.port"`` for a branch's ``true``/``false``
    output. ``where`` is the declaration's location (``file.yaml:12`` or
    ``script.py:34``), used in error messages.
    """

    id: str
    op: str
    upstream: tuple[str, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    contract: Contract = field(default_factory=Contract)
    where: str | None = field(default=None, compare=False)


_SERVE_SOURCES = "user, metadata.KEY or header:NAME"
#: priority class names and their ranks (higher is more urgent); any int is a class too
PRIORITY_CLASSES = {"batch": 0, "standard": 1, "interactive": 2}
_CLASSES = "'interactive', 'standard', 'batch' or integers (higher is more urgent)"


@dataclass(frozen=True)
class ServeSpec:
    """How ``tailrace serve`` fills record fields from an HTTP request (``serve:``).

    fields:      record field -> source: ``user`` (the OpenAI request's ``user``),
                 ``metadata.KEY`` (its ``metadata`` object) or ``header:NAME`` (a request
                 header, any case). A source the request lacks leaves its field unset.
    tenant:      the record field that holds the tenant: with ``--keys-file`` the server
                 sets it to the API key's tenant on every endpoint, whatever the caller sent.
    priorities:  the priority classes a request may choose for its admission (None: a
                 request may not choose one).
    deadline_ms: (least, most) milliseconds a request may give as its deadline (either
                 None: unbounded on that side); None: a request may not give one.
    """

    fields: tuple[tuple[str, str], ...] = ()
    tenant: str | None = None
    priorities: tuple[str | int, ...] | None = None
    deadline_ms: tuple[float | None, float | None] | None = None


def is_int(v: Any) -> bool:
    """True for an int (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """True for a real number: an int, a float, a numpy scalar... (not a bool)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_ms(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0)


def _serve_priorities(raw: Any) -> tuple[str | int, ...]:
    ok = isinstance(raw, list) and raw and all(
        (isinstance(c, str) and c in PRIORITY_CLASSES) or is_int(c) for c in raw)
    if not ok:
        raise ValueError(f"'serve.priorities' must be a non-empty list of the priority "
                         f"classes a request may choose ({_CLASSES}), got {raw!r}")
    return tuple(raw)


def _serve_deadline(raw: Any) -> tuple[float | None, float | None]:
    if not isinstance(raw, dict) or not raw:
        raise ValueError("'serve.deadline_ms' must be a mapping like {min: 200, max: 30000} "
                         f"(milliseconds a request may give as its deadline), got {raw!r}")
    unknown = [str(k) for k in raw if k not in ("min", "max")]
    if unknown:
        raise ValueError(f"unknown key 'serve.deadline_ms.{unknown[0]}' (allowed: min, max)")
    lo, hi = raw.get("min"), raw.get("max")
    for name, v in (("min", lo), ("max", hi)):
        if v is not None and not _is_ms(v):
            raise ValueError(f"'serve.deadline_ms.{name}' must be a positive number of "
                             f"milliseconds, got {v!r}")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"'serve.deadline_ms': min ({lo!r}) is above max ({hi!r})")
    return (float(lo) if lo is not None else None, float(hi) if hi is not None else None)


_SERVE_KEYS = ("fields", "tenant", "priorities", "deadline_ms")


def make_serve(raw: Any) -> ServeSpec:
    """The ``ServeSpec`` of a ``serve:`` mapping (or a ``ServeSpec``); ValueError saying
    what is wrong otherwise.

    raw: ``{"fields": {FIELD: SOURCE, ...}, "tenant": FIELD, "priorities": [CLASS, ...],
         "deadline_ms": {"min": MS, "max": MS}}`` (all optional).
    """
    if isinstance(raw, ServeSpec):
        return raw
    if not isinstance(raw, dict):
        raise ValueError("'serve' must be a mapping like {fields: {user_id: user}, "
                         "tenant: user_id}")
    unknown = [str(k) for k in raw if k not in _SERVE_KEYS]
    if unknown:
        raise ValueError(f"unknown key 'serve.{unknown[0]}' (allowed: "
                         f"{', '.join(_SERVE_KEYS)})")
    fields = raw.get("fields") or {}
    if not isinstance(fields, dict):
        raise ValueError("'serve.fields' must be a mapping of record field -> source "
                         f"({_SERVE_SOURCES})")
    out = []
    for name, src in fields.items():
        if not isinstance(name, str) or not name or name.startswith("_"):
            raise ValueError(f"'serve.fields': {name!r} is not a record field name (a "
                             "non-empty string not starting with '_')")
        ok = isinstance(src, str) and (
            src == "user" or (src.startswith("metadata.") and len(src) > 9)
            or (src.startswith("header:") and len(src.strip()) > 7))
        if not ok:
            raise ValueError(f"'serve.fields.{name}': source {src!r} is not one of "
                             f"{_SERVE_SOURCES}")
        out.append((name, src.strip()))
    tenant = raw.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant
                               or tenant.startswith("_")):
        raise ValueError(f"'serve.tenant' must name a record field, got {tenant!r}")
    priorities = raw.get("priorities")
    deadline = raw.get("deadline_ms")
    return ServeSpec(tuple(out), tenant,
                     _serve_priorities(priorities) if priorities is not None else None,
                     _serve_deadline(deadline) if deadline is not None else None)


def did_you_mean(word: str, choices: Any) -> str:
    """``"; did you mean 'x'?"`` when a close match exists, else ``""``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _caller_location() -> str:
    """``file:line`` of the user code that called the builder (first frame outside it)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def make_contract(kw: dict[str, Any]) -> Contract:
    """The ``Contract`` of a stage's contract keys (popped from ``kw``); TypeError for others."""
    given = {k: kw.pop(k) for k in CONTRACT_KEYS if k in kw}
    if isinstance(given.get("batch"), dict):
        given["batch"] = BatchSpec(**given["batch"])
    bounds = given.get("replicas")
    if isinstance(bounds, dict):
        if set(bounds) != {"min", "max"}:
            raise TypeError(f"'replicas' must be a positive integer or a mapping like "
                            f"{{min: 1, max: 4}}, got {bounds!r}")
        given["replicas"], given["max_replicas"] = bounds["min"], bounds["max"]
    if kw:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(kw))}; "
                        f"contract keys are: {', '.join(CONTRACT_KEYS)}")
    return Contract(**given)


class Pipeline:
    """A named dataflow under construction. Building runs nothing; ``tr.run`` does.

    name:    the pipeline's name (used in stats, plans, and as the served pipeline's
             name under ``tailrace serve``).
    slo:     optional ``{"p99_ms": ..., "priority": ...}`` (read by the control plane).
    engines: optional engine declarations (read by engine-backed operators).
    serve:   optional ``{"fields": {...}, "tenant": FIELD}``: how ``tailrace serve`` fills
             record fields from a request (see ``ServeSpec``).
    description: optional: what the pipeline does, in a sentence (``tailrace serve
             --mcp`` describes its tool with it).
    """

    def __init__(self, name: str, *, slo: dict | None = None,
                 engines: dict | None = None, source_file: str | None = None,
                 serve: dict | ServeSpec | None = None,
                 description: str | None = None) -> None:
        self.name = name
        self.description = description
        try:
            self.serve = make_serve(serve) if serve is not None else None
        except ValueError as e:
            raise PlanError(str(e), where=source_file or _caller_location()) from None
        self.slo = slo
        self.engines = dict(engines or {})
        self.source_file = source_file
        self._stages: dict[str, StageSpec] = {}
        self._counts: dict[str, int] = {}

    # -- construction -------------------------------------------------------------
    @property
    def stages(self) -> tuple[StageSpec, ...]:
        return tuple(self._stages.values())

    def add_stage(self, spec: StageSpec) -> None:
        """Add a stage spec (used by the builder and the YAML loader)."""
        if spec.id in self._stages:
            first = self._stages[spec.id].where
            raise PlanError(
                f"duplicate stage id (first defined at {first}); give each stage a unique id",
                where=spec.where, stage=spec.id)
        self._stages[spec.id] = spec

    def _new_id(self, op: str, given: str | None) -> str:
        if given is not None:
            return given
        n = self._counts.get(op, 0)
        while True:
            candidate = op if n == 0 else f"{op}_{n}"
            n += 1
            if candidate not in self._stages:
                self._counts[op] = n
                return candidate

    def _add(self, op: str, upstream: tuple[str, ...], params: dict[str, Any],
             kw: dict[str, Any], id: str | None) -> str:
        where = _caller_location()
        sid = self._new_id(op, id)
        try:
            contract = make_contract(kw)
        except TypeError as e:
            raise PlanError(str(e), where=where, stage=sid) from None
        self.add_stage(StageSpec(sid, op, upstream, params, contract, where))
        return sid

    def source(self, data: Iterable[Any] | None = None, *, id: str | None = None,
               fields: list[str] | None = None, **contract: Any) -> Stream:
        """Start a stream from an iterable or async iterable.

        >>> p = tr.Pipeline("ex")
        >>> p.source(fields=["q"]).map(lambda r: r["q"].upper()).sink()
        >>> tr.run(p, input=[{"q": "hi"}, {"q": "yo"}]).outputs
        ['HI', 'YO']

        data:   the records; ``None`` to bind them at run time (``tr.run(p, input=...)``).
        fields: the record fields the source provides (lets the compiler check fields).
        """
        params: dict[str, Any] = {"data": data}
        if fields is not None:
            params["fields"] = tuple(fields)
        return Stream(self, self._add("source", (), params, contract, id))

    def merge(self, *streams: Stream, id: str | None = None, **contract: Any) -> Stream:
        """Interleave several streams into one (no ordering across inputs).

        >>> p = tr.Pipeline("ex")
        >>> p.merge(p.source([1, 2]), p.source([10])).sink(out := [])
        >>> _ = tr.run(p); sorted(out)
        [1, 2, 10]

        streams: the streams to interleave.
        """
        ups = tuple(s._ref for s in streams)
        return Stream(self, self._add("merge", ups, {}, contract, id))

    @classmethod
    def from_yaml(cls, path: str) -> Pipeline:
        """Load a pipeline from a YAML v1 file (see docs/pipeline-yaml.md)."""
        from .yaml_loader import load_pipeline

        return load_pipeline(path)

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={list(self._stages)})"


@dataclass(frozen=True)
class Stream:
    """The output of a stage; the builder methods add a stage consuming it."""

    pipeline: Pipeline
    stage_id: str
    port: str | None = None

    @property
    def _ref(self) -> str:
        return self.stage_id if self.port is None else f"{self.stage_id}.{self.port}"

    def _then(self, op: str, params: dict[str, Any], kw: dict[str, Any], id: str | None) -> Stream:
        """A stream of a new stage ``op`` that consumes this one."""
        return Stream(self.pipeline, self.pipeline._add(op, (self._ref,), params, kw, id))

    def map(self, fn: Callable | str, *, id: str | None = None, input: str | None = None,
            output: str | None = None, **contract: Any) -> Stream:
        """Transform each record: ``fn(record)``, or ``record[output] = fn(record[input])``.

        >>> p = tr.Pipeline("ex")
        >>> p.source([1, 2]).map(lambda x: x + 1).sink(out := [])
        >>> _ = tr.run(p); out
        [2, 3]

        fn:     a callable or a dotted path ``"pkg.module.function"``; async allowed.
        input:  read this field of a dict record instead of the whole record.
        output: write the result to this field (of a copy of the record).
        With ``batch=`` in the contract, ``fn`` takes and returns lists.
        """
        return self._then("map", {"fn": fn, "input": input, "output": output}, contract, id)

    def filter(self, fn: Callable | str, *, id: str | None = None,
               input: str | None = None, **contract: Any) -> Stream:
        """Keep the records for which ``fn`` is truthy.

        >>> p = tr.Pipeline("ex")
        >>> p.source([1, 2, 3, 4]).filter(lambda x: x % 2).sink(out := [])
        >>> _ = tr.run(p); out
        [1, 3]

        fn:    predicate (callable or dotted path), applied to field ``input`` if given.
        """
        return self._then("filter", {"fn": fn, "input": input}, contract, id)

    def flat_map(self, fn: Callable | str, *, id: str | None = None,
                 input: str | None = None, output: str | None = None,
                 **contract: Any) -> Stream:
        """Emit every item of the iterable ``fn`` returns (zero or more per record).

        >>> p = tr.Pipeline("ex")
        >>> p.source(["a b", "c"]).flat_map(str.split).sink(out := [])
        >>> _ = tr.run(p); out
        ['a', 'b', 'c']

        fn:     returns an iterable (callable or dotted path).
        input:  apply ``fn`` to this field; output: each item goes to a copy's field.
        """
        params = {"fn": fn, "input": input, "output": output}
        return self._then("flat_map", params, contract, id)

    def key_by(self, fn: Callable | str, *, id: str | None = None, **contract: Any) -> Stream:
        """Turn each record into ``(fn(record), record)`` for keyed stages.

        >>> p = tr.Pipeline("ex")
        >>> p.source(["ab", "c"]).key_by(len).sink(out := [])
        >>> _ = tr.run(p); out
        [(2, 'ab'), (1, 'c')]

        fn: the key function (callable or dotted path).
        """
        return self._then("key_by", {"fn": fn}, contract, id)

    def branch(self, fn: Callable | str, *, id: str | None = None,
               input: str | None = None, **contract: Any) -> tuple[Stream, Stream]:
        """Split into ``(trues, falses)`` by a predicate; each record goes one way.

        >>> p = tr.Pipeline("ex")
        >>> big, small = p.source([1, 2, 3]).branch(lambda x: x > 1)
        >>> big.sink(bigs := []); small.sink(smalls := [])
        >>> _ = tr.run(p); bigs, smalls
        ([2, 3], [1])

        fn:    predicate (callable or dotted path), applied to field ``input`` if given.
        """
        sid = self._then("branch", {"fn": fn, "input": input}, contract, id).stage_id
        return Stream(self.pipeline, sid, "true"), Stream(self.pipeline, sid, "false")

    def merge(self, *others: Stream, id: str | None = None, **contract: Any) -> Stream:
        """Interleave this stream with others (no ordering across inputs).

        >>> p = tr.Pipeline("ex")
        >>> odd, even = p.source([1, 2, 3]).branch(lambda x: x % 2)
        >>> odd.map(lambda x: -x).merge(even).sink(out := [])
        >>> _ = tr.run(p); sorted(out)
        [-3, -1, 2]

        others: the streams to interleave with this one.
        """
        return self.pipeline.merge(self, *others, id=id, **contract)

    def batch(self, max_size: int, max_wait_ms: float = 0.0, *, id: str | None = None,
              output: str | None = None, **contract: Any) -> Stream:
        """Group records into lists of up to ``max_size``, waiting at most
        ``max_wait_ms`` after a list's first record (a partial list is emitted then,
        and at end of input).

        >>> p = tr.Pipeline("ex")
        >>> p.source([1, 2, 3]).batch(2).sink(out := [])
        >>> _ = tr.run(p); out
        [[1, 2], [3]]

        output: emit ``{output: [records]}`` instead of the bare list.
        """
        params = {"max_size": max_size, "max_wait_ms": max_wait_ms, "output": output}
        return self._then("batch", params, contract, id)

    def stateful(self, fn: Callable | str, *, id: str | None = None,
                 key: str | None = None, input: str | None = None,
                 output: str | None = None, **contract: Any) -> Stream:
        """Keyed state: ``fn(state, value) -> (new_state, emit)``; state starts as None.

        Without ``key``, records must be ``(key, value)`` pairs (see ``key_by``) and
        ``(key, emit)`` pairs come out. With ``key="field"``, dict records are keyed
        by that field and ``emit`` is written to ``output``. A ``None`` new state
        forgets the key.

        >>> def add(total, x):
        ...     total = (total or 0) + x
        ...     return total, total
        >>> p = tr.Pipeline("ex")
        >>> p.source([("a", 1), ("b", 5), ("a", 2)]).stateful(add).sink(out := [])
        >>> _ = tr.run(p); out
        [('a', 1), ('b', 5), ('a', 3)]
        """
        params = {"fn": fn, "key": key, "input": input, "output": output}
        return self._then("stateful", params, contract, id)

    def apply(self, op: str | type, *, id: str | None = None, **kwargs: Any) -> Stream:
        """Add a stage running any operator: a registered name (``"map"``, ``"retrieve"``,
        ``"generate"``...) or a ``tailrace.Operator`` subclass, with its parameters and
        contract keys as keywords — exactly what a YAML stage would say.

        >>> p = tr.Pipeline("ex")
        >>> p.source([-1, 2]).apply("map", fn=abs, replicas=2).sink(out := [])
        >>> _ = tr.run(p); sorted(out)
        [1, 2]
        """
        name = op if isinstance(op, str) else f"{op.__module__}.{op.__qualname__}"
        contract = {k: kwargs.pop(k) for k in list(kwargs) if k in CONTRACT_KEYS}
        return self._then(name, kwargs, contract, id)

    def sink(self, target: list | Callable | None = None, *, id: str | None = None,
             **contract: Any) -> None:
        """End the stream: append records to a list, or call ``target(record)``.

        >>> p = tr.Pipeline("ex")
        >>> p.source(["a", "b"]).sink(print)
        >>> _ = tr.run(p)
        a
        b

        target: a list, a callable, or None to bind at run time (``output=``, else
                ``tr.run(p).outputs``).
        """
        self._then("sink", {"target": target}, contract, id)
