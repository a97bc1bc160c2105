"""One stage worker: one replica of a plan stage running batches under its ``Execution``.

The same worker runs every stage of every runtime (local, Ray, served; docs/architecture.md
§4): a runtime only moves batches, hands the worker one and passes on the ports it
returns. The worker calls the operators as the compiler decided (``chain``,
``per_record`` or ``collect``, in its own threads when blocking), turns failures into
error records, reports records that ended without output, and meters every operator.
``run_chain`` is the hot path: two clock reads per operator per micro-batch and no
per-record work beyond the operator itself. Given a ``Trace`` (Ray), it also records
which input each output and error came from (``lineage.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from operator import is_
from time import perf_counter
from typing import Any

from ..api.records import ErrorRecord
from ..compiler import PlanOp, PlanStage
from ..errors import PlanError
from ..observability import StageMeter
from ..operators import OpRuntime
from ..operators.core import per_record
from ..request import REQUEST
from .lineage import Trace, compose, error_positions, fan_out, kept_positions, split_branch
from .policy import call_with_policy

Ports = dict[str | None, list]


def stage_meter(stage: PlanStage, j: int) -> StageMeter:
    """A fresh meter for operator ``j`` of ``stage``, labelled for the stats table."""
    o = stage.ops[j]
    return StageMeter(o.id, o.op.name, replicas=stage.replicas,
                      queue_bound=stage.queue if j == 0 else 0,
                      fused_into=stage.id if len(stage.ops) > 1 else None)


def sink_target(op: PlanOp, outputs: dict[str, Any]) -> Any:
    """The target of a sink operator: its own, or the run's ``output=``."""
    target = op.params.get("target")
    if target is None:
        target = outputs.get(op.id)
    if target is None:
        raise PlanError("sink has no target: pass a list or callable to .sink(...) or "
                        "tr.run(p, output=...)", stage=op.id)
    return target


def sink_runtime(target: Any) -> OpRuntime:
    """A sink's batch function: extend a list or call ``target(record)``."""
    if isinstance(target, list):
        extend = target.extend
        return OpRuntime("sink", batch_fn=lambda batch, errors: extend(batch))
    if not callable(target):
        raise TypeError(f"a sink target must be a list or a callable, got "
                        f"{type(target).__name__}")
    return OpRuntime("sink", batch_fn=per_record(target), record_fn=target)


def write_sink(op_id: str, rt: OpRuntime, m: StageMeter, batch: list,
               errors: list[ErrorRecord]) -> int:
    """Hand a batch to a sink (metered; a record the target refuses becomes an error
    record); returns how many records were written. The caller counted ``records_in``."""
    n = len(batch)
    if not n:
        return 0
    t0 = perf_counter()
    errs: list = []
    rt.batch_fn(batch, errs)  # type: ignore[misc]
    m.service.record((perf_counter() - t0) * 1e6 / n, n)
    m.batch_size.record(n)
    m.records_out += n - len(errs)
    if errs:
        fail_records(op_id, m, errs, errors)
    return n - len(errs)


def fail_records(op_id: str, m: StageMeter, errs: list, errors: list) -> None:
    """Operator ``op_id``'s failed records ``(input, exception)`` as error records."""
    m.errors += len(errs)
    errors.extend(ErrorRecord.from_exception(op_id, x, e) for x, e in errs)


def dropped(before: list, after: list, errs: list, key: str) -> list:
    """The records of ``before`` whose ``key`` no record of ``after`` or ``errs`` has."""
    if not errs and len(after) == len(before):  # one to one (a map): usually in place
        for a, b in zip(after, before, strict=True):
            if a is not b and (type(a) is not dict or type(b) is not dict
                               or a.get(key) != b.get(key)):
                break
        else:
            return []
    kept = {r.get(key) for r in after if isinstance(r, dict)}
    kept.update(x.get(key) for x, _ in errs if isinstance(x, dict))
    return [r for r in before if isinstance(r, dict) and r.get(key) not in kept]


