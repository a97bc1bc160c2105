"""The live dashboard in a real browser (Debian's chromium driven by playwright): while
requests flow it shows the plan graph and per-stage figures that change between reads."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

pytest.importorskip("playwright")
httpx = pytest.importorskip("httpx")

import tailrace as tr  # noqa: E402
from tailrace.control import AdmissionGate, make_policy  # noqa: E402
from tailrace.serving import PipelineService, ServingHub  # noqa: E402

from .test_observe_metrics import live_server  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
OPS = ["source", "embed", "route", "generate", "canned", "join", "sink"]


def embed(r: dict) -> dict:
    time.sleep(0.001)
    return {**r, "qvec": len(r["question"])}


def generate(r: dict) -> dict:
    time.sleep(0.004)
    return {**r, "answer": r["question"][::-1]}


def qa_pipeline() -> tr.Pipeline:
    p = tr.Pipeline("qa")
    s = p.source(fields=["question"]).map(embed, id="embed", replicas=2)
    long, short = s.branch(lambda r: len(r["question"]) > 3, id="route")
    answered = long.map(generate, id="generate")
    canned = short.map(lambda r: {**r, "answer": "?"}, id="canned")
    answered.merge(canned, id="join").sink()
    return p


def load(url: str, stop: threading.Event, sent: list) -> None:
    """Closed-loop requests (4 at a time) until ``stop`` is set; bounded at 20,000."""
    def worker(i: int) -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            while not stop.is_set() and len(sent) < 20_000:
                q = "why" if len(sent) % 5 == 0 else f"question {i} {len(sent)}"
                sent.append(http.post("/v1/pipelines/qa/runs", json={"question": q}).status_code)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                    "(apt-get install chromium; the project's test setup does)")
def test_dashboard_shows_the_plan_and_live_figures(tmp_path):
    from playwright.sync_api import sync_playwright

    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=1))
    svc = PipelineService(qa_pipeline(), admission=gate).start()
    hub = ServingHub([svc], gate=gate)
    stop, sent = threading.Event(), []
    try:
        assert svc.wait_ready(10)
        with live_server(hub) as url:
            loader = threading.Thread(target=load, args=(url, stop, sent))
            loader.start()
            try:
                with sync_playwright() as pw:
                    browser = pw.chromium.launch(executable_path=CHROMIUM)
                    try:
                        page = browser.new_page(viewport={"width": 1400, "height": 1000})
                        page.goto(f"{url}/dashboard?interval=250")
                        check_page(page, tmp_path)
                    finally:
                        browser.close()
            finally:
                stop.set()
                loader.join(30)
    finally:
        hub.stop()
    assert 200 in sent


def check_page(page, tmp_path) -> None:
    page.wait_for_selector('#plan-svg g.node[data-stage="generate"]', timeout=15_000)
    # the plan graph: every operator is a node, named in the SVG's text
    nodes = page.locator("#plan-svg g.node").evaluate_all(
        "els => els.map(e => e.dataset.stage)")
    assert sorted(nodes) == sorted(OPS)
    svg_text = page.locator("#plan-svg").text_content()
    assert all(op in svg_text for op in OPS) and "svc p50" in svg_text
    assert page.locator("#plan-svg path.edge").count() == 7  # 6 hand-offs + the true/false
    # live per-stage figures: the table's counts move while requests flow
    cell = 'tr[data-stage="generate"] td[data-field="records_in"]'
    page.wait_for_function(f"() => Number(document.querySelector('{cell}').textContent) > 0",
                           timeout=15_000)
    first = int(page.locator(cell).text_content())
    page.wait_for_function(
        f"n => Number(document.querySelector('{cell}').textContent) > n", arg=first,
        timeout=15_000)
    second = int(page.locator(cell).text_content())
    assert second > first
    svc_p99 = page.locator('tr[data-stage="generate"] td[data-field="svc_p99"]').text_content()
    assert svc_p99.endswith("ms")  # a 4 ms sleep per record
    assert page.locator('#p99legend span[data-stage="generate"]').count() == 1
    assert page.locator("#adm-policy").text_content() == "policy fcfs"
    assert page.locator("#c-admit").text_content() not in ("–", "no gate")
    # the admission rates plot a line of (at least) three polls
    page.wait_for_function("() => (document.querySelector('#adm-spark polyline')"
                           "?.getAttribute('points') || '').split(' ').length >= 3",
                           timeout=15_000)
    http_row = page.locator('#http tr[data-route="/v1/pipelines/{name}/runs"]')
    assert http_row.count() == 1
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
