"""Budgets per request over HTTP, through a live server and the official ``openai``
client: the body field and the header reach the budgeted route, a served answer reports
what it cost (``usage.cost``), the tenant's spend lands in the ledger and ``/metrics``,
and every bad budget is a one-line 400."""

from __future__ import annotations

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.engines import BACKENDS
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.tenants import Tenant, TenantKeys
from tests.operators.test_route_budget import VERIFY, spec
from tests.serving.server import running

KEY, ADMIN = "sk-budget-0000001", "sk-budget-admin-1"


@pytest.fixture(autouse=True)
def skill_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "skill",
                        ("tests.operators.test_route_budget", "SkillEngine", ("generate",)))


def budgeted(name: str, budget=None, verify=VERIFY) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"small": spec("small", 1, 1.0), "big": spec("big", 3, 10.0)})
    kw = {} if budget is None else {"budget": budget}
    (p.source(fields=["q"])
     .apply("route", id="route", input="q", escalate=["small", "big"], order="price",
            verify=verify, max_tokens=10, label=f"{name}-ledger", **kw)
     .sink())
    return p


def plain() -> tr.Pipeline:
    p = tr.Pipeline("plain", engines={"small": spec("small", 1, 1.0)})
    p.source(fields=["q"]).apply("generate", id="gen", engine="small", input="q").sink()
    return p


@pytest.fixture(scope="module")
def url():
    keys = TenantKeys({KEY: Tenant("acme")})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(BACKENDS, "skill",
                   ("tests.operators.test_route_budget", "SkillEngine", ("generate",)))
        hub = ServingHub([PipelineService(budgeted("open")),
                          PipelineService(budgeted("strict", "required")),
                          PipelineService(budgeted("tests", verify={"unit_tests": {}})),
                          PipelineService(plain())], tenants=keys, api_key=ADMIN)
        with running(hub) as u:
            yield u


def chat(url: str, model: str, text: str, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                     **kw)


def test_a_request_budget_from_the_body_or_header_is_spent_and_the_answer_reports_its_cost(url):
    r = chat(url, "open", "level 3 job", extra_body={"budget": 1.0})
    assert r.choices[0].message.content == "ok"
    # small (3 + 10 tokens at 1/1k) failed, big (3 + 10 at 10/1k) passed
    assert r.usage.model_extra["cost"] == pytest.approx(0.013 + 0.13)
    # the header on /runs; a budget too small for big ends the record: 402
    res = httpx.post(url + "/v1/pipelines/open/runs", json={"q": "level 3 job"},
                     headers={"X-Tailrace-Budget": "0.05", "Authorization": f"Bearer {KEY}"})
    assert res.status_code == 402 and res.json()["error"]["code"] == "budget_exhausted"
    assert "budget exhausted: spent 0.013 of 0.05" in res.text
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert 'tailrace_allocation_solved_total{label="open-ledger",tenant="acme"} 1.0' in metrics
    assert 'tailrace_allocation_exhausted_total{label="open-ledger",tenant="acme"} 1.0' in metrics
    assert 'tailrace_allocation_revenue_total{label="open-ledger",tenant="acme"} 1.0' in metrics
    assert 'counter="spend"' in metrics
    # what the tenant's requests cost, the exhausted one's small call included
    line = next(x for x in metrics.splitlines()
                if x.startswith('tailrace_pipeline_spend_total{pipeline="open",tenant="acme"}'))
    assert float(line.split()[-1]) == pytest.approx(0.013 + 0.13 + 0.013)


@pytest.mark.parametrize("model,kw,code,msg", [
    ("open", {"extra_body": {"budget": -1}}, "invalid_budget", "positive number"),
    ("open", {"extra_body": {"budget": "lots"}}, "invalid_budget", "positive number"),
    ("open", {"extra_body": {"budget": 1.0}, "extra_headers": {"X-Tailrace-Budget": "2"}},
     "conflicting_parameter", "disagree"),
    ("open", {"extra_headers": {"X-Tailrace-Budget": "nan"}}, "invalid_budget",
     "positive number"),
    ("plain", {"extra_body": {"budget": 1.0}}, "budget_unused", "does not spend budgets"),
    ("strict", {}, "budget_required", "needs a budget per request"),
])
def test_a_bad_budget_is_a_400_naming_it(url, model, kw, code, msg):
    with pytest.raises(openai.BadRequestError) as e:
        chat(url, model, "level 1 x", **kw)
    err = e.value.body
    assert err["code"] == code and msg in err["message"], err


def test_a_required_budget_sent_is_spent(url):
    r = chat(url, "strict", "level 1 x", extra_headers={"X-Tailrace-Budget": "0.5"})
    assert r.choices[0].message.content == "ok"
    assert r.usage.model_extra["cost"] == pytest.approx(0.013)


def test_a_request_lacking_a_field_its_verifier_reads_is_a_400_naming_the_field(url):
    """A chat request carries its text only; the unit_tests verifier reads the task's
    prompt, entry point and tests."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(url, "tests", "level 1 task", extra_body={"budget": 1.0})
    err = e.value.body
    assert err["code"] == "FieldError", err
    assert "verifier unit_tests reads field 'test', which the record lacks (it has: q)" \
        in err["message"], err  # the envelope's key is not a user field
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    # refused before any provider was called: nothing spent, counted unsolved
    assert 'tailrace_allocation_unsolved_total{label="tests-ledger",tenant="acme"} 1.0' in metrics
    assert 'tailrace_allocation_spend_total{label="tests-ledger",tenant="acme"} 0.0' in metrics
