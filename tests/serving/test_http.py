"""The HTTP API on a real uvicorn server with fake engines and operators: the official
``openai`` client, SSE streaming, and every error path with its body and headers."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.serving import PipelineService, ServingHub
from tests.serving import fakes
from tests.serving.server import running

KEY = "test-key"


@pytest.fixture
def server(monkeypatch):
    """echo (generate over EchoEngine) and shout (a map) on one server, API key set."""
    fakes.register_echo(monkeypatch)
    hub = ServingHub([PipelineService(fakes.echo_pipeline()),
                      PipelineService(fakes.shout_pipeline())], api_key=KEY, max_body_bytes=4096)
    with running(hub) as url:
        yield url


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_chat_completion_with_the_openai_client(server):
    r = client(server).chat.completions.create(
        model="echo", messages=[{"role": "system", "content": "ignored"},
                                {"role": "user", "content": "one two three"}])
    assert r.object == "chat.completion" and r.model == "echo" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.content == "one two three"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 3, 6)


def test_completion_and_length_finish(server):
    r = client(server).completions.create(model="echo", prompt=" ".join("abcdefghij"))
    assert r.object == "text_completion"
    assert r.choices[0].text == "a b c d e f g h"  # max_tokens: 8
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def test_streaming_chat_chunks_and_usage(server):
    stream = client(server).chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "alpha beta gamma"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "alpha beta gamma"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "stop" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert len({c.id for c in chunks}) == 1


def test_streamed_chunks_arrive_before_the_answer_is_complete(monkeypatch):
    fakes.register_echo(monkeypatch)
    hub = ServingHub([PipelineService(fakes.echo_pipeline("slow", delay=0.05))])
    with running(hub) as url:
        t0 = time.perf_counter()
        arrivals = []
        stream = client(url).completions.create(model="slow", prompt="a b c d e f", stream=True)
        for c in stream:
            if c.choices[0].text:
                arrivals.append(time.perf_counter() - t0)
        done = time.perf_counter() - t0
    assert len(arrivals) >= 4  # several chunks, not one at the end
    assert arrivals[0] < arrivals[-1] and arrivals[0] < done / 2


def test_raw_sse_format_ends_with_done(server):
    body = {"model": "echo", "messages": [{"role": "user", "content": "x y"}], "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert all(x.startswith("data: ") for x in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_models_lists_the_pipelines(server):
    assert [m.id for m in client(server).models.list()] == ["echo", "shout"]


def test_runs_endpoint_output_and_error_record(server):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/v1/pipelines/shout/runs", json={"text": "hi", "n": 1}, headers=h)
    assert r.status_code == 200 and r.json() == {"text": "hi", "n": 1, "loud": "HI"}
    r = httpx.post(server + "/v1/pipelines/shout/runs", json={"text": "boom"}, headers=h)
    assert r.status_code == 500
    err = r.json()
    assert err["error"]["message"] == "stage 'shout': ValueError: no boom allowed"
    assert err["error"]["stage"] == "shout" and err["error"]["type"] == "api_error"
    assert err["input"] == {"text": "boom"}
    r = httpx.post(server + "/v1/pipelines/shout/runs", json={"_rid": 3}, headers=h)
    assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]


def test_runs_endpoint_streams_tokens_then_the_output(server):
    with httpx.stream("POST", server + "/v1/pipelines/echo/runs?stream=true",
                      json={"question": "p q r"},
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        events = [x[6:] for x in r.iter_lines() if x]
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    assert "".join(d["token"] for d in data if "token" in d) == "p q r"
    out = data[-1]["output"]
    assert out["answer"] == "p q r" and out["usage"]["completion_tokens"] == 3


def test_runs_stream_flag_takes_booleans_and_refuses_anything_else(server):
    h = {"Authorization": f"Bearer {KEY}"}
    url = server + "/v1/pipelines/shout/runs"
    for off in ("false", "0", "no", "off"):
        r = httpx.post(f"{url}?stream={off}", json={"text": "a"}, headers=h)
        assert r.status_code == 200 and r.json()["loud"] == "A"
    r = httpx.post(url + "?stream=maybe", json={"text": "a"}, headers=h)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_parameter"
    assert err["message"] == ("/v1/pipelines/shout/runs: query.stream: not a boolean "
                              "('maybe'); use true or false")


def test_400_malformed_bodies_name_the_reason(server):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = server + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers=h)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("request body is not valid JSON")
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, content=b"[1]", headers=h)
    assert r.json()["error"]["message"] == "request body must be a JSON object, got list"
    with pytest.raises(openai.BadRequestError, match="has no user message") as ei:
        client(server).chat.completions.create(
            model="echo", messages=[{"role": "system", "content": "x"}])
    assert ei.value.status_code == 400
    r = httpx.post(url, json={"model": "echo", "stream": "yes",
                              "messages": [{"role": "user", "content": "a"}]}, headers=h)
    assert r.json()["error"]["message"] == "'stream' must be true or false, got 'yes'"
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "a"}]}, headers=h)
    assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"model": "shout", "prompt": "a"},
                   headers=h)
    assert r.status_code == 400
    assert "no generate, route or tool_call stage" in r.json()["error"]["message"]


def test_401_without_or_with_a_wrong_key(server):
    with pytest.raises(openai.AuthenticationError, match="invalid API key") as ei:
        client(server, key="wrong").models.list()
    assert ei.value.status_code == 401
    r = httpx.get(server + "/v1/models")
    assert r.status_code == 401
    assert r.json() == {"error": {"message": "missing API key: send the header "
                                  "'Authorization: Bearer KEY'",
                                  "type": "authentication_error", "code": "missing_api_key"}}
    assert httpx.get(server + "/healthz").status_code == 200  # probes need no key


def test_404_unknown_pipeline(server):
    with pytest.raises(openai.NotFoundError, match="pipeline 'nope' is not served here; "
                                                   "served: echo, shout") as ei:
        client(server).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "a"}])
    assert ei.value.body["code"] == "model_not_found"
    r = httpx.post(server + "/v1/pipelines/nope/runs", json={},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_413_body_over_the_limit(server):
    with pytest.raises(openai.APIStatusError, match="limit is 4096 bytes") as ei:
        client(server).chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x" * 5000}])
    assert ei.value.status_code == 413 and ei.value.body["code"] == "request_too_large"

    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(server + "/v1/pipelines/shout/runs", content=chunks(),
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == "request body exceeds the limit of 4096 bytes"


def test_429_with_retry_after_on_admission_rejection():
    fakes.GATE.clear()
    fakes.ENTERED.clear()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=0))
    p = tr.Pipeline("held")
    p.source(fields=["text"]).map(fakes.held, id="held", blocking=True).sink()
    hub = ServingHub([PipelineService(p, admission=gate)], gate=gate)
    try:
        with running(hub) as url:
            first: dict = {}
            t = threading.Thread(target=lambda: first.update(r=httpx.post(
                url + "/v1/pipelines/held/runs", json={"text": "a"}, timeout=30)))
            t.start()
            assert fakes.ENTERED.wait(10)
            with pytest.raises(openai.RateLimitError, match="AdmissionRejected") as ei:
                client(url).post("/pipelines/held/runs", body={"text": "b"},
                                 cast_to=httpx.Response)
            headers = ei.value.response.headers
            assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
            assert ei.value.body["code"] == "admission_rejected"
            assert ei.value.body["type"] == "rate_limit_error"
            fakes.GATE.set()
            t.join(30)
            assert first["r"].status_code == 200 and first["r"].json()["held"] is True
    finally:
        fakes.GATE.set()


def test_healthz_and_readyz_follow_the_services(monkeypatch):
    hub = ServingHub([PipelineService(fakes.shout_pipeline())])
    with running(hub, start_hub=False) as url:
        assert httpx.get(url + "/healthz").json() == {"status": "ok"}
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503
        assert r.json() == {"ready": False, "pipelines": {"shout": {"ready": False,
                                                                    "error": None}}}
        hub.start()
        assert hub.services["shout"].wait_ready(10)
        assert httpx.get(url + "/readyz").status_code == 200


def test_unknown_route_is_an_openai_shaped_404(server):
    r = httpx.get(server + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_disconnected_client_cancels_its_generation(monkeypatch):
    """A client that gives up (non-streaming) or closes its stream stops its sequence."""
    fakes.register_echo(monkeypatch)
    p = tr.Pipeline("long", engines={"llm": fakes.echo_spec(delay=0.02, repeat=100)})
    (p.source(fields=["question"])
     .apply("generate", engine="llm", input="question", output="answer", max_tokens=500)
     .sink())
    hub = ServingHub([PipelineService(p)])
    with running(hub) as url:
        fakes.EchoEngine.LOG.clear()
        body = {"model": "long", "messages": [{"role": "user", "content": "w"}]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.3)
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
        assert sum(1 for x in got if x.startswith("data: ")) >= 2
        deadline = time.monotonic() + 10
        while len(fakes.EchoEngine.LOG) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    reasons = [g.finish_reason for g in fakes.EchoEngine.LOG]
    assert reasons == ["cancelled", "cancelled"]
    assert all(g.completion_tokens < 100 for g in fakes.EchoEngine.LOG)  # of 500


def test_readyz_reports_a_pipeline_that_failed_to_load():
    p = tr.Pipeline("broken")
    p.source(fields=["text"]).apply(fakes.Broken, id="load").sink()
    hub = ServingHub([PipelineService(fakes.shout_pipeline()), PipelineService(p)])
    with running(hub, start_hub=False) as url:
        hub.start()
        assert hub.services["broken"].wait_ready(10) is False
        assert hub.services["shout"].wait_ready(10)
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503
        assert r.json()["pipelines"] == {
            "shout": {"ready": True, "error": None},
            "broken": {"ready": False, "error": "RuntimeError: model file vanished"}}
        r = httpx.post(url + "/v1/pipelines/broken/runs", json={"text": "a"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == ("pipeline 'broken' failed: RuntimeError: "
                                                "model file vanished")
