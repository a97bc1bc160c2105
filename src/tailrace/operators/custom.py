"""User-defined operator classes, named in YAML by dotted path (``op: mypkg.ops.Clean``).

    class Clean(tr.Operator):
        reads = ("text",)          # fields read (optional: enables field checks)
        writes = ("text",)         # fields written
        def __init__(self, lowercase: bool = True):   # YAML stage keys arrive here
            self.lowercase = lowercase
        def process(self, record):                    # one record in, one out
            text = record["text"].lower() if self.lowercase else record["text"]
            return {**record, "text": text}

A fresh instance is made per run and per replica, so instance state is never shared.
Override ``process_batch(records) -> list`` to handle a micro-batch at once. An operator
that blocks on a server which batches concurrent calls itself (a vLLM or llama-server
client) sets ``concurrent_calls = True``: its stage runs in threads, each record its own
call, up to ``CALLS_IN_FLIGHT`` at once per replica (``Execution.in_flight``).
"""

from __future__ import annotations

import inspect
from typing import Any

from .core import per_record
from .registry import BuildContext, OpDef, OpRuntime, Param, is_async_callable


class Operator:
    """Base class of custom operators: override ``process`` (or ``process_batch``)."""

    reads: tuple[str, ...] | None = None
    writes: tuple[str, ...] | None = None
    concurrent_calls: bool = False  # blocking calls that a server batches: many at once

    def process(self, record: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define process(record)")

    def process_batch(self, records: list) -> list:
        return [self.process(r) for r in records]


def custom_op(cls: Any) -> OpDef:
    """An ``OpDef`` for an ``Operator`` subclass; its ``__init__`` arguments are its params."""
    if not (isinstance(cls, type) and issubclass(cls, Operator)):
        raise ValueError(f"{getattr(cls, '__qualname__', cls)!r} is not a subclass of "
                         "tailrace.Operator")
    params = []
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        required = p.default is inspect.Parameter.empty
        params.append(Param(name, (object,), required=required,
                            default=None if required else p.default))

    def build(kwargs: dict, ctx: BuildContext) -> OpRuntime:
        inst = cls(**kwargs)
        if is_async_callable(inst.process):
            async def arecord(x: Any) -> list:
                return [await inst.process(x)]
            return OpRuntime("map", record_fn=arecord, is_async=True)
        overridden = type(inst).process_batch is not Operator.process_batch
        one_by_one = per_record(inst.process)

        def batch_fn(batch: list, errors: list) -> list:
            if overridden:
                try:
                    return list(inst.process_batch(batch))
                except Exception as e:
                    errors.extend((x, e) for x in batch)
                    return []
            return one_by_one(batch, errors)

        return OpRuntime("map", batch_fn=batch_fn, record_fn=lambda x: [inst.process(x)])

    name = f"{cls.__module__}.{cls.__qualname__}"
    concurrent = bool(cls.concurrent_calls)
    return OpDef(name, "map", build, tuple(params), blocking=concurrent,
                 engine_batches=(lambda p: True) if concurrent else None,
                 fields=lambda p: (cls.reads, cls.writes), doc=(cls.__doc__ or "").strip())
