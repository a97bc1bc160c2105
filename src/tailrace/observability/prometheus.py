"""Prometheus metrics: a collector that reads frozen statistics on scrape, never per record.

The collector asks a ``read()`` callable for a ``Scrape`` (what the pipelines, the admission
gate and the engine pools look like now) and turns it into metric families. Latency
histograms are the runtime's own log-bucketed ``Histogram``s re-bucketed at powers of two
microseconds (4 us .. 67 s): every power of two is a bucket edge there, so the Prometheus
buckets are exact, not estimated from percentiles. Batch sizes use edges 1, 3, 7, .., 1023
(exact for integers). Metric names and labels are listed in docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .stats import Histogram, RunStats

#: Latency bucket edges: 2**k microseconds for k in this range (4 us .. ~67 s).
LATENCY_EXPONENTS = range(2, 27)
#: Batch size bucket edges: 2**k - 1 records for k in this range (1 .. 1023).
BATCH_EXPONENTS = range(1, 11)


@dataclass(frozen=True)
class StageHistograms:
    """One operator's live histograms, merged over its replicas (values in microseconds)."""

    queue_wait: Histogram
    service: Histogram
    batch_size: Histogram


@dataclass(frozen=True)
class PipelineScrape:
    """One pipeline as a scrape sees it.

    name: the pipeline's name (label ``pipeline``).
    ready: whether it serves requests.
    stats: its live ``RunStats``.
    histograms: operator id -> live histograms (operators without a queue may be absent).
    queue_depth: operator id -> records in its input queue now.
    latency: end-to-end latency histogram (arrival to sink), or None.
    """

    name: str
    ready: bool
    stats: RunStats
    histograms: Mapping[str, StageHistograms] = field(default_factory=dict)
    queue_depth: Mapping[str, int] = field(default_factory=dict)
    latency: Histogram | None = None


@dataclass(frozen=True)
class Scrape:
    """Everything one scrape reports.

    pipelines: the served pipelines.
    admission: the admission gate's statistics (``AdmissionStatistics``), or None.
    pools: engine pools' statistics (``PoolStatistics``).
    """

    pipelines: tuple[PipelineScrape, ...]
    admission: Any = None
    pools: tuple[Any, ...] = ()
    http: Any = None


class HttpMeter:
    """Duration histograms and status counts of HTTP requests, by method and route.

    Updated once per request from the event loop; read by scrapes (frozen copies).
    """

    __slots__ = ("durations", "statuses")

    def __init__(self) -> None:
        self.durations: dict[tuple[str, str], Histogram] = {}
        self.statuses: dict[tuple[str, str, int], int] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one finished request.

        method: the HTTP method.
        route: the route template (``/v1/pipelines/{name}/runs``), never a raw path.
        status: the response status (0 if none was sent).
        seconds: from the request's arrival to the end of its response.
        """
        h = self.durations.get((method, route))
        if h is None:
            h = self.durations[(method, route)] = Histogram()
        h.record(seconds * 1e6)
        key = (method, route, status)
        self.statuses[key] = self.statuses.get(key, 0) + 1


def prom_buckets(h: Histogram, exponents: range, scale: float,
                 offset: int = 0) -> tuple[list[tuple[str, float]], int]:
    """Cumulative Prometheus buckets of ``h`` at edges ``(2**k + offset) * scale``.

    h: the histogram.
    exponents: the k of each edge.
    scale: unit conversion of the edges (1e-6: microseconds to seconds).
    offset: added to each power of two (-1 for integer-valued data such as batch sizes).
    """
    below, total = h.counts_below(exponents)
    out = [(_go(((1 << k) + offset) * scale), float(n))
           for k, n in zip(exponents, below, strict=True)]
    out.append(("+Inf", float(total)))
    return out, total


def _go(v: float) -> str:
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}.0"
    return repr(v)


class TailraceCollector:
    """A prometheus-client collector for tailrace's statistics.

    read: returns the ``Scrape`` to report; called once per scrape.
    """

    def __init__(self, read: Callable[[], Scrape]) -> None:
        self.read = read

    def describe(self) -> list:
        return []  # families depend on the pipelines served; do not pre-register names

    def collect(self) -> Iterator[Any]:
        scrape = self.read()
        yield from pipeline_families(scrape.pipelines)
        if scrape.admission is not None:
            yield from admission_families(scrape.admission)
        yield from pool_families(scrape.pools)
        if scrape.http is not None:
            yield from http_families(scrape.http)


def http_families(meter: HttpMeter) -> list[Any]:
    """HTTP request durations and response counts by route (``HttpMeter``)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    dur = HistogramMetricFamily("tailrace_http_request_duration_seconds",
                                "HTTP request time, arrival to the end of the response",
                                labels=["method", "route"])
    for (method, route), h in sorted(list(meter.durations.items())):
        b, _ = prom_buckets(h, LATENCY_EXPONENTS, 1e-6)
        dur.add_metric([method, route], b, h.total * 1e-6)
    resp = CounterMetricFamily("tailrace_http_responses", "HTTP responses by status",
                               labels=["method", "route", "status"])
    for (method, route, status), n in sorted(list(meter.statuses.items())):
        resp.add_metric([method, route, str(status)], n)
    return [dur, resp]


