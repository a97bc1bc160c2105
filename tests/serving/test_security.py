"""With an API key every route but the probes needs it (``/metrics`` opens only on
request); error bodies never carry secrets or upstream URLs. Real uvicorn, loopback."""

from __future__ import annotations

import socket

import httpx

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.security import COOKIE, Redactor, hub_redactor
from tests.serving import fakes
from tests.serving.server import running

KEY = "sk-test-0123456789"
PROTECTED = ["/metrics", "/dashboard", "/dashboard/data", "/v1/models"]
OPEN = ["/healthz", "/readyz", "/dashboard/static/dashboard.js"]


def shout_pipeline() -> tr.Pipeline:
    p = tr.Pipeline("shout")
    p.source(fields=["text"]).map(fakes.shout, id="shout").sink()
    return p


def closed_port() -> int:
    """A loopback port nobody listens on (bound, read, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upstream_pipeline(base_url: str) -> tr.Pipeline:
    p = tr.Pipeline("up", engines={"llm": {"backend": "openai", "base_url": base_url,
                                           "model": "m", "retries": 0}})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=4)
     .sink())
    return p


def test_every_route_but_the_probes_needs_the_key():
    hub = ServingHub([PipelineService(shout_pipeline())], api_key=KEY)
    bearer = {"Authorization": f"Bearer {KEY}"}
    with running(hub) as url:
        for path in PROTECTED:
            r = httpx.get(url + path)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "missing_api_key", path
            r = httpx.get(url + path, headers={"Authorization": "Bearer nope"})
            assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key"), path
            assert httpx.get(url + path, headers=bearer).status_code == 200, path
        for path in OPEN:
            assert httpx.get(url + path).status_code == 200, path
        r = httpx.get(url + "/dashboard/data", headers=bearer)
        assert r.json()["pipelines"][0]["name"] == "shout"
        assert "tailrace_pipeline_ready" in httpx.get(url + "/metrics", headers=bearer).text
        assert "?key=KEY" in httpx.get(url + "/dashboard").json()["error"]["message"]


def test_metrics_public_opens_only_metrics():
    hub = ServingHub([PipelineService(shout_pipeline())], api_key=KEY, metrics_public=True)
    with running(hub) as url:
        r = httpx.get(url + "/metrics")
        assert r.status_code == 200 and "tailrace_pipeline_ready" in r.text
        for path in ("/dashboard", "/dashboard/data", "/v1/models"):
            assert httpx.get(url + path).status_code == 401, path
        r = httpx.post(url + "/v1/pipelines/shout/runs", json={"text": "a"})
        assert r.status_code == 401


def test_without_a_key_everything_is_open():
    hub = ServingHub([PipelineService(shout_pipeline())])
    with running(hub) as url:
        for path in PROTECTED + OPEN:
            assert httpx.get(url + path).status_code == 200, path


def test_a_browser_opens_the_dashboard_with_the_key_once():
    hub = ServingHub([PipelineService(shout_pipeline())], api_key=KEY)
    with running(hub) as url:
        r = httpx.get(url + f"/dashboard?interval=250&key={KEY}")
        assert r.status_code == 303 and r.headers["location"] == "/dashboard?interval=250"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{COOKIE}=") and KEY not in cookie
        assert "HttpOnly" in cookie and "Path=/dashboard" in cookie
        assert "samesite=strict" in cookie.lower()
        with httpx.Client(base_url=url) as browser:
            browser.cookies.set(COOKIE, r.cookies[COOKIE])
            assert browser.get("/dashboard").status_code == 200
            assert browser.get("/dashboard/data").json()["pipelines"][0]["name"] == "shout"
            assert browser.get("/metrics").status_code == 401  # the cookie is the dashboard's
            assert browser.get("/v1/models").status_code == 401
        forged = httpx.get(url + "/dashboard/data", cookies={COOKIE: "0" * 64})
        assert forged.status_code == 401
        wrong = httpx.get(url + "/dashboard?key=nope")
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers


def test_an_upstream_failure_does_not_reveal_the_engine_url():
    port = closed_port()
    base_url = f"http://127.0.0.1:{port}/v1"
    hub = ServingHub([PipelineService(upstream_pipeline(base_url), timeout_s=30)])
    body = {"model": "up", "messages": [{"role": "user", "content": "hi"}]}
    with running(hub) as url:
        answers = [httpx.post(url + "/v1/chat/completions", json=body, timeout=30),
                   httpx.post(url + "/v1/chat/completions", json={**body, "stream": True},
                              timeout=30),
                   httpx.post(url + "/v1/pipelines/up/runs", json={"question": "hi"},
                              timeout=30),
                   httpx.post(url + "/v1/pipelines/up/runs?stream=true",
                              json={"question": "hi"}, timeout=30)]
    for r in answers:
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert message.startswith("stage 'answer': EngineError: openai engine at <url>"), message
        assert f"127.0.0.1:{port}" not in r.text and base_url not in r.text


def test_secrets_and_urls_in_an_operator_error_are_redacted(monkeypatch):
    monkeypatch.setenv("TAILRACE_TEST_TOKEN", "tok-abcdef123456")

    def leaky(record: dict) -> dict:
        raise RuntimeError(f"POST https://db.internal:5432/q?x=1 as tok-abcdef123456 "
                           f"with {KEY} failed")

    p = tr.Pipeline("leaky")
    p.source(fields=["text"]).map(leaky, id="leak").sink()
    hub = ServingHub([PipelineService(p)], api_key=KEY)
    with running(hub) as url:
        r = httpx.post(url + "/v1/pipelines/leaky/runs", json={"text": "a"},
                       headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == ("stage 'leak': RuntimeError: POST <url> as "
                                            "<redacted> with <redacted> failed")
    assert "tok-abcdef" not in r.text and KEY not in r.text and "db.internal" not in r.text


def test_readyz_redacts_a_load_failure(monkeypatch):
    monkeypatch.delenv("TAILRACE_NO_SUCH_KEY", raising=False)
    p = tr.Pipeline("keyless", engines={"llm": {
        "backend": "openai", "base_url": "http://10.0.0.5:8000/v1", "model": "m",
        "api_key_env": "TAILRACE_NO_SUCH_KEY"}})
    (p.source(fields=["question"])
     .apply("generate", engine="llm", input="question", output="answer").sink())
    hub = ServingHub([PipelineService(p)])
    with running(hub, start_hub=False) as url:
        hub.start()
        assert hub.services["keyless"].wait_ready(30) is False
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503
        error = r.json()["pipelines"]["keyless"]["error"]
        assert error.startswith("EngineError: openai engine at <url>: the environment variable")
        assert "10.0.0.5" not in r.text
        r = httpx.post(url + "/v1/pipelines/keyless/runs", json={"question": "a"})
        assert r.status_code == 503 and "10.0.0.5" not in r.text


def test_redactor_hides_known_secrets_and_endpoint_addresses(monkeypatch):
    spec = {"backend": "openai", "endpoints": ["http://10.0.0.5:8000/v1", "10.0.0.6:9000"],
            "api_key": "inline-secret-1", "api_key_env": "TAILRACE_TEST_UPSTREAM",
            "tokenizer": "/models/tok.json", "max_batch_tokens": 4096}
    p = tr.Pipeline("r", engines={"llm": spec})
    p.source(fields=["text"]).map(fakes.shout).sink()
    hub = ServingHub([PipelineService(p)], api_key="hub-key-123456")
    env = {"TAILRACE_TEST_UPSTREAM": "from-env-secret", "OPENAI_API_KEY": "sk-env-999999",
           "HOME": "/root", "TOKENIZERS_PARALLELISM": "false"}
    redact = hub_redactor(hub, env)
    text = ("10.0.0.5:8000 said no to inline-secret-1, from-env-secret, sk-env-999999 and "
            "hub-key-123456 at http://10.0.0.6:9000/v1 while reading /models/tok.json "
            "from /root")
    assert redact(text) == ("<url> said no to <redacted>, <redacted>, <redacted> and "
                            "<redacted> at <url> while reading /models/tok.json from /root")
    assert Redactor(["abc"])("abc") == "abc"  # too short to be told from ordinary text
