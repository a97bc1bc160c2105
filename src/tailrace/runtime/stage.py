"""One plan stage at run time: its replicas' operator chains and their meters.

``run_chain`` is the hot path: one micro-batch through the stage's fused operators,
a list comprehension-sized loop per operator, two clock reads per operator per
micro-batch and no per-record work beyond the operator itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...compiler import PlanOp, PlanStage
from ...errors import StageTimeout
from ...observability import StageMeter
from ...operators import OpRuntime


def sink_runtime(target: Any) -> OpRuntime:
    """A sink's batch function: extend a list or call ``target(record)``."""
    if isinstance(target, list):
        extend = target.extend
        return OpRuntime("sink", batch_fn=lambda batch, errors: extend(batch))
    if not callable(target):
        raise TypeError(f"a sink target must be a list or a callable, got "
                        f"{type(target).__name__}")

    def batch_fn(batch: list, errors: list) -> None:
        it = iter(batch)
        while True:
            try:
                for x in it:
                    target(x)
                return
            except Exception as e:
                errors.append((x, e))

    return OpRuntime("sink", batch_fn=batch_fn, record_fn=lambda x: target(x))


class Replica:
    """The operator runtimes and meters of one replica of a stage."""

    __slots__ = ("stage", "ops", "rts", "meters", "sinks", "drop_hook", "drop_key")

    def __init__(self, stage: PlanStage, rts: list[OpRuntime],
                 drop_hook: Callable[[str, list], None] | None = None,
                 drop_key: str | None = None) -> None:
        self.stage = stage
        self.ops = stage.ops
        self.rts = rts
        # told which records ended without an output or error (a server answers their
        # requests): those whose ``drop_key`` no output or error of an operator carries
        # (a filter's drop, a flat_map's empty expansion, a record replaced without the
        # key). Nothing at all is checked without a hook.
        if drop_hook is not None and drop_key is None:
            raise ValueError("a drop hook needs the drop_key its records keep")
        self.drop_hook = drop_hook
        self.drop_key = drop_key
        self.meters = [StageMeter(o.id, o.op.name, replicas=stage.replicas,
                                  queue_bound=stage.queue if i == 0 else 0,
                                  fused_into=stage.id if len(stage.ops) > 1 else None)
                       for i, o in enumerate(stage.ops)]

    def run_chain(self, batch: list, errors: list) -> dict[str | None, list]:
        """Push one micro-batch through the fused operators; returns port -> records.

        Failed records are appended to ``errors`` as ``ErrorRecord``s.
        """
        for i, rt in enumerate(self.rts):
            m = self.meters[i]
            n = len(batch)
            m.records_in += n
            if not n:
                continue
            t0 = perf_counter()
            errs: list = []
            kind = rt.kind
            fn = rt.batch_fn
            if kind == "map":
                if fn is not None:
                    before = batch
                    try:
                        batch = fn(batch, errs)
                    except Exception as e:  # noqa: BLE001 - a whole-batch call failed
                        errs = [(x, e) for x in batch]
                        batch = []
                    if self.drop_hook is not None:
                        gone = dropped(before, batch, errs, self.drop_key or "")
                        if gone:
                            self.drop_hook(self.ops[i].id, gone)
            elif kind == "branch":
                t, f = fn(batch, errs)  # type: ignore[misc]
                self._done(m, t0, n, len(t) + len(f), errs, errors, i)
                return {"true": t, "false": f}
            elif kind == "sink":
                fn(batch, errs)  # type: ignore[misc]
                self._done(m, t0, n, n - len(errs), errs, errors, i)
                return {}
            else:  # pragma: no cover - compiler guarantees the kinds above
                raise RuntimeError(f"operator kind {kind!r} cannot run in a chain")
            self._done(m, t0, n, len(batch), errs, errors, i)
        return {None: batch}

    def _done(self, m: StageMeter, t0: float, n_in: int, n_out: int, errs: list,
              errors: list, i: int) -> None:
        dt = perf_counter() - t0
        m.records_out += n_out
        m.service.record(dt * 1e6 / n_in, n_in)
        m.batch_size.record(n_in)
        if errs:
            m.errors += len(errs)
            sid = self.ops[i].id
            errors.extend(ErrorRecord.from_exception(sid, x, e) for x, e in errs)


def dropped(before: list, after: list, errs: list, key: str) -> list:
    """The records of ``before`` whose ``key`` no record of ``after`` or ``errs`` has."""
    kept = {r.get(key) for r in after if isinstance(r, dict)}
    kept.update(x.get(key) for x, _ in errs if isinstance(x, dict))
    return [r for r in before if isinstance(r, dict) and r.get(key) not in kept]


