"""The built-in dataflow operators: map, filter, flat_map, key_by, branch, merge,
batch, stateful, source and sink.

Python pipelines add them with the ``Stream`` methods of the same names (examples
there); YAML pipelines name them in ``op:``, functions by dotted path:

>>> from tailrace.api.yaml_loader import loads_pipeline
>>> p = loads_pipeline('''{version: 1, pipeline: ex, source: {fields: [text]}, stages: [
...     {id: n, op: map, fn: builtins.len, input: text, output: n},
...     {id: some, op: filter, fn: builtins.bool, input: n}]}''')
>>> tr.run(p, input=[{"text": "ab"}, {"text": ""}]).outputs
[{'text': 'ab', 'n': 2}]

Each ``_build_*`` returns fresh runtime callables; batch functions isolate failures per
record (``per_record``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import FieldError, count_param, get_field, non_negative
from .registry import BuildContext, OpDef, OpRuntime, Param, is_async_callable, register, resolve

FN = Param("fn", (str,), required=True, doc="callable or dotted path 'pkg.module.function'",
           want="a callable or a dotted path like 'mypkg.module.function'", callable=True)
INPUT = Param("input", (str,), doc="read this field of a dict record", want="a field name")
OUTPUT = Param("output", (str,), doc="write the result to this field", want="a field name")


def _io(params: dict) -> tuple[str | None, str | None]:
    """(field read, field written: ``output``, else ``input``); (None, None): the function
    takes and returns whole records."""
    inp = params.get("input")
    return inp, params.get("output") or inp


def _with_fields(fn: Callable, inp: str | None, target: str | None) -> Callable:
    """Adapt ``fn`` to dict records: read field ``inp``, write field ``target``."""
    if target is None:
        return fn
    if inp is None:
        return lambda r: {**r, target: fn(r)}
    return lambda r: {**r, target: fn(get_field(r, inp))}


def _fields_io(params: dict) -> tuple:
    inp, out = params.get("input"), params.get("output")
    if inp is None and out is None:
        return None, None  # whole-record function: fields unknown
    reads = (inp,) if inp else None
    return reads, (out or inp,)


def per_record(f: Callable[[Any], Any], *, many: bool = False) -> Callable[[list, list], list]:
    """A batch function applying ``f`` to each record (one output each, or each item of
    the iterable it returns when ``many``); a record whose call raises goes to ``errors``
    and the loop resumes with the next one.

    >>> errors = []
    >>> per_record(lambda x: 10 // x)([1, 0, 5], errors), errors
    ([10, 2], [(0, ZeroDivisionError('integer division or modulo by zero'))])
    """

    def batch_fn(batch: list, errors: list) -> list:
        out: list = []
        append = out.extend if many else out.append
        it = iter(batch)
        while True:
            try:
                for x in it:
                    append(f(x))
                return out
            except Exception as e:  # noqa: BLE001 - operator code may raise anything
                errors.append((x, e))

    return batch_fn


# -- map ------------------------------------------------------------------------------
def _build_map(params: dict, ctx: BuildContext) -> OpRuntime:
    raw = resolve(params["fn"])
    inp, target = _io(params)
    f = _with_fields(raw, inp, target)
    if is_async_callable(raw):
        async def arecord(x: Any) -> list:
            v = await raw(x if inp is None else get_field(x, inp))
            return [v if target is None else {**x, target: v}]

        return OpRuntime("map", record_fn=arecord, is_async=True)
    if ctx.contract.batch is not None:
        return OpRuntime("map", record_fn=_whole_batch(raw, params), whole_batch=True)
    return OpRuntime("map", batch_fn=per_record(f), record_fn=lambda x: [f(x)])


def _whole_batch(fn: Callable, params: dict) -> Callable:
    """A batch-contract map: ``fn(list of inputs) -> list of outputs``, same length."""
    inp, target = _io(params)

    def call(records: list) -> list:
        values = records if inp is None else [get_field(r, inp) for r in records]
        results = list(fn(values))
        if len(results) != len(values):
            raise ValueError(f"batch function returned {len(results)} results for "
                             f"{len(values)} inputs; it must return one per input")
        if target is None:
            return results
        return [{**r, target: v} for r, v in zip(records, results, strict=False)]

    return call


# -- filter ---------------------------------------------------------------------------
def _build_filter(params: dict, ctx: BuildContext) -> OpRuntime:
    raw = resolve(params["fn"])
    inp = params.get("input")
    pred = raw if inp is None else (lambda r: raw(get_field(r, inp)))
    return OpRuntime("map", batch_fn=per_record(lambda x: (x,) if pred(x) else (), many=True),
                     record_fn=lambda x: [x] if pred(x) else [])


# -- flat_map -------------------------------------------------------------------------
def _build_flat_map(params: dict, ctx: BuildContext) -> OpRuntime:
    raw = resolve(params["fn"])
    inp, target = _io(params)
    if target is None:
        items = raw
    else:
        def items(r: Any) -> list:
            return [{**r, target: v} for v in raw(r if inp is None else get_field(r, inp))]

    return OpRuntime("map", batch_fn=per_record(items, many=True),
                     record_fn=lambda x: list(items(x)))


# -- key_by ---------------------------------------------------------------------------
def _build_key_by(params: dict, ctx: BuildContext) -> OpRuntime:
    kf = resolve(params["fn"])
    return _build_map({"fn": lambda x: (kf(x), x)}, ctx)


# -- branch ---------------------------------------------------------------------------
def _build_branch(params: dict, ctx: BuildContext) -> OpRuntime:
    raw = resolve(params["fn"])
    inp = params.get("input")
    pred = raw if inp is None else (lambda r: raw(get_field(r, inp)))
    marked = per_record(lambda x: (x, bool(pred(x))))

    def split(batch: list, errors: list) -> tuple[list, list]:
        pairs = marked(batch, errors)
        return [x for x, yes in pairs if yes], [x for x, yes in pairs if not yes]

    return OpRuntime("branch", batch_fn=split, record_fn=lambda x: bool(pred(x)))


# -- stateful -------------------------------------------------------------------------
def _build_stateful(params: dict, ctx: BuildContext) -> OpRuntime:
    fn = resolve(params["fn"])
    key, (inp, target) = params.get("key"), _io(params)
    state: dict = {}

    def update(k: Any, v: Any) -> Any:
        """``fn`` on key ``k``'s state: keep its new state (None forgets the key), emit."""
        new, emit = fn(state.get(k), v)
        if new is None:
            state.pop(k, None)
        else:
            state[k] = new
        return emit

    if key is None:
        def step(x: Any) -> Any:
            try:
                k, v = x
            except (TypeError, ValueError):
                raise FieldError("stateful stage without 'key' expects (key, value) pairs; "
                                 f"got {type(x).__name__} (use key_by first, or key=...)") \
                    from None
            return (k, update(k, v))
    else:
        def step(x: Any) -> Any:
            emit = update(get_field(x, key), x if inp is None else get_field(x, inp))
            return emit if target is None else {**x, target: emit}

    return OpRuntime("map", batch_fn=per_record(step), record_fn=lambda x: [step(x)])


def _stateful_fields(params: dict) -> tuple:
    reads, writes = _fields_io(params)
    if params.get("key"):
        reads = (params["key"],) + (reads or ())
    return reads, writes


# -- merge / batch / source / sink ----------------------------------------------------
def _build_batch(params: dict, ctx: BuildContext) -> OpRuntime:
    out = params.get("output")
    if out is None:
        return OpRuntime("collect", record_fn=lambda records: records)
    return OpRuntime("collect", record_fn=lambda records: {out: records})


def _build_placeholder(kind: str) -> Callable[[dict, BuildContext], OpRuntime]:
    return lambda params, ctx: OpRuntime(kind)


register(OpDef("map", "map", _build_map, (FN, INPUT, OUTPUT), batchable=True,
               fields=_fields_io, doc="transform each record"))
register(OpDef("filter", "map", _build_filter, (FN, INPUT),
               fields=lambda p: (((p["input"],) if p.get("input") else None), ()),
               doc="keep records where fn is truthy"))
register(OpDef("flat_map", "map", _build_flat_map, (FN, INPUT, OUTPUT), fields=_fields_io,
               doc="emit zero or more records per record"))
register(OpDef("key_by", "map", _build_key_by, (FN,), doc="(key, record) pairs"))
register(OpDef("branch", "branch", _build_branch, (FN, INPUT),
               fields=lambda p: (((p["input"],) if p.get("input") else None), ()),
               doc="split into true/false ports"))
register(OpDef("merge", "map", _build_placeholder("map"), (), fields=lambda p: ((), ()),
               doc="interleave several streams"))
register(OpDef("stateful", "map", _build_stateful,
               (FN, INPUT, OUTPUT, Param("key", (str,), doc="key field", want="a field name")),
               state="keyed", fields=_stateful_fields, doc="keyed state per record key"))
register(OpDef("batch", "collect", _build_batch,
               (count_param("max_size", required=True),
                Param("max_wait_ms", (int, float), default=0.0, check=non_negative,
                      want="a non-negative number of milliseconds"),
                OUTPUT),
               fusable=False,
               fields=lambda p: (None, (p["output"],) if p.get("output") else None),
               doc="group records into lists"))
register(OpDef("source", "source", _build_placeholder("source"),
               (Param("data", (object,)), Param("fields", (tuple, list))),
               fusable=False, fields=lambda p: ((), None), doc="the input records"))
register(OpDef("sink", "sink", _build_placeholder("sink"), (Param("target", (object,)),),
               fields=lambda p: ((), ()), doc="the output"))
