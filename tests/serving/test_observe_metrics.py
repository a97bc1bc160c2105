"""GET /metrics: Prometheus text that the official parser reads, with per-stage histograms
(exact buckets from the runtime's own histograms) whose counts grow as requests flow."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

import tailrace as tr  # noqa: E402
from tailrace.control import AdmissionGate, make_policy  # noqa: E402
from tailrace.engines.pool import PoolStatistics, ReplicaStatistics  # noqa: E402
from tailrace.observability import Histogram  # noqa: E402
from tailrace.observability.prometheus import BATCH_EXPONENTS, prom_buckets  # noqa: E402
from tailrace.serving import PipelineService, ServingHub  # noqa: E402
from tailrace.serving.observe import install_observability  # noqa: E402


@contextlib.contextmanager
def live_server(hub: ServingHub) -> Iterator[str]:
    """A real uvicorn server for ``create_app(hub)`` on a free loopback port; yields its URL."""
    import uvicorn

    from tailrace.serving import create_app

    # IPPROTO_TCP: asyncio sets TCP_NODELAY only then (else ~40 ms Nagle/delayed-ACK stalls)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(hub), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def slow_double(r: dict) -> dict:
    time.sleep(0.01 if r["x"] == 0 else 0.002)  # x=0 holds admission while others arrive
    return {**r, "y": 2 * r["x"]}


def check_positive(r: dict) -> dict:
    if r["x"] < 0:
        raise ValueError("x must be >= 0")
    return r


def pool_stats() -> PoolStatistics:
    rep = lambda i, busy: ReplicaStatistics(i, None, None, True, False, 40 * busy, busy,  # noqa: E731
                                            10, 30, 0, 0, None, 400 * (i + 1), 100 * i)
    return PoolStatistics("llm", (rep(0, 2), rep(1, 0), rep(2, 1)), 12, 2.5, 3, 4, 0, 1)


@pytest.fixture
def served():
    p = tr.Pipeline("calc")
    p.source(fields=["x"]).map(check_positive, id="check").map(slow_double, id="double").sink()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=1))
    svc = PipelineService(tr.compile_pipeline(p, fuse=False), admission=gate).start()
    assert svc.wait_ready(10)
    hub = ServingHub([svc], gate=gate)
    hub.pools = lambda: {"llm": pool_stats(), "other-engine": object()}  # type: ignore
    app = FastAPI()
    install_observability(app, hub)
    with TestClient(app) as client:
        yield svc, client
    hub.stop()


def submit_all(svc: PipelineService, xs: list[int]) -> list:
    async def go():
        return await asyncio.gather(*(svc.submit({"x": x}) for x in xs), return_exceptions=True)
    return asyncio.run(go())


def scrape(client: TestClient) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(fams: dict, family: str, name: str, **labels) -> float:
    hits = [s.value for s in fams[family].samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, name, labels, fams[family].samples)
    return hits[0]


def test_buckets_are_exact_at_powers_of_two():
    h = Histogram()
    for v in (3.0, 5.0, 100.0, 1e6):
        h.record(v)
    buckets, total = prom_buckets(h, range(2, 21), 1e-6)
    b = dict(buckets)
    assert total == 4 and b["+Inf"] == 4
    assert (b["4e-06"], b["8e-06"], b["6.4e-05"], b["0.000128"], b["0.524288"], b["1.048576"]) \
        == (1, 2, 2, 3, 3, 4)
    sizes = Histogram()
    for n in (1, 2, 3, 4, 8, 8):
        sizes.record(n)
    b = dict(prom_buckets(sizes, BATCH_EXPONENTS, 1.0, offset=-1)[0])
    assert (b["1.0"], b["3.0"], b["7.0"], b["15.0"], b["+Inf"]) == (1, 3, 4, 6, 6)


def test_per_stage_histograms_grow_with_requests(served):
    svc, client = served
    before = scrape(client)
    wait = before["tailrace_stage_queue_wait_seconds"]
    assert wait.type == "histogram"
    n0 = sample(before, "tailrace_stage_service_seconds", "tailrace_stage_service_seconds_count",
                pipeline="calc", stage="double", op="map")
    out = [r for x in range(3) for r in submit_all(svc, [x])]  # one at a time: admitted
    assert [o["y"] for o in out] == [0, 2, 4]
    after = scrape(client)
    for fam in ("tailrace_stage_queue_wait_seconds", "tailrace_stage_service_seconds"):
        count = sample(after, fam, fam + "_count", pipeline="calc", stage="double", op="map")
        inf = sample(after, fam, fam + "_bucket", pipeline="calc", stage="double", op="map",
                     le="+Inf")
        assert count == inf == n0 + 3
        les = [s for s in after[fam].samples if s.name == fam + "_bucket"
               and s.labels["stage"] == "double"]
        counts = [s.value for s in les]
        assert len(les) == 26 and counts == sorted(counts)  # cumulative
    # a 2 ms sleep per record: no observation is below 1.024 ms
    assert sample(after, "tailrace_stage_service_seconds", "tailrace_stage_service_seconds_bucket",
                  stage="double", le="0.001024") == 0
    assert sample(after, "tailrace_stage_records_in", "tailrace_stage_records_in_total",
                  pipeline="calc", stage="check", op="map") == 3
    assert sample(after, "tailrace_pipeline_latency_seconds",
                  "tailrace_pipeline_latency_seconds_count", pipeline="calc") == 3
    assert sample(after, "tailrace_stage_queue_bound", "tailrace_stage_queue_bound",
                  stage="double") == 1024
    assert sample(after, "tailrace_pipeline_ready", "tailrace_pipeline_ready",
                  pipeline="calc") == 1
    assert "process_resident_memory_bytes" in after


def test_errors_admission_and_pools(served):
    svc, client = served
    results = submit_all(svc, [0, -1] + list(range(1, 12)))  # 2 in flight + 1 queued fit
    rejected = [r for r in results if getattr(r, "status", None) == 429]
    failed = [r for r in results if getattr(r, "status", None) == 500]
    assert rejected and len(failed) == 1
    m = scrape(client)
    assert sample(m, "tailrace_stage_errors", "tailrace_stage_errors_total",
                  stage="check") == 1
    assert sample(m, "tailrace_admission_rejected", "tailrace_admission_rejected_total",
                  policy="fcfs", reason="queue_full") == len(rejected)
    assert sample(m, "tailrace_admission_admitted", "tailrace_admission_admitted_total",
                  policy="fcfs") == 13 - len(rejected)
    assert sample(m, "tailrace_pool_utilization", "tailrace_pool_utilization",
                  pool="llm") == pytest.approx(2 / 3)
    assert sample(m, "tailrace_pool_replica_in_flight", "tailrace_pool_replica_in_flight",
                  pool="llm", replica="0") == 2
    assert sample(m, "tailrace_pool_replicas_busy", "tailrace_pool_replicas_busy",
                  pool="llm") == 2
    assert sample(m, "tailrace_pool_cache_hit_tokens", "tailrace_pool_cache_hit_tokens_total",
                  pool="llm", replica="2") == 200
    assert sample(m, "tailrace_pool_prompt_tokens", "tailrace_pool_prompt_tokens_total",
                  pool="llm", replica="2") == 1200
    assert sample(m, "tailrace_pool_cache_hit_ratio", "tailrace_pool_cache_hit_ratio",
                  pool="llm", replica="1") == pytest.approx(100 / 800)


def test_metrics_over_http_grow_with_requests():
    """The real app on uvicorn: POST runs, then /metrics shows them per stage."""
    httpx = pytest.importorskip("httpx")
    p = tr.Pipeline("calc")
    p.source(fields=["x"]).map(check_positive, id="check").map(slow_double, id="double").sink()
    svc = PipelineService(tr.compile_pipeline(p, fuse=False)).start()
    hub = ServingHub([svc])
    try:
        assert svc.wait_ready(10)
        with live_server(hub) as url, httpx.Client(base_url=url, timeout=10) as http:
            m0 = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
            for x in (1, 2, -1):
                http.post("/v1/pipelines/calc/runs", json={"x": x})
            r = http.get("/metrics")
            assert r.status_code == 200
            m1 = {f.name: f for f in text_string_to_metric_families(r.text)}
    finally:
        hub.stop()
    name = "tailrace_stage_service_seconds"
    assert sample(m0, name, name + "_count", stage="double") == 0
    assert sample(m1, name, name + "_count", stage="double") == 2
    assert sample(m1, "tailrace_stage_errors", "tailrace_stage_errors_total", stage="check") == 1
    assert sample(m1, "tailrace_pipeline_requests", "tailrace_pipeline_requests_total",
                  pipeline="calc") == 3
    route = {"method": "POST", "route": "/v1/pipelines/{name}/runs"}
    dur = "tailrace_http_request_duration_seconds"
    assert sample(m1, dur, dur + "_count", **route) == 3
    assert sample(m1, "tailrace_http_responses", "tailrace_http_responses_total", status="200",
                  **route) == 2
    assert sample(m1, "tailrace_http_responses", "tailrace_http_responses_total", status="500",
                  **route) == 1