def pipeline_families(pipelines: Iterable[PipelineScrape]) -> list[Any]:
    """Per-pipeline and per-stage families: counts, errors, histograms, queue depth."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    keys = ["pipeline", "stage", "op"]
    c = {name: CounterMetricFamily(f"tailrace_stage_{name}", doc, labels=keys)
         for name, doc in (("records_in", "Records that entered the stage"),
                           ("records_out", "Records the stage emitted"),
                           ("errors", "Records the stage failed (error records)"),
                           ("dropped", "Records a filter dropped (counted, no error)"),
                           ("retries", "Operator calls retried"),
                           ("timeouts", "Operator calls that timed out"))}
    wait = HistogramMetricFamily("tailrace_stage_queue_wait_seconds",
                                 "Time records spent in the stage's input queue", labels=keys)
    svc = HistogramMetricFamily("tailrace_stage_service_seconds",
                                "Operator time per record (micro-batch time / its length)",
                                labels=keys)
    batch = HistogramMetricFamily("tailrace_stage_batch_size",
                                  "Records per operator call", labels=keys)
    depth = GaugeMetricFamily("tailrace_stage_queue_depth",
                              "Records in the stage's input queue now", labels=keys)
    depth_max = GaugeMetricFamily("tailrace_stage_queue_depth_max",
                                  "Most records the stage's input queue held", labels=keys)
    bound = GaugeMetricFamily("tailrace_stage_queue_bound",
                              "Bound of the stage's input queue (records)", labels=keys)
    p_keys = ["pipeline"]
    req = CounterMetricFamily("tailrace_pipeline_requests", "Records that entered the pipeline",
                              labels=p_keys)
    resp = CounterMetricFamily("tailrace_pipeline_responses",
                               "Records that left the pipeline at a sink", labels=p_keys)
    errs = CounterMetricFamily("tailrace_pipeline_errors", "Error records of the pipeline",
                               labels=p_keys)
    ready = GaugeMetricFamily("tailrace_pipeline_ready", "1 when the pipeline serves requests",
                              labels=p_keys)
    lat = HistogramMetricFamily("tailrace_pipeline_latency_seconds",
                                "End-to-end latency, arrival to sink", labels=p_keys)
    for p in pipelines:
        st = p.stats
        # a live run adds its sources' counts to records_in only when they end
        req.add_metric([p.name], max(st.records_in, sum(s.records_out for s in st.stages
                                                        if s.op == "source")))
        resp.add_metric([p.name], st.records_out)
        errs.add_metric([p.name], st.errors)
        ready.add_metric([p.name], 1.0 if p.ready else 0.0)
        if p.latency is not None:
            b, _ = prom_buckets(p.latency, LATENCY_EXPONENTS, 1e-6)
            lat.add_metric([p.name], b, p.latency.total * 1e-6)
        for s in st.stages:
            labels = [p.name, s.stage, s.op]
            for name in c:
                c[name].add_metric(labels, getattr(s, name))
            h = p.histograms.get(s.stage)
            if h is not None:
                if s.queue_bound:
                    b, _ = prom_buckets(h.queue_wait, LATENCY_EXPONENTS, 1e-6)
                    wait.add_metric(labels, b, h.queue_wait.total * 1e-6)
                b, _ = prom_buckets(h.service, LATENCY_EXPONENTS, 1e-6)
                svc.add_metric(labels, b, h.service.total * 1e-6)
                b, _ = prom_buckets(h.batch_size, BATCH_EXPONENTS, 1.0, offset=-1)
                batch.add_metric(labels, b, h.batch_size.total)
            if s.queue_bound:
                depth.add_metric(labels, p.queue_depth.get(s.stage, 0))
                depth_max.add_metric(labels, s.max_queue_depth)
                bound.add_metric(labels, s.queue_bound)
    return [req, resp, errs, ready, lat, *c.values(), wait, svc, batch, depth, depth_max, bound]


def admission_families(a: Any) -> list[Any]:
    """The admission gate's decisions and its queue (an ``AdmissionStatistics``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    pol = [a.policy]
    admitted = CounterMetricFamily("tailrace_admission_admitted", "Requests admitted",
                                   labels=["policy"])
    admitted.add_metric(pol, a.admitted)
    completed = CounterMetricFamily("tailrace_admission_completed",
                                    "Admitted requests that finished", labels=["policy"])
    completed.add_metric(pol, a.completed)
    rejected = CounterMetricFamily("tailrace_admission_rejected",
                                   "Requests rejected (HTTP 429), by reason",
                                   labels=["policy", "reason"])
    for reason, n in sorted(a.rejected.items()):
        rejected.add_metric([a.policy, reason], n)
    in_flight = GaugeMetricFamily("tailrace_admission_in_flight",
                                  "Admitted requests not finished yet", labels=["policy"])
    in_flight.add_metric(pol, a.in_flight)
    queued = GaugeMetricFamily("tailrace_admission_queued",
                               "Requests waiting for admission, by pipeline",
                               labels=["policy", "pipeline"])
    for pipe, n in sorted(a.queue_depth.items()):
        queued.add_metric([a.policy, pipe], n)
    return [admitted, completed, rejected, in_flight, queued]


