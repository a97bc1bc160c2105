"""A request's own priority class and deadline for admission, within the bounds its
pipeline's ``serve:`` block allows: body fields ``priority``/``deadline_ms`` on the OpenAI
endpoints, headers ``X-Tailrace-Priority``/``X-Tailrace-Deadline-Ms`` on every endpoint.
Real uvicorn on loopback, the official ``openai`` client, a blocking stage and the echo
engine; the order is observed where the engine is called, never by timing."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.control import AdmissionGate, make_policy
from tailrace.errors import PlanError
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.tenants import Tenant, TenantKeys
from tests.serving import fakes
from tests.serving.server import running

ALL = {"priorities": ["batch", "standard", "interactive"],
       "deadline_ms": {"min": 50, "max": 60000}}
KEY = "sk-alpha-000000"


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"{what}: not reached within {timeout_s:g} s"
        time.sleep(0.005)


def held_chat(name: str, serve: dict | None) -> tr.Pipeline:
    """``question`` -> a stage that blocks until ``fakes.GATE`` opens -> echo answer."""
    p = tr.Pipeline(name, engines={"llm": fakes.echo_spec()}, serve=serve)
    (p.source(fields=["question"])
     .map(fakes.held, id="held", blocking=True)
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=8)
     .sink())
    return p


@pytest.fixture
def gate_closed(monkeypatch):
    fakes.register_echo(monkeypatch)
    fakes.EchoEngine.REQUESTS.clear()
    fakes.GATE.clear()
    fakes.ENTERED.clear()
    yield fakes.GATE
    fakes.GATE.set()


@pytest.fixture
def served(gate_closed):
    """One gate (slo, one request at a time) in front of pipelines with and without
    bounds; yields (url, gate)."""
    gate = AdmissionGate(make_policy("slo", max_in_flight=1))
    services = [PipelineService(held_chat("all", ALL), admission=gate),
                PipelineService(held_chat("some", {"priorities": ["batch", "standard"],
                                                   "deadline_ms": {"min": 200,
                                                                   "max": 30000}}),
                                admission=gate),
                PipelineService(held_chat("none", None), admission=gate)]
    hub = ServingHub(services, gate=gate)
    gate_closed.set()  # nothing blocks unless a test closes it
    with running(hub) as url:
        yield url, gate
    gate.close()


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(c: openai.OpenAI, model: str, text: str, **kw):
    return c.chat.completions.create(model=model, messages=[{"role": "user",
                                                             "content": text}], **kw)


def test_a_queued_interactive_request_is_admitted_before_earlier_batch_ones(served):
    url, gate = served
    fakes.GATE.clear()
    fakes.ENTERED.clear()
    c = client(url)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(ask, c, "all", "first")
        assert fakes.ENTERED.wait(10), "the first request never reached the held stage"
        later = []
        for n, (text, how) in enumerate([
                ("batch-1", {"extra_body": {"priority": "batch"}}),
                ("batch-2", {"extra_headers": {"X-Tailrace-Priority": "batch"}}),
                ("urgent", {"extra_body": {"priority": "interactive", "deadline_ms": 60000}})],
                1):
            later.append(pool.submit(ask, c, "all", text, **how))
            wait_until(lambda n=n: gate.statistics().queued == n, f"{n} queued")
        fakes.GATE.set()
        answers = [f.result(timeout=30).choices[0].message.content
                   for f in [first, *later]]
    assert answers == ["first", "batch-1", "batch-2", "urgent"]
    prompts = [r.messages[-1]["content"] for r in fakes.EchoEngine.REQUESTS]
    assert prompts == ["first", "urgent", "batch-1", "batch-2"]


def test_an_unmeetable_deadline_is_a_429_with_retry_after(served):
    url, gate = served
    fakes.GATE.clear()
    fakes.ENTERED.clear()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, url + "/v1/pipelines/all/runs",
                            json={"question": "first"}, timeout=30)
        assert fakes.ENTERED.wait(10)
        # the one in flight is predicted to hold the only lane longer than 100 ms
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "all", "messages": [{"role": "user", "content": "hurry"}],
            "deadline_ms": 100})
        assert r.status_code == 429, r.text
        assert "deadline_unmeetable" in r.json()["error"]["message"]
        assert int(r.headers["Retry-After"]) >= 1
        fakes.GATE.set()
        assert first.result(timeout=30).status_code == 200
    wait_until(lambda: gate.statistics().in_flight == 0, "the gate idle")
    r = httpx.post(url + "/v1/pipelines/all/runs", json={"question": "q"},
                   headers={"X-Tailrace-Deadline-Ms": "5000", "X-Tailrace-Priority": "2"})
    assert r.status_code == 200 and r.json()["question"] == "q"
    assert "_urgency" not in r.json()


@pytest.mark.parametrize("model, body, headers, field, code", [
    # outside the bounds the YAML allows: names the field and what is allowed
    ("some", {"priority": "interactive"}, {}, "allowed: batch, standard",
     "priority_not_allowed"),
    ("some", {}, {"X-Tailrace-Priority": "7"}, "'priority' 7 is not allowed",
     "priority_not_allowed"),
    ("some", {"deadline_ms": 100}, {}, "'deadline_ms' must be at least 200 and at most "
     "30000 for pipeline 'some', got 100", "deadline_not_allowed"),
    ("some", {}, {"X-Tailrace-Deadline-Ms": "40000"}, "at most 30000",
     "deadline_not_allowed"),
    # malformed
    ("all", {"priority": "urgent"}, {}, "'priority' must be 'interactive', 'standard', "
     "'batch' or an integer class", "invalid_parameter"),
    ("all", {"priority": True}, {}, "'priority' must be", "invalid_parameter"),
    ("all", {"deadline_ms": -5}, {}, "'deadline_ms' must be a positive number",
     "invalid_parameter"),
    ("all", {"deadline_ms": "soon"}, {}, "'deadline_ms' must be a positive number",
     "invalid_parameter"),
    ("all", {}, {"X-Tailrace-Deadline-Ms": "soon"}, "header X-Tailrace-Deadline-Ms must be",
     "invalid_parameter"),
    ("all", {}, {"X-Tailrace-Priority": "high"}, "header X-Tailrace-Priority must be",
     "invalid_parameter"),
    # body and header disagree
    ("all", {"priority": "batch"}, {"X-Tailrace-Priority": "interactive"},
     "'priority' ('batch') and header X-Tailrace-Priority ('interactive') disagree",
     "conflicting_parameter"),
    ("all", {"deadline_ms": 100}, {"X-Tailrace-Deadline-Ms": "200"},
     "'deadline_ms' (100) and header X-Tailrace-Deadline-Ms ('200') disagree",
     "conflicting_parameter"),
    # a pipeline that declares no bound: says how to allow it
    ("none", {"priority": "batch"}, {}, "pipeline 'none' does not let a request choose its "
     "priority; allow classes in its YAML, e.g. serve: {priorities: [batch, standard]}",
     "priority_not_allowed"),
    ("none", {}, {"X-Tailrace-Deadline-Ms": "500"}, "serve: {deadline_ms: {min: 200, "
     "max: 30000}}", "deadline_not_allowed"),
])
def test_bad_or_disallowed_values_are_a_400_naming_the_field(served, model, body, headers,
                                                              field, code):
    url, _ = served
    r = httpx.post(url + "/v1/chat/completions", headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": "q"}], **body})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"] and r.json()["error"]["code"] == code
    if not body:  # header-only: the same on /runs and /v1/completions
        r = httpx.post(url + f"/v1/pipelines/{model}/runs", json={"question": "q"},
                       headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (400, code)
    r = httpx.post(url + "/v1/completions", headers=headers,
                   json={"model": model, "prompt": "q", **body})
    assert (r.status_code, r.json()["error"]["code"]) == (400, code)


def test_within_the_bounds_and_without_fields_requests_are_answered(served):
    url, _ = served
    c = client(url)
    assert ask(c, "some", "a b", extra_body={"priority": "standard",
                                             "deadline_ms": 30000}).choices
    assert ask(c, "some", "a b", extra_body={"priority": 1},
               extra_headers={"X-Tailrace-Priority": "standard"}).choices  # the same class
    assert c.completions.create(model="some", prompt="a b", extra_body={
        "priority": "batch"}).choices[0].text == "a b"
    assert ask(c, "none", "a b").choices[0].message.content == "a b"
    # on /runs a body field named priority is the record's own
    r = httpx.post(url + "/v1/pipelines/none/runs", json={"question": "q", "priority": 9})
    assert r.status_code == 200 and r.json()["priority"] == 9


def test_models_shows_the_bounds(served):
    url, _ = served
    meta = {m["id"]: m["metadata"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert meta["some"]["priorities"] == ["batch", "standard"]
    assert meta["some"]["deadline_ms"] == {"min": 200, "max": 30000}
    assert "priorities" not in meta["none"] and "deadline_ms" not in meta["none"]


def test_a_tenant_cannot_escape_the_bounds(gate_closed):
    fakes.GATE.set()
    p = held_chat("chat", {"tenant": "who", "priorities": ["batch"]})
    hub = ServingHub([PipelineService(p)], tenants=TenantKeys({KEY: Tenant("alpha")}))
    with running(hub) as url:
        c = client(url, KEY)
        with pytest.raises(openai.BadRequestError, match="allowed: batch"):
            ask(c, "chat", "q", extra_body={"priority": "interactive"})
        with pytest.raises(openai.BadRequestError, match="allowed: batch"):
            ask(c, "chat", "q", extra_headers={"X-Tailrace-Priority": "interactive"})
        with pytest.raises(openai.BadRequestError, match="does not let a request set its "
                           "deadline"):
            ask(c, "chat", "q", extra_body={"deadline_ms": 1000})
        r = httpx.post(url + "/v1/pipelines/chat/runs", json={"question": "q"},
                       headers={"Authorization": f"Bearer {KEY}",
                                "X-Tailrace-Priority": "interactive"})
        assert r.status_code == 400 and "allowed: batch" in r.json()["error"]["message"]
        assert ask(c, "chat", "q", extra_body={"priority": "batch"}).choices


@pytest.mark.parametrize("serve, line, needle", [
    ("serve: {priorities: [urgent]}", 3, "'serve.priorities' must be a non-empty list of "
     "the priority classes a request may choose"),
    ("serve: {priorities: []}", 3, "'serve.priorities' must be a non-empty list"),
    ("serve: {priorities: batch}", 3, "'serve.priorities' must be a non-empty list"),
    ("serve:\n  tenant: t\n  deadline_ms:\n    min: 10\n    maximum: 20", 6,
     "unknown key 'serve.deadline_ms.maximum' (allowed: min, max)"),
    ("serve: {deadline_ms: {min: 500, max: 100}}", 3, "'serve.deadline_ms': min (500) is "
     "above max (100)"),
    ("serve: {deadline_ms: {max: 0}}", 3, "'serve.deadline_ms.max' must be a positive number"),
    ("serve: {deadline_ms: 500}", 3, "'serve.deadline_ms' must be a mapping like"),
    ("serve: {priority: [batch]}", 3, "unknown key 'serve.priority' (allowed: fields, "
     "tenant, priorities, deadline_ms)"),
])
def test_bad_bounds_are_a_plan_error_at_their_line(serve, line, needle):
    text = f"version: 1\npipeline: x\n{serve}\nstages:\n  - {{id: a, op: map}}\n"
    with pytest.raises(PlanError) as ei:
        loads_pipeline(text, "p.yaml")
    assert f"p.yaml:{line}" in str(ei.value) and needle in str(ei.value)


def test_bounds_from_yaml_and_python():
    text = ("version: 1\npipeline: x\nserve: {priorities: [batch, 3], deadline_ms: {max: "
            "900}}\nstages:\n  - {id: a, op: map}\n")
    serve = loads_pipeline(text, "p.yaml").serve
    assert (serve.priorities, serve.deadline_ms) == (("batch", 3), (None, 900.0))
    p = tr.Pipeline("x", serve={"deadline_ms": {"min": 1}})
    assert (p.serve.priorities, p.serve.deadline_ms) == (None, (1.0, None))
    with pytest.raises(PlanError, match="'serve.priorities' must be"):
        tr.Pipeline("x", serve={"priorities": ["now"]})