async def call_careful(op: PlanOp, rt: OpRuntime, m: StageMeter, batch: list,
                       run_blocking: Any, errors: list,
                       on_drop: Callable[[str, list], None] | None = None
                       ) -> dict[str | None, list]:
    """Record by record, with the stage's timeout and retries (one operator, never fused);
    returns port -> records. Arguments as for ``call_collect``; ``on_drop(stage id,
    records)`` hears of records whose call returned nothing (they end there)."""
    out: list = []
    falses: list = []
    branch = rt.kind == "branch"
    t0 = perf_counter()
    m.records_in += len(batch)
    for x in batch:
        try:
            r = await call_with_policy(op, rt, m, x, run_blocking)
        except Exception as e:  # noqa: BLE001 - operator code may raise anything
            m.errors += 1
            errors.append(ErrorRecord.from_exception(op.id, x, e, getattr(e, "attempts", 1)))
            continue
        if branch:
            (out if r else falses).append(x)
        else:
            out.extend(r)
            if not r and on_drop is not None:  # the record ended here without output
                on_drop(op.id, [x])
    m.records_out += len(out) + len(falses)
    m.service.record((perf_counter() - t0) * 1e6 / len(batch), len(batch))
    m.batch_size.record(1, len(batch))
    return {"true": out, "false": falses} if branch else {None: out}


async def call_collect(op: PlanOp, rt: OpRuntime, m: StageMeter, batch: list,
                       run_blocking: Any, errors: list) -> list:
    """A batch-contract operator or a ``batch`` stage: one call for the whole list, under
    the stage's timeout and retries; returns its outputs. Records the operator rejects one
    by one (e.g. a missing field) become error records; a failed call fails the batch.

    op, rt, m:    the operator, its runtime and its meter.
    batch:        the records.
    run_blocking: how blocking calls run (an executor's ``run_in_executor``), or None.
    errors:       where ``ErrorRecord``s go.
    """
    n = len(batch)
    m.records_in += n
    m.batch_size.record(n)
    t0 = perf_counter()
    rejected: list = []
    strict = None
    if rt.batch_fn is not None and not rt.whole_batch and rt.kind == "map":
        batch_fn = rt.batch_fn

        def strict(records: list) -> list:
            rejected.clear()
            return batch_fn(records, rejected)

    try:
        result = await call_with_policy(op, rt, m, batch, run_blocking, strict)
    except Exception as e:  # noqa: BLE001 - every record of the batch failed
        m.errors += n
        attempts = getattr(e, "attempts", 1)
        errors.extend(ErrorRecord.from_exception(op.id, x, e, attempts) for x in batch)
        result = []
    else:
        if rt.kind == "collect":
            result = [result]
        if rejected:
            m.errors += len(rejected)
            errors.extend(ErrorRecord.from_exception(op.id, x, e) for x, e in rejected)
    m.service.record((perf_counter() - t0) * 1e6 / n, n)
    m.records_out += len(result)
    return result


#: Most attempts of one replica still running after their timeout. A blocking call
#: cannot be killed; past this many, new calls fail at once instead of queueing behind
#: hung threads (the runtime gives each timed replica 1 + ABANDON_CAP threads).
ABANDON_CAP = 4


class AttemptCancel:
    """The ``_cancel`` an attempt under a timeout sees: set when the attempt is
    abandoned, and set whenever the caller's own event is (``is_set`` reads both)."""

    __slots__ = ("_own", "caller")

    def __init__(self, caller: Any) -> None:
        self._own = threading.Event()
        self.caller = caller  # the record's own ``_cancel`` (None: it had none)

    def is_set(self) -> bool:
        c = self.caller
        return self._own.is_set() or (c is not None and bool(c.is_set()))

    def set(self) -> None:
        self._own.set()


def _cancellable(r: dict, cancels: list) -> dict:
    c = r.get("_cancel")
    c = AttemptCancel(c if callable(getattr(c, "is_set", None)) else None)
    cancels.append(c)
    return {**r, "_cancel": c}


def _with_cancel(arg: Any) -> tuple[Any, list[AttemptCancel]]:
    """``arg`` (a record or a list of them) with a fresh attempt cancel in each dict."""
    cancels: list[AttemptCancel] = []
    if isinstance(arg, dict):
        return _cancellable(arg, cancels), cancels
    if isinstance(arg, list):
        return [_cancellable(r, cancels) if isinstance(r, dict) else r for r in arg], cancels
    return arg, cancels


