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
    """One pipeline as a scrape sees it; ``histograms`` and ``queue_depth`` by operator id
    (operators without a queue may have no histograms)."""

    name: str  # label ``pipeline``
    ready: bool  # it serves requests
    stats: RunStats  # live
    histograms: Mapping[str, StageHistograms] = field(default_factory=dict)
    queue_depth: Mapping[str, int] = field(default_factory=dict)  # records in its queue now
    latency: Histogram | None = None  # end to end (arrival to sink)
    spend: Mapping[str, float] = field(default_factory=dict)  # tenant -> priced calls' cost


@dataclass(frozen=True)
class Scrape:
    """Everything one scrape reports."""

    pipelines: tuple[PipelineScrape, ...]  # the served pipelines
    admission: Any = None  # the admission gate's ``AdmissionStatistics``, or None
    pools: tuple[Any, ...] = ()  # engine pools' ``PoolStatistics``
    http: Any = None  # an ``HttpMeter``
    ledgers: Mapping[str, Any] = field(default_factory=dict)  # budgeted routes' ledgers


class HttpMeter:
    """Duration histograms and status counts of HTTP requests, by method and route.

    Updated once per request from the event loop; read by scrapes (frozen copies).
    """

    __slots__ = ("durations", "statuses")

    def __init__(self) -> None:
        self.durations: dict[tuple[str, str], Histogram] = {}
        self.statuses: dict[tuple[str, str, int], int] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one finished request: its route template (``/v1/pipelines/{name}/runs``,
        never a raw path), its status (0 if none was sent) and its seconds from arrival to
        the end of the response."""
        h = self.durations.get((method, route))
        if h is None:
            h = self.durations[(method, route)] = Histogram()
        h.record(seconds * 1e6)
        key = (method, route, status)
        self.statuses[key] = self.statuses.get(key, 0) + 1


def prom_buckets(h: Histogram, exponents: range, scale: float,
                 offset: int = 0) -> tuple[list[tuple[str, float]], int]:
    """Cumulative Prometheus buckets of ``h`` at edges ``(2**k + offset) * scale`` for each k
    of ``exponents``; ``scale`` converts units (1e-6: microseconds to seconds), ``offset``
    -1 suits integer-valued data such as batch sizes."""
    below, total = h.counts_below(exponents)
    out = [(_go(((1 << k) + offset) * scale), float(n))
           for k, n in zip(exponents, below, strict=True)]
    out.append(("+Inf", float(total)))
    return out, total


def _go(v: float) -> str:
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}.0"
    return repr(v)


def _observe(family: Any, labels: list[str], h: Histogram, exponents: range = LATENCY_EXPONENTS,
             scale: float = 1e-6, offset: int = 0) -> None:
    """Add histogram ``h`` to ``family`` (latencies by default: microseconds to seconds)."""
    buckets, _ = prom_buckets(h, exponents, scale, offset)
    family.add_metric(labels, buckets, h.total * scale)


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
        yield from ledger_families(scrape.ledgers)


_LEDGER = (("requests", "Requests a budgeted route stage took"),
           ("solved", "Requests it answered with a verified answer"),
           ("exhausted", "Requests its budget stopped (or its policy declined)"),
           ("unsolved", "Requests no provider's answer passed"),
           ("revenue", "What solved requests paid (their budget, or the stage's revenue)"),
           ("spend", "What its provider calls cost"))


def ledger_families(ledgers: Mapping[str, Any]) -> list[Any]:
    """Budgeted route ledgers (``operators.allocate``) by stage label and tenant
    (``tenant=""``: every request), and the margin (revenue - spend)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fams = {k: CounterMetricFamily(f"tailrace_allocation_{k}", doc, labels=["label", "tenant"])
            for k, doc in _LEDGER}
    margin = GaugeMetricFamily("tailrace_allocation_margin", "Revenue minus spend",
                               labels=["label", "tenant"])
    for label, led in sorted(ledgers.items()):
        for tenant, acc in [("", led), *sorted(led["tenants"].items())]:
            for k, fam in fams.items():
                fam.add_metric([label, tenant], acc[k])
            margin.add_metric([label, tenant], acc["margin"])
    return [*fams.values(), margin] if ledgers else []