def pool_families(pools: Iterable[Any]) -> list[Any]:
    """Engine pool utilisation: busy replicas, in-flight batches (``PoolStatistics``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    k, rk = ["pool"], ["pool", "replica"]
    up = GaugeMetricFamily("tailrace_pool_replicas_up", "Healthy replicas", labels=k)
    busy = GaugeMetricFamily("tailrace_pool_replicas_busy",
                             "Replicas running at least one batch", labels=k)
    util = GaugeMetricFamily("tailrace_pool_utilization",
                             "Busy replicas / healthy replicas (0..1)", labels=k)
    queued = GaugeMetricFamily("tailrace_pool_queued", "Requests waiting for a batch or replica",
                               labels=k)
    batches = CounterMetricFamily("tailrace_pool_batches", "Engine batches formed", labels=k)
    retries = CounterMetricFamily("tailrace_pool_retries", "Batches retried on another replica",
                                  labels=k)
    failed = CounterMetricFamily("tailrace_pool_failed_calls", "Calls that got an error",
                                 labels=k)
    in_flight = GaugeMetricFamily("tailrace_pool_replica_in_flight",
                                  "Batches the replica is running", labels=rk)
    work = GaugeMetricFamily("tailrace_pool_replica_outstanding_tokens",
                             "Predicted tokens of the batches the replica is running", labels=rk)
    served = CounterMetricFamily("tailrace_pool_replica_requests",
                                 "Requests the replica answered", labels=rk)
    for p in pools:
        live = [r for r in p.replicas if r.healthy and not r.down]
        n_busy = sum(1 for r in live if r.in_flight > 0)
        up.add_metric([p.name], len(live))
        busy.add_metric([p.name], n_busy)
        util.add_metric([p.name], n_busy / len(live) if live else 0.0)
        queued.add_metric([p.name], p.queued)
        batches.add_metric([p.name], p.batches)
        retries.add_metric([p.name], p.retries)
        failed.add_metric([p.name], p.failed_calls)
        for r in p.replicas:
            rid = [p.name, str(r.id)]
            in_flight.add_metric(rid, r.in_flight)
            work.add_metric(rid, r.outstanding_work)
            served.add_metric(rid, r.requests)
    return [up, busy, util, queued, batches, retries, failed, in_flight, work, served]


def merged(histograms: Iterable[Histogram]) -> Histogram:
    """One histogram holding the observations of several (e.g. a stage's replicas)."""
    out = Histogram()
    for h in histograms:
        out.merge(h)
    return out