def _restore_cancel(result: Any) -> Any:
    """Give outputs that carry an attempt's cancel back the caller's own ``_cancel``."""
    for r in result if isinstance(result, list) else ():
        if isinstance(r, dict):
            c = r.get("_cancel")
            if isinstance(c, AttemptCancel):
                if c.caller is None:
                    del r["_cancel"]
                else:
                    r["_cancel"] = c.caller
    return result


def per_record_fn(rt: OpRuntime) -> Callable[[Any], Any]:
    """One record -> its outputs; a batch-only operator's failure for that record is
    raised (so timeouts and retries apply to it), never dropped."""
    if rt.record_fn is not None:
        return rt.record_fn
    batch_fn = rt.batch_fn
    if batch_fn is None:  # identity
        return lambda x: [x]

    def one(x: Any) -> Any:
        errs: list = []
        out = batch_fn([x], errs)
        if errs:
            raise errs[0][1]
        return out

    return one


async def call_with_policy(op: PlanOp, rt: OpRuntime, meter: StageMeter, arg: Any,
                           run_blocking: Callable | None,
                           fn: Callable[[Any], Any] | None = None) -> Any:
    """Call the operator on ``arg`` honouring the stage's timeout and retries.

    Returns the result, or raises the last exception with ``attempts`` set on it.
    ``run_blocking(fn, arg)`` runs sync code in a worker thread (None: inline).
    ``fn``: a synchronous call to make instead of the operator's own (a whole batch).

    Timeouts (docs/design.md, "Timeouts"): an async attempt is cancelled. A blocking
    attempt cannot be killed: it is abandoned, its ``_cancel`` is set (operators that
    honour it, like ``generate``, stop at the next token) and its result is discarded.
    A retry never overlaps its abandoned attempt: it waits up to one more timeout for
    it to return, else the record fails. A replica with ``ABANDON_CAP`` abandoned
    attempts still running fails new calls at once with a clear ``StageTimeout``.
    """
    c = op.contract
    timeout = c.timeout_ms / 1000.0 if c.timeout_ms is not None else None
    is_async = rt.is_async and fn is None
    call = fn if fn is not None else per_record_fn(rt)
    attempts = 0
    running: asyncio.Future | None = None  # an abandoned attempt still in its thread
    while True:
        attempts += 1
        try:
            if is_async:
                if timeout is None:
                    return await call(arg)
                # not asyncio.wait_for: on 3.11 it can swallow a cancellation (Ctrl-C)
                # that arrives as the awaited call completes
                async with asyncio.timeout(timeout):
                    return await call(arg)
            if run_blocking is None:
                return call(arg)
            if timeout is None:
                return await run_blocking(call, arg)
            if running is not None and not running.done():
                await asyncio.wait({running}, timeout=timeout)
                if not running.done():
                    raise StageTimeout(
                        f"an earlier attempt is still running {2 * timeout * 1000:g} ms after "
                        "it started; not retried, so two attempts never overlap")
            abandoned = rt.abandoned
            if abandoned >= ABANDON_CAP:
                raise StageTimeout(
                    f"{abandoned} earlier calls of this replica are still running past "
                    f"timeout_ms={c.timeout_ms:g} (the operator ignores cancellation); "
                    "refusing new calls until one returns")
            # a map or branch call gets a cancel of its own per attempt; a batch window's
            # records are handed over untouched
            call_arg, cancels = _with_cancel(arg) if rt.kind != "collect" else (arg, [])
            fut = asyncio.ensure_future(run_blocking(call, call_arg))
            try:
                done, _ = await asyncio.wait({fut}, timeout=timeout)
            except asyncio.CancelledError:  # the run is ending (Ctrl-C): stop the call too
                for ev in cancels:
                    ev.set()
                raise
            if fut in done:
                return _restore_cancel(fut.result())
            for ev in cancels:
                ev.set()
            rt.abandoned = abandoned + 1
            fut.add_done_callback(lambda f, rt=rt: _returned(rt, f))
            running = fut
            raise TimeoutError
        except TimeoutError as e:
            meter.timeouts += 1
            last: BaseException = StageTimeout(
                f"operator took longer than timeout_ms={c.timeout_ms:g}") \
                if not isinstance(e, StageTimeout) else e
        except StageTimeout as e:  # refused: retrying now would not help
            e.attempts = attempts  # type: ignore[attr-defined]
            raise
        except Exception as e:  # noqa: BLE001 - operator code may raise anything
            last = e
        if attempts > c.retries:
            last.attempts = attempts  # type: ignore[attr-defined]
            raise last
        meter.retries += 1


def _returned(rt: OpRuntime, fut: asyncio.Future) -> None:
    """An abandoned attempt came back: it no longer counts against the cap."""
    rt.abandoned -= 1
    if not fut.cancelled():
        fut.exception()  # retrieved: its late failure is not "never retrieved"
