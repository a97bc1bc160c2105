"""What a simulation found: per pipeline latency, throughput and SLO attainment (exact
percentiles over every request), the per-stage table a real run prints, the pools'
batching and load; and the capacity search (``--find``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..observability.stats import RunStats
from ..observability.table import format_stats
from .simulator import Simulation
from .workload import Arrival


@dataclass(frozen=True)
class PipelineResult:
    """One pipeline's requests in a simulation (latencies in seconds, from arrival)."""

    pipeline: str
    arrivals: int
    ok: int
    errors: int
    rejected: int
    p50_s: float
    p95_s: float
    p99_s: float
    mean_s: float
    throughput: float  # requests answered per second, first arrival to last end
    slo_p99_ms: float | None
    slo_attainment: float | None  # answered within the SLO / arrivals
    recorded_p50_s: float | None = None  # the trace's own latencies, when replayed
    recorded_p99_s: float | None = None


def _pct(xs: Any, q: float) -> float:
    import numpy as np

    return float(np.percentile(xs, q)) if len(xs) else 0.0


def summarize(sim: Simulation, arrivals: Sequence[Arrival], wall_s: float) -> dict[str, Any]:
    """The figures of a finished simulation, as a JSON-ready dict."""
    import numpy as np

    out: dict[str, Any] = {"pipelines": {}, "pools": {}}
    for name, pipe in sim.pipelines.items():
        rows = [r for r in sim.results if r[0] == name]
        ok = np.array([e - a for _, a, e, o in rows if o == "ok"])
        ends = [e for _, _, e, o in rows if o == "ok"]
        first = min((a for _, a, _, _ in rows), default=0.0)
        span = (max(ends) - first) if ends else 0.0
        slo = pipe.plan.pipeline.slo or {}
        budget = slo.get("p99_ms")
        recorded = np.array([a.latency_s for a in arrivals
                             if a.pipeline == name and a.latency_s is not None
                             and a.outcome in (None, "ok")])
        res = PipelineResult(
            name, len(rows), len(ok), sum(1 for r in rows if r[3] == "error"),
            sum(1 for r in rows if r[3] == "rejected"), _pct(ok, 50), _pct(ok, 95),
            _pct(ok, 99), float(ok.mean()) if len(ok) else 0.0,
            len(ok) / span if span > 0 else 0.0, budget,
            float((ok <= budget / 1000.0).sum()) / len(rows) if budget and rows else None,
            _pct(recorded, 50) if len(recorded) else None,
            _pct(recorded, 99) if len(recorded) else None)
        out["pipelines"][name] = res.__dict__
    for name, d in sim.pools.items():
        st = d.pool.statistics()
        horizon = sim.loop.now() or 1.0
        out["pools"][name] = {
            "replicas": len(st.replicas), "batches": st.batches,
            "mean_batch_size": st.mean_batch_size, "retries": st.retries,
            "failed_calls": st.failed_calls,
            "restarts": sum(r.restarts for r in st.replicas),
            "continuous": d.profile.kind == "continuous",
            "utilization": sum(r.busy_s for r in d.replicas) / (horizon * len(d.replicas)),
            "cache_hit_ratio": (sum(r.cached_tokens for r in st.replicas)
                                / max(sum(r.prompt_tokens for r in st.replicas), 1))}
    rejected = sim.policy.statistics().rejected
    out["admission"] = {"policy": sim.policy.name, "rejected": dict(rejected)}
    out["simulated_s"] = sim.loop.now()
    out["wall_s"] = wall_s
    out["requests_per_wall_s"] = len(sim.results) / wall_s if wall_s > 0 else 0.0
    out["events"] = sim.loop.events
    out["stages"] = [m.statistics().to_dict() for m in sim.stage_meters()]
    return out


def render(sim: Simulation, summary: dict[str, Any]) -> str:
    """The text a user reads: the per-stage table, then per pipeline and per pool."""
    stages = tuple(m.statistics() for m in sim.stage_meters())
    n = len(sim.results)
    ok = sum(p["ok"] for p in summary["pipelines"].values())
    table = format_stats(RunStats(stages, n, ok, n - ok, summary["simulated_s"]))
    lines = [table.rsplit("\n", 1)[0] if "end-to-end" in table.rsplit("\n", 1)[-1] else table,
             ""]
    head = ("pipeline", "requests", "ok", "err", "rejected", "p50", "p95", "p99", "req/s",
            "SLO met")
    rows: list[tuple[str, ...]] = [head]
    for p in summary["pipelines"].values():
        met = ("-" if p["slo_attainment"] is None
               else f"{100 * p['slo_attainment']:.1f}% of {p['slo_p99_ms']:g}ms")
        rows.append((p["pipeline"], str(p["arrivals"]), str(p["ok"]), str(p["errors"]),
                     str(p["rejected"]), _s(p["p50_s"]), _s(p["p95_s"]), _s(p["p99_s"]),
                     f"{p['throughput']:.2f}", met))
    lines += _table(rows)
    for p in summary["pipelines"].values():
        if p["recorded_p50_s"] is not None:
            lines.append(f"{p['pipeline']}: recorded in the trace p50 {_s(p['recorded_p50_s'])}"
                         f" p99 {_s(p['recorded_p99_s'])}; simulated p50 {_s(p['p50_s'])} "
                         f"p99 {_s(p['p99_s'])}")
    for name, p in summary["pools"].items():
        lines.append(f"engine {name}: {p['replicas']} replicas, {p['utilization']:.0%} busy, "
                     f"{p['batches']} batches of {p['mean_batch_size']:.1f}, "
                     f"{p['retries']} retried, {p['failed_calls']} failed calls, "
                     f"{p['restarts']} restarts"
                     + (f", prefix cache hits {p['cache_hit_ratio']:.0%} of prompt tokens"
                        if p["continuous"] else ""))
    rej = summary["admission"]["rejected"]
    lines.append(f"admission {summary['admission']['policy']}: "
                 + (", ".join(f"{v} {k}" for k, v in rej.items()) or "no rejections"))
    lines.append(f"simulated {summary['simulated_s']:.1f}s of traffic ({n} requests, "
                 f"{summary['events']} events) in {summary['wall_s']:.1f}s: "
                 f"{summary['requests_per_wall_s']:.0f} requests/s")
    return "\n".join(lines)


def _s(x: float) -> str:
    return f"{x * 1000:.0f}ms" if x < 10 else f"{x:.1f}s"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                             for i, c in enumerate(r)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def find_least(run: Callable[[int], dict[str, Any]], meets: Callable[[dict[str, Any]], bool],
               most: int, progress: Callable[[int, dict[str, Any], bool], None]) -> int | None:
    """The least n in 1..``most`` for which ``meets(run(n))``, assuming more never hurts:
    doubling, then bisection; None if even ``most`` does not."""
    tried: dict[int, bool] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            summary = run(n)
            tried[n] = meets(summary)
            progress(n, summary, tried[n])
        return tried[n]

    lo, hi = 0, 1
    while not ok(hi):
        if hi >= most:
            return None
        lo, hi = hi, min(hi * 2, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
