"""Admission reaches the decode loop: a request admitted under an SLO-ordering policy
carries its class (its own, else its pipeline's) and its wall-clock deadline into the
engine's ``GenerationRequest``; under a policy that ignores classes it carries nothing,
and the record the caller gets back has no trace of either."""

from __future__ import annotations

import time

import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, PipelineSLO, make_policy
from tailrace.request import REQUEST, Request
from tests.serving import fakes


@pytest.fixture(autouse=True)
def echo(monkeypatch):
    fakes.register_echo(monkeypatch)
    fakes.EchoEngine.REQUESTS.clear()


def pipeline(name: str) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": fakes.echo_spec()})
    (p.source(fields=["q"])
     .apply("generate", id="answer", engine="llm", input="q", output="a", max_tokens=4)
     .sink())
    return p


def test_an_slo_policy_sends_the_class_and_deadline_to_the_engine():
    slos = {"chat": PipelineSLO(p99_ms=2000, priority="interactive"),
            "jobs": PipelineSLO(p99_ms=60000, priority="batch")}
    gate = AdmissionGate(make_policy("slo", max_in_flight=8, slos=slos))
    try:
        before = time.time()
        out_chat = tr.run(pipeline("chat"), input=[{"q": "hi there"}], admission=gate)
        out_jobs = tr.run(pipeline("jobs"), input=[{"q": "sum up"}], admission=gate)
        mine = tr.run(pipeline("jobs"), admission=gate, input=[
            {"q": "now please",
             REQUEST: Request(asked={"priority": "interactive", "deadline_ms": 500})}])
    finally:
        gate.close()
    chat, jobs, urgent = fakes.EchoEngine.REQUESTS
    assert (chat.priority, jobs.priority, urgent.priority) == (2, 0, 2)
    assert before + 1.5 < chat.deadline < time.time() + 2.0  # arrival + 2 s, wall clock
    assert jobs.deadline > before + 59
    assert urgent.deadline < time.time() + 0.5  # its own deadline_ms
    for r in (out_chat, out_jobs, mine):
        assert REQUEST not in r.outputs[0]


@pytest.mark.parametrize("policy", ["fcfs", "simultaneous"])
def test_a_policy_that_ignores_classes_leaves_the_engine_in_arrival_order(policy):
    gate = AdmissionGate(make_policy(policy, **({"max_in_flight": 8} if policy == "fcfs"
                                                else {})))
    try:
        tr.run(pipeline("chat"), input=[{"q": "hi"}], admission=gate)
    finally:
        gate.close()
    [req] = fakes.EchoEngine.REQUESTS
    assert (req.priority, req.deadline) == (0, None)


def test_a_served_request_carries_its_class_to_the_engine():
    import asyncio

    from tailrace.serving import PipelineService

    gate = AdmissionGate(make_policy("slo", max_in_flight=4, slos={
        "served": PipelineSLO(p99_ms=2000, priority="interactive")}))
    svc = PipelineService(pipeline("served"), admission=gate).start()
    try:
        assert svc.wait_ready(60), svc.failure
        got = asyncio.run(svc.submit({"q": "hello you"}))
    finally:
        svc.stop()
        gate.close()
    assert got["a"] == "hello you" and REQUEST not in got
    [req] = fakes.EchoEngine.REQUESTS
    assert req.priority == 2 and req.deadline is not None
