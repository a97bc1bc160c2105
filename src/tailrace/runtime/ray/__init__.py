"""The Ray runtime: the same compiled Plan on a Ray cluster (``tr.run(p, runtime="ray")``).

One responsibility per module; docs/architecture.md ("The same plan on Ray") walks them.
The runs in progress are listed only where a caller holds an ``ActiveRuns`` and passes
it in (``runs=``); no module keeps them. Nothing here imports Ray at import time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...compiler import Plan
from ..stats import RayRunStats, RayStageStats
from .connect import RayUnavailable, connect, import_ray

__all__ = ["ActiveRuns", "RayRunStats", "RayStageStats", "RayUnavailable", "run_on_ray",
           "serving_run"]


class ActiveRuns:
    """The Ray runs in progress that one caller watches (a serving hub, a test): pass it
    as ``runs=`` to ``tr.run(runtime="ray")``, ``run_on_ray`` or
    ``PipelineService(runtime="ray")``; a run is listed from its start to its end."""

    def __init__(self) -> None:
        self._runs: dict[str, Any] = {}  # run id -> RayRun

    async def execute(self, run: Any) -> None:
        """``await run.execute()`` of a ``RayRun``, listed here meanwhile."""
        self._runs[run.run_id] = run
        try:
            await run.execute()
        finally:
            self._runs.pop(run.run_id, None)

    def describe(self) -> list[dict[str, Any]]:
        """``RayRun.describe()`` of each run in progress: its pipeline, run id, stage
        actors (name, node id: e.g. to inspect or kill one), active replicas, scale events."""
        return [r.describe() for r in list(self._runs.values())]


class RayInterrupted(Exception):
    """Ctrl-C stopped a Ray run; ``stats`` holds its partial statistics."""

    def __init__(self, stats: RayRunStats) -> None:
        super().__init__("run interrupted")
        self.stats = stats


def serving_run(plan: Plan, *, inputs: dict[str, Any], outputs: dict[str, Any],
                on_error: Callable[[ErrorRecord], None], on_drop: Callable[[str, list], None],
                on_ready: Callable[[], None], admission: Any = None,
                address: str | None = None, placement: dict | None = None) -> Any:
    """A ``RayRun`` for a served pipeline (``PipelineService(runtime="ray")``), this
    process connected to Ray; ``await run.execute()`` runs it until its source ends.
    Blocks while connecting (call it off the serving loop).

    on_drop:           records that end unanswered (found by the ``REQUEST`` every record
                       keeps; live in the driver: ``served.py``).
    on_ready:          called once every stage replica is installed.
    Other arguments as ``run_on_ray``; raises ``RayUnavailable``, ``PlanError``.
    """
    return _ray_run(plan, address, placement, inputs=inputs, outputs=outputs,
                    on_error=on_error, admission=admission, on_drop=on_drop,
                    on_ready=on_ready)


def run_on_ray(plan: Plan, *, inputs: dict[str, Any], outputs: dict[str, Any],
               on_error: Callable[[ErrorRecord], None], admission: Any = None,
               address: str | None = None, placement: dict | None = None,
               runs: ActiveRuns | None = None) -> RayRunStats:
    """Run ``plan`` on Ray and return its statistics (``tr.run(p, runtime="ray")``).

    inputs, outputs: data and targets of the sources and sinks declared without them, by
                     operator id (``bind_io``); on_error receives each ``ErrorRecord``;
                     the other arguments as ``tr.run``.
    Raises ``RayUnavailable`` (no Ray, unreachable address), ``PlanError`` (e.g. an
    operator that cannot be serialised) before any actor starts, ``RayInterrupted``.
    """
    rr = _ray_run(plan, address, placement, inputs=inputs, outputs=outputs,
                  on_error=on_error, admission=admission)
    t0 = perf_counter()
    try:
        asyncio.run(rr.execute() if runs is None else runs.execute(rr))
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise RayInterrupted(rr.stats(perf_counter() - t0, True)) from None
    return rr.stats(perf_counter() - t0, False)


def _ray_run(plan: Plan, address: str | None, placement: dict | None, **options: Any) -> Any:
    """A ``RayRun`` of ``plan`` (its operators' serialisation checked), this process
    connected to Ray."""
    import_ray()
    from .driver import RayRun
    from .placement import parse_placement

    rr = RayRun(plan, placements=parse_placement(plan, placement), **options)
    connect(address)
    return rr
