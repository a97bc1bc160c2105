"""Render a run's statistics as the per-stage table printed at the end of a run."""

from __future__ import annotations

from .stats import RunStats


def _us(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}s"
    if v >= 1e3:
        return f"{v / 1e3:.1f}ms"
    return f"{v:.0f}us" if v >= 10 else f"{v:.1f}us"


def format_stats(stats: RunStats) -> str:
    """A fixed-width table: one row per stage, queue wait and service percentiles."""
    header = ("stage", "op", "in", "out", "err", "drop", "wait p50", "wait p99",
              "svc p50", "svc p99", "batch", "depth/bound")
    rows = [header]
    for s in stats.stages:
        name = s.stage if s.replicas == 1 else f"{s.stage} x{s.replicas}"
        queued = s.queue_bound > 0  # fused followers and sources have no input queue
        rows.append((
            name, s.op, str(s.records_in), str(s.records_out), str(s.errors), str(s.dropped),
            _us(s.queue_wait_us.p50) if queued else "-",
            _us(s.queue_wait_us.p99) if queued else "-",
            _us(s.service_us.p50), _us(s.service_us.p99), f"{s.batch_size.mean:.1f}",
            f"{s.max_queue_depth}/{s.queue_bound}" if s.queue_bound else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["(wait: time in the stage's input queue; svc: operator time per record; "
             "'-': fused into the stage above, no queue)"]
    for j, r in enumerate(rows):
        cells = [c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    for s in stats.stages:
        if s.counters:
            lines.append(f"{s.stage}: " + ", ".join(
                f"{k} {v:,.0f}" if float(v).is_integer() else f"{k} {v:.4g}"
                for k, v in s.counters.items()))
    lat = stats.latency_us
    rate = stats.records_in / stats.wall_s if stats.wall_s > 0 else 0.0
    lines.append(
        f"{stats.records_in} in, {stats.records_out} out, {stats.errors} errors in "
        f"{stats.wall_s:.3f}s ({rate:,.0f} records/s); end-to-end p50 {_us(lat.p50)} "
        f"p99 {_us(lat.p99)}" + ("; INTERRUPTED" if stats.interrupted else "")
    )
    return "\n".join(lines)