class StageWorker:
    """The operator runtimes, meters and threads of one replica of a stage.

    stage:     the compiled stage (its ``execution`` says how it is called).
    rts:       its operators' runtimes (a runtime may leave out a sink it runs itself).
    drop_hook: ``drop_hook(operator id, records)`` hears of records that ended without
               an output or error (a server answers their requests), found by their
               ``REQUEST``, which every served record keeps. Nothing is checked without it.
    """

    __slots__ = ("ops", "rts", "meters", "execution", "fans", "drop_hook", "run_blocking",
                 "pool", "idle")

    def __init__(self, stage: PlanStage, rts: list[OpRuntime],
                 drop_hook: Callable[[str, list], None] | None = None) -> None:
        assert stage.execution is not None, "a source stage has no worker"
        self.ops = stage.ops
        self.rts = rts
        self.execution = stage.execution
        # fan-out operators: their outputs need ordinals, their replays a commit (lineage)
        self.fans = tuple(o.op.name == "flat_map" for o in stage.ops[:len(rts)])
        self.drop_hook = drop_hook
        self.meters = [stage_meter(stage, j) for j in range(len(stage.ops))]
        self.run_blocking: Callable | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.idle = False  # its runtime's: waiting for input with none buffered

    def start(self, name: str) -> None:
        """Give a blocking stage its own threads (call on the event loop that runs it):
        one dedicated thread (native libraries such as llama.cpp keep per-thread state),
        plus spares for abandoned timed-out calls (``Execution.threads``)."""
        if self.execution.threads:
            self.pool = ThreadPoolExecutor(self.execution.threads,
                                           thread_name_prefix=f"tailrace-{name}")
            self.run_blocking = partial(asyncio.get_running_loop().run_in_executor,
                                        self.pool)

    def stop(self, wait: bool) -> None:
        """Release the threads (``wait``: for running calls, unless one was abandoned
        after a timeout: it cannot be stopped), then what the operators opened
        (``OpRuntime.close``, once)."""
        if self.pool is not None:
            self.pool.shutdown(wait=wait and self.rts[0].abandoned == 0, cancel_futures=True)
        for rt in self.rts:  # what the operators opened for this replica
            if rt.close is not None:
                close, rt.close = rt.close, None
                close()

    async def process(self, batch: list, errors: list[ErrorRecord],
                      trace: Trace | None = None) -> Ports:
        """Run one batch as the stage's execution says; returns port -> records. Failed
        records are appended to ``errors`` as ``ErrorRecord``s."""
        call = self.execution.call
        if call == "collect":
            return {None: await self.call_collect(batch, errors, trace)}
        if call == "per_record" or self.rts[0].is_async:  # or an async custom operator
            return await self.call_per_record(batch, errors, trace)
        if self.run_blocking is not None:
            return await self.run_blocking(self.run_chain, batch, errors, trace)
        return self.run_chain(batch, errors, trace)

    def run_chain(self, batch: list, errors: list, trace: Trace | None = None) -> Ports:
        """Push one micro-batch through the fused operators; returns port -> records."""
        src = None
        meters, drop_hook = self.meters, self.drop_hook
        for i, rt in enumerate(self.rts):
            m = meters[i]
            n = len(batch)
            m.records_in += n
            if not n:
                continue
            kind = rt.kind
            if kind == "sink":
                write_sink(self.ops[i].id, rt, m, batch, errors)
                return {}
            t0 = perf_counter()
            errs: list = []
            fn = rt.batch_fn
            if kind == "map":
                before = batch
                if trace is not None and self.fans[i]:  # lineage: fan out record by record
                    batch, src = fan_out(rt.record_fn, batch, src, errs, trace.esrc)
                    trace.fanned = True
                elif fn is not None:
                    try:
                        batch = fn(batch, errs)
                    except Exception as e:  # noqa: BLE001 - a whole-batch call failed
                        errs = [(x, e) for x in batch]
                        batch = []
                    if trace is not None and (errs or len(batch) != n):
                        failed = error_positions(before, errs)
                        trace.esrc.extend(compose(src, failed))
                        src = compose(src, kept_positions(before, batch, failed))
                        trace.fanned = trace.fanned or len(batch) > n - len(errs)
                dt = perf_counter() - t0
                if (drop_hook is not None and trace is None
                        and (errs or len(batch) != n or not all(map(is_, batch, before)))):
                    gone = dropped(before, batch, errs, REQUEST)
                    if gone:
                        drop_hook(self.ops[i].id, gone)
            elif kind == "branch":
                t, f = fn(batch, errs)  # type: ignore[misc]
                if trace is not None:
                    failed = error_positions(batch, errs)
                    trace.esrc.extend(compose(src, failed))
                    pt, pf = split_branch(batch, t, f, failed)
                    trace.src = {"true": compose(src, pt), "false": compose(src, pf)}
                m.records_out += len(t) + len(f)
                m.service.record((perf_counter() - t0) * 1e6 / n, n)
                m.batch_size.record(n)
                if errs:
                    fail_records(self.ops[i].id, m, errs, errors)
                return {"true": t, "false": f}
            else:  # pragma: no cover - compiler guarantees the kinds above
                raise RuntimeError(f"operator kind {kind!r} cannot run in a chain")
            m.records_out += len(batch)
            m.service.record(dt * 1e6 / n, n)
            m.batch_size.record(n)
            if errs:
                fail_records(self.ops[i].id, m, errs, errors)
        if trace is not None:
            trace.src = {None: src}
        return {None: batch}

    async def call_per_record(self, batch: list, errors: list,
                              trace: Trace | None = None) -> Ports:
        """The stage's one operator record by record, each call under the timeout and
        retries; returns port -> records."""
        op, rt, m, x = self.ops[0], self.rts[0], self.meters[0], self.execution
        out: list = []
        falses: list = []
        pos: list[int] = []
        pos_f: list[int] = []
        branch = rt.kind == "branch"
        t0 = perf_counter()
        m.records_in += len(batch)
        for j, r in enumerate(batch):
            try:
                got = await call_with_policy(x, rt, m, r, self.run_blocking)
            except Exception as e:  # noqa: BLE001 - operator code may raise anything
                m.errors += 1
                errors.append(ErrorRecord.from_exception(op.id, r, e,
                                                         getattr(e, "attempts", 1)))
                if trace is not None:
                    trace.esrc.append(j)
                continue
            if branch:
                (out if got else falses).append(r)
                (pos if got else pos_f).append(j)
            else:
                out.extend(got)
                if trace is not None and got:
                    pos.extend([j] * len(got))
                    trace.fanned = trace.fanned or len(got) > 1
                if not got and self.drop_hook is not None:  # it ended here, no output
                    self.drop_hook(op.id, [r])
        m.records_out += len(out) + len(falses)
        if batch:
            m.service.record((perf_counter() - t0) * 1e6 / len(batch), len(batch))
            m.batch_size.record(1, len(batch))
        if trace is not None:
            trace.src = {"true": pos, "false": pos_f} if branch else {None: pos}
        return {"true": out, "false": falses} if branch else {None: out}

    async def call_collect(self, batch: list, errors: list,
                           trace: Trace | None = None) -> list:
        """A batch-contract operator or a ``batch`` stage: one call for the whole list,
        under the timeout and retries; returns its outputs. Records the operator rejects
        one by one (e.g. a missing field) become error records; a failed call fails the
        batch. Lineage: a group takes its first member's, a batch-contract map is one to
        one."""
        op, rt, m = self.ops[0], self.rts[0], self.meters[0]
        n = len(batch)
        ne = len(errors)
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
            result = await call_with_policy(self.execution, rt, m, batch, self.run_blocking,
                                            strict)
        except Exception as e:  # noqa: BLE001 - every record of the batch failed
            m.errors += n
            attempts = getattr(e, "attempts", 1)
            errors.extend(ErrorRecord.from_exception(op.id, x, e, attempts) for x in batch)
            result = []
        else:
            if rt.kind == "collect":
                result = [result]
            fail_records(op.id, m, rejected, errors)
        m.service.record((perf_counter() - t0) * 1e6 / n, n)
        m.records_out += len(result)
        if trace is not None:
            failed = error_positions(batch, errors[ne:])
            trace.esrc.extend(failed)
            if rt.kind == "collect":
                bad = set(failed)
                first = next((j for j in range(n) if j not in bad), 0)
                trace.src = {None: [first] * len(result)}
                trace.fanned = len(result) > 1
            elif not failed and len(result) == n:
                trace.src = {None: None}
            else:
                trace.src = {None: kept_positions(batch, result, failed)}
                trace.fanned = len(result) > n - len(failed)
        return result
