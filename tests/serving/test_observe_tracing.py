"""OpenTelemetry tracing: off by default; on, one span per request and one per stage a
record passes, parented to the request span, with GenAI attributes on generate stages."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode  # noqa: E402

import tailrace as tr  # noqa: E402
from tailrace.observability import tracing  # noqa: E402


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert tracing.configure_tracing(exporter=exporter) is True
    yield exporter
    tracing.shutdown_tracing()


def shout(r: dict) -> dict:
    if r["q"] == "boom":
        raise ValueError("no boom allowed")
    return {**r, "q": r["q"].upper()}


def traced_run(pipeline: tr.Pipeline, texts: list[str], run=tr.run) -> tuple[list, list]:
    """Run each text as its own request (its own request span); returns (outputs, roots)."""
    records, roots = [], []
    for text in texts:
        with tracing.request_span("POST /v1/pipelines/p/runs") as root:
            records.append(tracing.attach_trace({"q": text}, pipeline="p"))
        roots.append(root)
    result = run(pipeline, input=records)
    return result.outputs or [], roots


def test_off_by_default_and_free(monkeypatch):
    monkeypatch.delenv(tracing.ENV_ENDPOINT, raising=False)
    assert tracing.configure_tracing() is False
    assert tracing.STATE.tracer is None and not tracing.enabled()
    rec = {"q": "x"}
    with tracing.request_span("r") as span:
        assert span is None
        assert tracing.attach_trace(rec) is rec and rec == {"q": "x"}


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_stage_spans_are_children_of_the_request_span(spans, fuse):
    """The local runtime's stage spans (the Ray runtime has no tracing hook yet)."""
    run = functools.partial(tr.run, runtime="local", fuse=fuse)
    p = tr.Pipeline("p")
    p.source(fields=["q"]).map(shout, id="shout").map(lambda r: r, id="keep").sink()
    outs, roots = traced_run(p, ["a", "b", "boom"], run)
    assert sorted(o["q"] for o in outs) == ["A", "B"]
    finished = spans.get_finished_spans()
    by_trace: dict[int, list] = {}
    for s in finished:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    assert len(by_trace) == 3  # one trace per request
    # one span per plan stage: a fused chain is one stage (its operators in tailrace.ops)
    stage_names = {"stage shout+keep+sink"} if fuse else {
        "stage shout", "stage keep", "stage sink"}
    for text, root in zip(["a", "b", "boom"], roots, strict=True):
        rid = root.get_span_context()
        children = [s for s in by_trace[rid.trace_id] if s.parent is not None]
        assert all(s.parent.span_id == rid.span_id for s in children)
        names = {s.name for s in children}
        if text != "boom":  # it passed every stage; "boom" failed in shout
            assert names == stage_names
        else:
            assert names == {"stage shout"} if not fuse else names == stage_names
        for s in children:
            assert s.attributes["tailrace.queue_wait_us"] >= 0
            assert set(s.attributes["tailrace.ops"]) <= {"shout", "keep", "sink"}
            assert s.start_time <= s.events[0].timestamp <= s.end_time
        request = next(s for s in by_trace[rid.trace_id] if s.parent is None)
        assert request.attributes["tailrace.pipeline"] == "p"
    failed = [s for s in finished if s.status.status_code is StatusCode.ERROR]
    assert len(failed) == 1 and failed[0].attributes["error.type"] == "ValueError"
    assert "no boom allowed" in failed[0].status.description


