"""/dashboard and the JSON it polls: the plan graph (fused hand-offs and branch ports),
live per-stage figures, the P99 breakdown, admission, pools and HTTP figures."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

import tailrace as tr  # noqa: E402
from tailrace.control import AdmissionGate, make_policy  # noqa: E402
from tailrace.serving import PipelineService, ServingHub  # noqa: E402
from tailrace.serving.observe import dashboard_data, install_observability  # noqa: E402

from .test_observe_metrics import pool_stats  # noqa: E402


def measure(r: dict) -> dict:
    if r["q"] == "hold":  # keeps admission's only slot busy while others arrive
        time.sleep(0.05)
    return {**r, "n": len(r["q"])}


def branchy() -> tr.Pipeline:
    p = tr.Pipeline("qa")
    s = p.source(fields=["q"]).map(measure, id="measure")
    long, short = s.branch(lambda r: r["n"] > 3, id="route")
    a = long.map(lambda r: {**r, "a": r["q"].upper()}, id="shout")
    b = short.map(lambda r: {**r, "a": "?"}, id="canned")
    a.merge(b, id="join").sink()
    return p


@pytest.fixture
def hub():
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=0))
    svc = PipelineService(branchy(), admission=gate).start()
    assert svc.wait_ready(10)
    h = ServingHub([svc], gate=gate)
    h.pools = lambda: [pool_stats()]  # type: ignore[method-assign]
    yield h
    h.stop()


def submit(svc: PipelineService, qs: list[str]) -> list:
    async def go():
        return await asyncio.gather(*(svc.submit({"q": q}) for q in qs), return_exceptions=True)
    return asyncio.run(go())


def test_graph_nodes_and_edges(hub):
    d = dashboard_data(hub)["pipelines"][0]
    nodes = {n["id"]: n for n in d["nodes"]}
    assert list(nodes) == ["source", "measure", "route", "shout", "canned", "join", "sink"]
    # measure+route fuse into one stage; join+sink too; a queue only in front of a stage
    assert nodes["measure"]["stage"] == nodes["route"]["stage"] == "measure+route"
    assert [n for n, v in nodes.items() if v["bound"]] == ["measure", "shout", "canned", "join"]
    edges = {(e["from"], e["to"]): (e["port"], e["fused"]) for e in d["edges"]}
    assert edges == {("source", "measure"): (None, False), ("measure", "route"): (None, True),
                     ("route", "shout"): ("true", False), ("route", "canned"): ("false", False),
                     ("shout", "join"): (None, False), ("canned", "join"): (None, False),
                     ("join", "sink"): (None, True)}


def test_live_figures_and_p99_breakdown(hub):
    svc = hub.services["qa"]
    for q in ("hello", "hi", "a long one"):
        assert not isinstance(submit(svc, [q])[0], Exception)
    d = dashboard_data(hub)
    p = d["pipelines"][0]
    nodes = {n["id"]: n for n in p["nodes"]}
    assert (p["records_in"], p["records_out"], p["errors"]) == (3, 3, 0)
    assert nodes["source"]["records_in"] == nodes["source"]["records_out"] == 3
    assert (nodes["shout"]["records_in"], nodes["canned"]["records_in"]) == (2, 1)
    assert nodes["shout"]["svc_p99_us"] > 0 and nodes["join"]["wait_p99_us"] > 0
    parts = p["p99"]["parts"]
    assert [x["id"] for x in parts] == [n for n in nodes if n != "source"]
    total = sum(x["share"] for x in parts) + p["p99"]["outside_share"]
    assert total == pytest.approx(1.0)
    assert p["p99"]["total_us"] == pytest.approx(max(p["latency_p99_us"],
                                                     p["p99"]["staged_us"]))


def test_admission_pools_and_pages(hub):
    results = submit(hub.services["qa"], ["hold", "two", "three", "four"])
    rejected = sum(1 for r in results if getattr(r, "status", None) == 429)
    assert rejected >= 1  # one in flight, no waiting room
    app = FastAPI()
    install_observability(app, hub)
    with TestClient(app) as client:
        d = client.get("/dashboard/data").json()
        page = client.get("/dashboard")
        js = client.get("/dashboard/static/dashboard.js")
        missing = client.get("/dashboard/static/secrets.txt")
    a = d["admission"]
    assert (a["policy"], a["admitted"], a["rejected"]) == ("fcfs", 4 - rejected, rejected)
    assert a["rejected_by_reason"] == {"queue_full": rejected}
    pool = d["pools"][0]
    assert (pool["name"], pool["up"], pool["busy"]) == ("llm", 3, 2)
    assert [r["in_flight"] for r in pool["replicas"]] == [2, 0, 1]
    assert [r["cached_tokens"] for r in pool["replicas"]] == [0, 100, 200]
    assert pool["replicas"][2]["cache_hit_ratio"] == pytest.approx(200 / 1200)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/static/dashboard.js">' in page.text
    assert js.status_code == 200 and "/dashboard/data" in js.text
    assert missing.status_code == 404 and missing.text == "no dashboard file 'secrets.txt'"