def http_families(meter: HttpMeter) -> list[Any]:
    """HTTP request durations and response counts by route (``HttpMeter``)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    dur = HistogramMetricFamily("tailrace_http_request_duration_seconds",
                                "HTTP request time, arrival to the end of the response",
                                labels=["method", "route"])
    for (method, route), h in sorted(list(meter.durations.items())):
        _observe(dur, [method, route], h)
    resp = CounterMetricFamily("tailrace_http_responses", "HTTP responses by status",
                               labels=["method", "route", "status"])
    for (method, route, status), n in sorted(list(meter.statuses.items())):
        resp.add_metric([method, route, str(status)], n)
    return [dur, resp]


def pipeline_families(pipelines: Iterable[PipelineScrape]) -> list[Any]:
    """Per-pipeline and per-stage families: counts, errors, histograms, queue depth."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    def stage(kind: Any, name: str, doc: str) -> Any:
        return kind(f"tailrace_stage_{name}", doc, labels=["pipeline", "stage", "op"])

    def pipeline(kind: Any, name: str, doc: str) -> Any:
        return kind(f"tailrace_pipeline_{name}", doc, labels=["pipeline"])

    c = {name: stage(CounterMetricFamily, name, doc)
         for name, doc in (("records_in", "Records that entered the stage"),
                           ("records_out", "Records the stage emitted"),
                           ("errors", "Records the stage failed (error records)"),
                           ("dropped", "Records a filter dropped (counted, no error)"),
                           ("retries", "Operator calls retried"),
                           ("timeouts", "Operator calls that timed out"))}
    wait = stage(HistogramMetricFamily, "queue_wait_seconds",
                 "Time records spent in the stage's input queue")
    svc = stage(HistogramMetricFamily, "service_seconds",
                "Operator time per record (micro-batch time / its length)")
    batch = stage(HistogramMetricFamily, "batch_size", "Records per operator call")
    depth = stage(GaugeMetricFamily, "queue_depth", "Records in the stage's input queue now")
    depth_max = stage(GaugeMetricFamily, "queue_depth_max",
                      "Most records the stage's input queue held")
    bound = stage(GaugeMetricFamily, "queue_bound", "Bound of the stage's input queue (records)")
    own = CounterMetricFamily("tailrace_stage_counter", "What the stage's operator counts "
                              "(tokens, cost, solved, ...)", labels=["pipeline", "stage", "op",
                                                                     "counter"])
    req = pipeline(CounterMetricFamily, "requests", "Records that entered the pipeline")
    resp = pipeline(CounterMetricFamily, "responses", "Records that left the pipeline at a sink")
    errs = pipeline(CounterMetricFamily, "errors", "Error records of the pipeline")
    ready = pipeline(GaugeMetricFamily, "ready", "1 when the pipeline serves requests")
    lat = pipeline(HistogramMetricFamily, "latency_seconds", "End-to-end latency, arrival to sink")
    spend = CounterMetricFamily("tailrace_pipeline_spend", "What the answers' priced engine "
                                "calls cost, by tenant ('': none)", labels=["pipeline", "tenant"])
    for p in pipelines:
        st = p.stats
        # a live run adds its sources' counts to records_in only when they end
        req.add_metric([p.name], max(st.records_in, sum(s.records_out for s in st.stages
                                                        if s.op == "source")))
        resp.add_metric([p.name], st.records_out)
        errs.add_metric([p.name], st.errors)
        ready.add_metric([p.name], 1.0 if p.ready else 0.0)
        if p.latency is not None:
            _observe(lat, [p.name], p.latency)
        for tenant, v in sorted(p.spend.items()):
            spend.add_metric([p.name, tenant], v)
        for s in st.stages:
            labels = [p.name, s.stage, s.op]
            for name in c:
                c[name].add_metric(labels, getattr(s, name))
            for name, v in sorted(s.counters.items()):
                own.add_metric([*labels, name], v)
            h = p.histograms.get(s.stage)
            if h is not None:
                if s.queue_bound:
                    _observe(wait, labels, h.queue_wait)
                _observe(svc, labels, h.service)
                _observe(batch, labels, h.batch_size, BATCH_EXPONENTS, 1.0, offset=-1)
            if s.queue_bound:
                depth.add_metric(labels, p.queue_depth.get(s.stage, 0))
                depth_max.add_metric(labels, s.max_queue_depth)
                bound.add_metric(labels, s.queue_bound)
    return [req, resp, errs, ready, lat, spend, *c.values(), wait, svc, batch, depth,
            depth_max, bound, own]