def _latency_server():
    path = Path(__file__).resolve().parents[2] / "bench" / "latency_server.py"
    if "latency_server" not in sys.modules:
        spec = importlib.util.spec_from_file_location("latency_server", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["latency_server"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["latency_server"]


@pytest.mark.engine
def test_generate_stage_spans_follow_genai_conventions(spans):
    ls = _latency_server()
    with ls.start_server(ls.LatencyConfig(decode_tps=2000, prefill_tps=1e6)) as srv:
        engine = {"backend": "openai", "base_url": srv.url, "model": "latency-model",
                  "retries": 0}
        p = tr.Pipeline("gen", engines={"llm": engine})
        (p.source(fields=["q"])
         .apply("generate", id="answer", engine="llm", input="q", output="answer",
                max_tokens=5, usage="usage")
         .sink())
        outs, roots = traced_run(p, ["say hi", "say ho"])
    assert len(outs) == 2
    gen = [s for s in spans.get_finished_spans() if s.name == "chat latency-model"]
    assert len(gen) == 2
    assert {s.parent.span_id for s in gen} == {r.get_span_context().span_id for r in roots}
    for s in gen:
        a = s.attributes
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == "latency-model"
        assert a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.max_tokens"] == 5
        assert a["gen_ai.usage.output_tokens"] == 5
        assert a["gen_ai.usage.input_tokens"] > 0


class _Collector(http.server.BaseHTTPRequestHandler):
    posts: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Collector.posts.append((self.path, self.headers["Content-Type"], len(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_http_export_from_the_environment(monkeypatch):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv(tracing.ENV_ENDPOINT, f"http://127.0.0.1:{server.server_port}")
        assert tracing.configure_tracing() is True
        with tracing.request_span("GET /x"):
            pass
        tracing.shutdown_tracing()  # flushes the batch processor
    finally:
        server.shutdown()
    assert _Collector.posts and _Collector.posts[0][0] == "/v1/traces"
    assert _Collector.posts[0][1] == "application/x-protobuf" and _Collector.posts[0][2] > 0


@pytest.mark.parametrize("bad", ["127.0.0.1:4318", "ftp://host", "http://"])
def test_bad_endpoint_is_one_clear_line(bad):
    with pytest.raises(tracing.TracingError, match=r"--otlp-endpoint: OTLP endpoint must be an "
                                                   r"http\(s\) URL like http://127.0.0.1:4318"):
        tracing.configure_tracing(endpoint=bad)
    assert not tracing.enabled()


def test_http_request_span_parents_the_stage_spans(spans):
    """The real app on uvicorn: one server span per request, the stage spans under it."""
    httpx = pytest.importorskip("httpx")
    from tailrace.serving import PipelineService, ServingHub

    from .test_observe_metrics import live_server

    p = tr.Pipeline("p")
    p.source(fields=["q"]).map(shout, id="shout").sink()
    svc = PipelineService(tr.compile_pipeline(p, fuse=False)).start()
    hub = ServingHub([svc])
    try:
        assert svc.wait_ready(10)
        with live_server(hub) as url, httpx.Client(base_url=url, timeout=10) as http:
            assert http.post("/v1/pipelines/p/runs", json={"q": "hi"}).json() == {"q": "HI"}
            assert http.post("/v1/pipelines/p/runs", json={"q": "boom"}).status_code == 500
            streamed = http.post("/v1/pipelines/p/runs?stream=true", json={"q": "yo"})
            assert '"output":{"q":"YO"}' in streamed.text  # submitted from its own task
            assert http.get("/healthz").status_code == 200  # not traced: not under /v1/
    finally:
        hub.stop()
    finished = spans.get_finished_spans()
    roots = [s for s in finished if s.parent is None]
    assert [s.name for s in roots] == ["POST /v1/pipelines/{name}/runs"] * 3
    assert [s.attributes["http.response.status_code"] for s in roots] == [200, 500, 200]
    assert roots[1].status.status_code is StatusCode.ERROR
    for root, want in zip(roots, [{"stage shout", "stage sink"}, {"stage shout"},
                                  {"stage shout", "stage sink"}], strict=True):
        assert root.attributes["tailrace.pipeline"] == "p"
        kids = {s.name for s in finished if s.parent is not None
                and s.parent.span_id == root.context.span_id}
        assert kids == want
