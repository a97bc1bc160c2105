"""Executors of a Plan. ``run`` is the entry point: ``tr.run(p)``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from ..api.pipeline import Pipeline
from ..api.records import ErrorRecord
from ..compiler import Plan, compile_pipeline
from ..errors import PlanError, RunInterrupted
from ..observability import RunStats
from .stats import live_stats, local_stats, sum_counters

__all__ = ["RUNTIMES", "RunResult", "bind_io", "live_stats", "local_stats", "run",
           "sum_counters"]

RUNTIMES = ("local", "ray")


@dataclass
class RunResult:
    """What a run produced.

    outputs: records of the run-time-bound sink when ``output=`` was not given.
    errors:  one ``ErrorRecord`` per record that failed (when ``errors=`` was not given).
    stats:   per-stage statistics (``stats["stage_id"]``) and end-to-end figures.
    """

    plan: Plan
    stats: RunStats
    errors: list[ErrorRecord] = field(default_factory=list)
    outputs: list[Any] | None = None


def run(pipeline: Pipeline | Plan, *, runtime: str = "local",
        input: Iterable[Any] | None = None, output: list | Callable | None = None,
        errors: list | Callable[[ErrorRecord], None] | None = None,
        fuse: bool = True, admission: Any = None, address: str | None = None,
        placement: dict | None = None, runs: Any = None, trace: Any = None) -> RunResult:
    """Compile (if needed) and run a pipeline to completion.

    input:   records for a source declared without data (YAML pipelines' ``source``).
    output:  list or callable for a sink declared without a target; if omitted, such
             a sink's records are returned in ``result.outputs``.
    errors:  list or callable receiving each ``ErrorRecord`` as it happens
             (default: collected in ``result.errors``).
    fuse:    fuse chains of stateless operators (False: every operator its own stage).
    admission: an admission gate shared by the pipelines of the process
             (``tailrace.control.AdmissionGate``): each record waits for it; a rejected
             record becomes an error record (stage ``admission``, ``AdmissionRejected``).
    address: runtime="ray" only: the cluster (``HOST:PORT``, ``ray://HOST:PORT``,
             ``auto``); default: the current connection or a new local Ray.
    placement: runtime="ray" only: ``{stage id: {num_cpus, num_gpus, memory,
             resources, strategy: pack|spread}}`` (``docs/ray.md``).
    runs:    runtime="ray" only: a ``tailrace.runtime.ray.ActiveRuns`` that lists the run
             (its stage actors) while it runs.
    trace:   runtime="local" only: a ``tailrace.runtime.trace_out.TraceWriter`` that gets
             one line per record of ``input=`` (dicts) as it ends (``RunTrace``); the
             caller closes it.
    Raises ``PlanError`` for an invalid pipeline and ``RunInterrupted`` (with the
    partial ``.result``) on Ctrl-C.
    """
    if runtime not in RUNTIMES:
        raise PlanError(f"unknown runtime '{runtime}'; choose one of: {', '.join(RUNTIMES)}")
    if runtime != "ray" and (address is not None or placement is not None):
        raise PlanError("address= and placement= apply to runtime='ray' only")
    if runtime != "ray" and runs is not None:
        raise PlanError("runs= lists Ray runs; it applies to runtime='ray' only")
    if runtime == "ray" and trace is not None:
        raise PlanError("trace= applies to runtime='local' only: on Ray a record a stage "
                        "drops is not reported to the driver, so its line would be wrong")
    plan = pipeline if isinstance(pipeline, Plan) else compile_pipeline(pipeline, fuse=fuse)
    from .local import LocalRun

    inputs, outputs, collected = bind_io(plan, input, output)
    error_list: list[ErrorRecord] = []
    errs = error_list if errors is None else errors
    on_error: Callable[[ErrorRecord], None] = errs.append if isinstance(errs, list) else errs
    follow = None
    if trace is not None:
        from .trace_out import RunTrace

        follow = RunTrace(trace, plan)
        inputs, outputs, on_error = follow.bind(inputs, outputs, on_error)
    if runtime == "ray":  # imports Ray only now
        from .ray import RayInterrupted, run_on_ray

        try:
            stats = run_on_ray(plan, inputs=inputs, outputs=outputs, on_error=on_error,
                               admission=admission, address=address, placement=placement,
                               runs=runs)
        except RayInterrupted as e:
            raise RunInterrupted("run interrupted",
                                 RunResult(plan, e.stats, error_list, collected)) from None
        return RunResult(plan, stats, error_list, collected)
    lr = LocalRun(plan, inputs=inputs, outputs=outputs, on_error=on_error,
                  admission=admission, on_drop=follow.drop if follow is not None else None)
    t0 = perf_counter()
    interrupted = True
    try:
        asyncio.run(lr.execute())
        interrupted = False
    except (KeyboardInterrupt, asyncio.CancelledError):
        result = RunResult(plan, local_stats(lr, perf_counter() - t0, True), error_list, collected)
        raise RunInterrupted("run interrupted", result) from None
    except BaseExceptionGroup as eg:  # a bug or a fatal error inside the runtime
        raise eg.exceptions[0] from None
    finally:
        if follow is not None:
            follow.finish(interrupted)
    return RunResult(plan, local_stats(lr, perf_counter() - t0, False), error_list, collected)


def bind_io(plan: Plan, input: Any, output: Any) -> tuple[dict, dict, list | None]:
    """Attach run-time input/output to the sources/sinks declared without them."""
    inputs: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    collected: list | None = None
    open_sources = [o for s in plan.stages for o in s.ops
                    if o.op.kind == "source" and o.params.get("data") is None]
    open_sinks = [o for s in plan.stages for o in s.ops
                  if o.op.kind == "sink" and o.params.get("target") is None]
    if len(open_sources) > 1:
        raise PlanError("several sources have no data; give each source its data")
    if open_sources:
        if input is None:
            raise PlanError("source has no data: pass tr.run(p, input=records)",
                            stage=open_sources[0].id)
        inputs[open_sources[0].id] = input
    elif input is not None:
        raise PlanError("input= given but every source already has data")
    if open_sinks and output is None:
        collected = []
    for o in open_sinks:
        outputs[o.id] = collected if output is None else output
    return inputs, outputs, collected
