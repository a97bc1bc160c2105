"""Counters and log-bucketed histograms for stages; frozen snapshots for readers.

A ``Histogram`` costs one ``math.frexp`` and a list increment per observation and is
observed per micro-batch (weighted by the batch length), never per record, so the hot
path carries no formatting or allocation. Readers (the stats table, ``--metrics-json``,
the Prometheus metrics of ``tailrace serve``) only see the frozen dataclasses returned by
``statistics()`` and the bucket counts of ``Histogram.counts_below``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

_SUB = 16  # sub-buckets per power of two: ~3% relative error
_MIN_EXP = -20  # 2**-20 us ~ 1 ps: anything smaller lands in bucket 0
_MAX_EXP = 44  # 2**44 us ~ 200 days
_NBUCKETS = (_MAX_EXP - _MIN_EXP) * _SUB
_OFFSET = -_MIN_EXP * _SUB - _SUB  # bucket (e - _MIN_EXP) * _SUB + int((m - 0.5) * 2 * _SUB)


@dataclass(frozen=True)
class HistogramStats:
    """A snapshot of a histogram; values in microseconds."""

    count: int
    mean: float
    min: float
    max: float
    p50: float
    p95: float
    p99: float

    def to_dict(self) -> dict:
        return asdict(self)


_EMPTY = HistogramStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class Histogram:
    """Log-linear histogram of non-negative values (microseconds by convention)."""

    __slots__ = ("_counts", "count", "total", "min", "max")

    def __init__(self) -> None:
        self._counts = [0] * _NBUCKETS
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = 0.0

    def record(self, value: float, n: int = 1, _frexp: Any = math.frexp) -> None:
        """Add ``n`` observations of ``value``."""
        if value > 0.0:
            m, e = _frexp(value)  # value = m * 2**e, 0.5 <= m < 1
            i = e * _SUB + int(m * (2 * _SUB)) + _OFFSET
            if i < 0:
                i = 0
            elif i >= _NBUCKETS:
                i = _NBUCKETS - 1
        else:
            value = 0.0
            i = 0
        self._counts[i] += n
        self.count += n
        self.total += value * n
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value

    def merge(self, other: Histogram) -> None:
        for i, c in enumerate(other._counts):
            if c:
                self._counts[i] += c
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def quantile(self, q: float) -> float:
        """The value below which a fraction ``q`` of observations fall (bucket midpoint)."""
        if self.count == 0:
            return 0.0
        rank = q * self.count
        seen = 0
        for i, c in enumerate(self._counts):
            if not c:
                continue
            seen += c
            if seen >= rank:
                e, sub = divmod(i, _SUB)
                mid = math.ldexp(0.5 + (sub + 0.5) / (2 * _SUB), e + _MIN_EXP)
                return min(max(mid, self.min), self.max)
        return self.max

    def counts_below(self, exponents: Iterable[int]) -> tuple[list[int], int]:
        """Observations below ``2**k`` for each ``k`` of ``exponents``, and the total, read
        from one copy of the counts (consistent while the run keeps counting).

        >>> h = Histogram(); h.record(3.0); h.record(100.0, n=2)
        >>> h.counts_below([1, 2, 7])
        ([0, 1, 3], 3)
        """
        counts = list(self._counts)
        return [sum(counts[:max(0, (k - _MIN_EXP + 1) * _SUB)]) for k in exponents], sum(counts)

    def statistics(self) -> HistogramStats:
        if self.count == 0:
            return _EMPTY
        return HistogramStats(count=self.count, mean=self.total / self.count, min=self.min,
                              max=self.max, p50=self.quantile(0.50), p95=self.quantile(0.95),
                              p99=self.quantile(0.99))


@dataclass(frozen=True)
class StageStats:
    """What one stage (one operator of the pipeline) did during a run.

    ``queue_wait_us`` is the time records spent in the stage's input channel,
    ``service_us`` the operator time per record (a micro-batch's time divided by
    its length), ``batch_size`` the number of records per operator call.
    """

    stage: str
    op: str
    records_in: int
    records_out: int
    errors: int
    retries: int
    timeouts: int
    queue_wait_us: HistogramStats
    service_us: HistogramStats
    batch_size: HistogramStats
    max_queue_depth: int
    queue_bound: int
    replicas: int
    fused_into: str | None = None
    counters: dict[str, float] = field(default_factory=dict)  # the operator's own counts
    dropped: int = 0  # records a filter said no to (they end here, counted, no error)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunStats:
    """Per-stage statistics of a whole run, plus end-to-end figures."""

    stages: tuple[StageStats, ...]
    records_in: int
    records_out: int
    errors: int
    wall_s: float
    latency_us: HistogramStats = field(default=_EMPTY)
    interrupted: bool = False
    scheduling_us: HistogramStats = field(default=_EMPTY)  # arrival -> first operator start

    def __getitem__(self, stage_id: str) -> StageStats:
        for s in self.stages:
            if s.stage == stage_id:
                return s
        known = ", ".join(s.stage for s in self.stages)
        raise KeyError(f"no stage {stage_id!r} in this run; stages: {known}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stages"] = [s.to_dict() for s in self.stages]
        return d


class StageMeter:
    """Mutable counters one stage updates while running; ``statistics()`` snapshots."""

    __slots__ = (
        "stage", "op", "replicas", "queue_bound", "fused_into", "records_in",
        "records_out", "errors", "retries", "timeouts", "queue_wait", "service",
        "batch_size", "max_queue_depth",
    )

    def __init__(self, stage: str, op: str, *, replicas: int = 1, queue_bound: int = 0,
                 fused_into: str | None = None) -> None:
        self.stage = stage
        self.op = op
        self.replicas = replicas
        self.queue_bound = queue_bound
        self.fused_into = fused_into
        self.records_in = self.records_out = self.errors = self.retries = self.timeouts = 0
        self.queue_wait = Histogram()
        self.service = Histogram()
        self.batch_size = Histogram()
        self.max_queue_depth = 0

    @classmethod
    def combined(cls, meters: list[StageMeter], template: StageMeter | None = None) -> StageMeter:
        """The sum of several replicas' (or incarnations') meters of one operator.

        meters:   the meters to add up (counts and histograms summed, depth: the max).
        template: gives the labels (stage, op, replicas, bound, fusion); default the first.
        """
        t = template or meters[0]
        total = cls(t.stage, t.op, replicas=t.replicas, queue_bound=t.queue_bound,
                    fused_into=t.fused_into)
        for x in meters:
            for name in ("records_in", "records_out", "errors", "retries", "timeouts"):
                setattr(total, name, getattr(total, name) + getattr(x, name))
            total.queue_wait.merge(x.queue_wait)
            total.service.merge(x.service)
            total.batch_size.merge(x.batch_size)
            total.max_queue_depth = max(total.max_queue_depth, x.max_queue_depth)
        return total

    def statistics(self) -> StageStats:
        return StageStats(
            stage=self.stage, op=self.op, records_in=self.records_in,
            records_out=self.records_out, errors=self.errors, retries=self.retries,
            timeouts=self.timeouts, queue_wait_us=self.queue_wait.statistics(),
            service_us=self.service.statistics(), batch_size=self.batch_size.statistics(),
            max_queue_depth=self.max_queue_depth, queue_bound=self.queue_bound,
            replicas=self.replicas, fused_into=self.fused_into,
            # a filter's records end as outputs, errors or drops; nothing else is lost
            dropped=(self.records_in - self.records_out - self.errors
                     if self.op == "filter" else 0),
        )