def admission_families(a: Any) -> list[Any]:
    """The admission gate's decisions and its queue (an ``AdmissionStatistics``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def family(kind: Any, name: str, doc: str, *labels: str) -> Any:
        return kind(f"tailrace_admission_{name}", doc, labels=["policy", *labels])

    pol = [a.policy]
    admitted = family(CounterMetricFamily, "admitted", "Requests admitted")
    admitted.add_metric(pol, a.admitted)
    completed = family(CounterMetricFamily, "completed", "Admitted requests that finished")
    completed.add_metric(pol, a.completed)
    rejected = family(CounterMetricFamily, "rejected", "Requests rejected (HTTP 429), by reason",
                      "reason")
    for reason, n in sorted(a.rejected.items()):
        rejected.add_metric([a.policy, reason], n)
    in_flight = family(GaugeMetricFamily, "in_flight", "Admitted requests not finished yet")
    in_flight.add_metric(pol, a.in_flight)
    queued = family(GaugeMetricFamily, "queued", "Requests waiting for admission, by pipeline",
                    "pipeline")
    for pipe, n in sorted(a.queue_depth.items()):
        queued.add_metric([a.policy, pipe], n)
    return [admitted, completed, rejected, in_flight, queued]


def pool_families(pools: Iterable[Any]) -> list[Any]:
    """Engine pool utilisation: busy replicas, in-flight batches, prefix cache hits per
    replica (``PoolStatistics``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name: str, doc: str, *labels: str) -> Any:
        return GaugeMetricFamily(f"tailrace_pool_{name}", doc, labels=["pool", *labels])

    def counter(name: str, doc: str, *labels: str) -> Any:
        return CounterMetricFamily(f"tailrace_pool_{name}", doc, labels=["pool", *labels])

    up = gauge("replicas_up", "Healthy replicas")
    busy = gauge("replicas_busy", "Replicas running at least one batch")
    util = gauge("utilization", "Busy replicas / healthy replicas (0..1)")
    # (family, the PoolStatistics / ReplicaStatistics field it reports)
    per_pool = [(gauge("queued", "Requests waiting for a batch or replica"), "queued"),
                (counter("batches", "Engine batches formed"), "batches"),
                (counter("retries", "Batches retried on another replica"), "retries"),
                (counter("failed_calls", "Calls that got an error"), "failed_calls")]
    per_replica = [
        (gauge("replica_in_flight", "Batches the replica is running", "replica"), "in_flight"),
        (gauge("replica_outstanding_tokens",
               "Predicted tokens of the batches the replica is running", "replica"),
         "outstanding_work"),
        (counter("replica_requests", "Requests the replica answered", "replica"), "requests"),
        (counter("prompt_tokens", "Prompt tokens of the generations the replica returned",
                 "replica"), "prompt_tokens"),
        (counter("cache_hit_tokens", "Prompt tokens the replica's engine read from its "
                 "prefix cache", "replica"), "cached_tokens"),
        (gauge("cache_hit_ratio", "Cache hit tokens / prompt tokens of the replica (0..1)",
               "replica"), "cache_hit_ratio")]
    for p in pools:
        live = [r for r in p.replicas if r.healthy and not r.down]
        n_busy = sum(1 for r in live if r.in_flight > 0)
        up.add_metric([p.name], len(live))
        busy.add_metric([p.name], n_busy)
        util.add_metric([p.name], n_busy / len(live) if live else 0.0)
        for family, attr in per_pool:
            family.add_metric([p.name], getattr(p, attr))
        for r in p.replicas:
            for family, attr in per_replica:
                family.add_metric([p.name, str(r.id)], getattr(r, attr))
    return [up, busy, util, *(f for f, _ in per_pool), *(f for f, _ in per_replica)]


def merged(histograms: Iterable[Histogram]) -> Histogram:
    """One histogram holding the observations of several (e.g. a stage's replicas)."""
    out = Histogram()
    for h in histograms:
        out.merge(h)
    return out
