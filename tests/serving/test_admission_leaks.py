"""Admission capacity is never lost by a served request, whatever ends it: a filter drop,
a caller that gives up (cancelled, disconnected) while it waits for admission or while
its record is in the pipeline, a record a stage rejects under retries or a timeout, the
service stopping. Each test ends by waiting for the gate's in-flight count to reach 0
and then being served again; service timeouts are short, so a leak fails as a timeout
instead of hanging. Real uvicorn on loopback, fake engines and operators."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.serving import (
    PipelineService,
    RecordDropped,
    RequestFailed,
    ServiceUnavailable,
    ServingHub,
)
from tests.serving import fakes
from tests.serving.server import running

TIMEOUT_S = 5.0  # a leaked slot makes the next request wait this long, then 504


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"{what}: not reached within {timeout_s:g} s"
        time.sleep(0.01)


def idle(gate: AdmissionGate) -> bool:
    st = gate.statistics()
    return st.in_flight == 0 and st.queued == 0


def tailrace_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tailrace")}


@pytest.fixture
def gate_closed():
    fakes.GATE.clear()
    fakes.ENTERED.clear()
    yield fakes.GATE
    fakes.GATE.set()


def filter_map(contract: dict) -> tr.Pipeline:
    p = tr.Pipeline("fm")
    (p.source(fields=["text"]).filter(lambda r: r["text"] != "drop", id="keep", **contract)
     .map(fakes.shout, id="shout").sink())
    return p


def held_pipeline(name: str = "held") -> tr.Pipeline:
    p = tr.Pipeline(name)
    p.source(fields=["text"]).map(fakes.held, id="held", blocking=True).sink()
    return p


def generate_pipeline(contract: dict) -> tr.Pipeline:
    p = tr.Pipeline("gen", engines={"llm": fakes.echo_spec()})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=8, **contract)
     .sink())
    return p


# -- (a) filter drops -----------------------------------------------------------------------

CONTRACTS = pytest.mark.parametrize("contract", [{}, {"retries": 1}], ids=["fused", "careful"])


@CONTRACTS
def test_dropped_requests_free_their_slots_over_http(contract):
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2))
    hub = ServingHub([PipelineService(filter_map(contract), admission=gate,
                                      timeout_s=TIMEOUT_S)], gate=gate)
    with running(hub) as url, httpx.Client(base_url=url, timeout=3 * TIMEOUT_S) as http:
        for _ in range(2):
            r = http.post("/v1/pipelines/fm/runs", json={"text": "drop"})
            assert r.status_code == 422 and r.json()["error"]["code"] == "record_dropped"
        r = http.post("/v1/pipelines/fm/runs", json={"text": "ok"})
        assert r.status_code == 200, r.text
        assert r.json() == {"text": "ok", "loud": "OK"}
        wait_until(lambda: idle(gate), "gate idle")


@CONTRACTS
def test_dropped_records_free_their_slots_in_the_service(contract):
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2))
    svc = PipelineService(filter_map(contract), admission=gate, timeout_s=TIMEOUT_S).start()
    try:
        async def main():
            for _ in range(4):  # twice the slots
                with pytest.raises(RecordDropped):
                    await svc.submit({"text": "drop"})
            return await svc.submit({"text": "ok"})

        assert asyncio.run(main()) == {"text": "ok", "loud": "OK"}
        wait_until(lambda: idle(gate), "gate idle")
    finally:
        svc.stop()
        gate.close()


# -- (b) callers that give up ----------------------------------------------------------------

@pytest.mark.parametrize("where", ["waiting for admission", "in the pipeline"])
def test_a_cancelled_caller_gives_its_ticket_back(gate_closed, where):
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=4))
    svc = PipelineService(held_pipeline(), admission=gate, timeout_s=TIMEOUT_S).start()
    try:
        async def main():
            loop = asyncio.get_running_loop()
            first = asyncio.ensure_future(svc.submit({"text": "a"}))
            assert await loop.run_in_executor(None, fakes.ENTERED.wait, 10)
            if where == "in the pipeline":
                victim = first
            else:
                victim = asyncio.ensure_future(svc.submit({"text": "b"}))
                await loop.run_in_executor(None, wait_until,
                                           lambda: gate.statistics().queued == 1, "queued")
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            gate_closed.set()
            if victim is not first:
                assert (await first)["held"] is True
            await loop.run_in_executor(None, wait_until, lambda: idle(gate), "gate idle")
            return await svc.submit({"text": "c"})

        assert asyncio.run(main()) == {"text": "c", "held": True}
        assert svc.pending == 0
        wait_until(lambda: idle(gate), "gate idle")
        stats = svc.stats()
        if where == "waiting for admission":  # "b" was admitted for nobody: it did not run
            assert (stats["held"].records_in, stats.errors) == (2, 1)
        else:  # "a" was in the stage already: it ran on for nobody
            assert (stats["held"].records_in, stats.errors) == (2, 0)
        assert svc.unrouted == 1  # the answer (or error record) nobody waited for
    finally:
        svc.stop()
        gate.close()


def test_clients_that_disconnect_give_their_tickets_back(monkeypatch):
    """A streaming client that closes mid-answer and one that stops waiting: both slots
    come back, and a request of another pipeline behind the same gate is served."""
    fakes.register_echo(monkeypatch)
    p = tr.Pipeline("long", engines={"llm": fakes.echo_spec(delay=0.02, repeat=100)})
    (p.source(fields=["question"])
     .apply("generate", engine="llm", input="question", output="answer", max_tokens=500)
     .sink())
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=4))
    hub = ServingHub([PipelineService(p, admission=gate, timeout_s=60),
                      PipelineService(fakes.shout_pipeline(), admission=gate,
                                      timeout_s=TIMEOUT_S)], gate=gate)
    body = {"model": "long", "messages": [{"role": "user", "content": "w"}]}
    with running(hub) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert sum(1 for x in got if x.startswith("data: ")) >= 2  # it was generating
        wait_until(lambda: idle(gate), "gate idle after the stream closed")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.5)
        wait_until(lambda: idle(gate), "gate idle after the client stopped waiting")
        r = httpx.post(url + "/v1/pipelines/shout/runs", json={"text": "hi"},
                       timeout=3 * TIMEOUT_S)
        assert r.status_code == 200 and r.json() == {"text": "hi", "loud": "HI"}
        wait_until(lambda: idle(gate), "gate idle")


def test_a_client_that_leaves_mid_tool_call_gives_its_ticket_back(monkeypatch):
    """A streamed tool call (client tools) cut by the client's disconnect: the engine
    stops the call, the slot comes back, the next request is served."""
    fakes.register_tools(monkeypatch)
    p = tr.Pipeline("agent", engines={"llm": {"backend": "tools", "model": "tools",
                                              "path": fakes.__file__, "delay": 0.02,
                                              "repeat": 200}})
    (p.source(fields=["question"])
     .apply("generate", engine="llm", input="question", output="answer", max_tokens=500)
     .sink())
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=4))
    hub = ServingHub([PipelineService(p, admission=gate, timeout_s=60)], gate=gate)
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    body = {"model": "agent", "messages": [{"role": "user", "content": "w"}], "tools": tools}
    fakes.EchoEngine.LOG.clear()
    with running(hub) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any('"tool_calls"' in x for x in got)  # it was calling
        wait_until(lambda: idle(gate), "gate idle after the stream closed")
        wait_until(lambda: fakes.EchoEngine.LOG, "the call ended")
        assert fakes.EchoEngine.LOG[-1].finish_reason == "cancelled"
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={**body, "messages": [*body["messages"], {
                           "role": "assistant", "tool_calls": [{
                               "id": "c1", "type": "function", "function": {
                                   "name": "get_weather", "arguments": "{}"}}]},
                           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "The tool said: sunny"
        wait_until(lambda: idle(gate), "gate idle")


def test_a_list_of_prompts_gives_every_ticket_back(monkeypatch):
    """A completion request with several prompts is several records: when admission
    rejects one (the queue is full) the request is a 429 and the others' work is
    cancelled; when the client goes away, all of it. Every slot comes back."""
    fakes.register_echo(monkeypatch)
    p = tr.Pipeline("long", engines={"llm": fakes.echo_spec(delay=0.02, repeat=100)})
    (p.source(fields=["question"])
     .apply("generate", engine="llm", input="question", output="answer", max_tokens=500)
     .sink())
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=1))
    hub = ServingHub([PipelineService(p, admission=gate, timeout_s=60)], gate=gate)
    with running(hub) as url:
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "long", "prompt": ["a", "b", "c", "d"]})
        assert r.status_code == 429 and "queue_full" in r.json()["error"]["message"], r.text
        wait_until(lambda: idle(gate), "gate idle after the 429")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", timeout=0.5,
                       json={"model": "long", "prompt": ["a", "b"]})
        wait_until(lambda: idle(gate), "gate idle after the client stopped waiting")
        r = httpx.post(url + "/v1/completions", timeout=30,
                       json={"model": "long", "prompt": ["a b", "c"], "max_tokens": 2})
        assert [c["text"] for c in r.json()["choices"]] == ["a b", "c c"]
        wait_until(lambda: idle(gate), "gate idle")


# -- (c) a record generate rejects under retries or a timeout --------------------------------

@pytest.mark.parametrize("contract", [{"retries": 1}, {"timeout_ms": 5000}],
                         ids=["retries", "timeout_ms"])
def test_generate_answers_a_prompt_that_is_not_text_at_once(monkeypatch, contract):
    fakes.register_echo(monkeypatch)
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1))
    hub = ServingHub([PipelineService(generate_pipeline(contract), admission=gate,
                                      timeout_s=TIMEOUT_S)], gate=gate)
    with running(hub) as url, httpx.Client(base_url=url, timeout=3 * TIMEOUT_S) as http:
        for _ in range(2):  # twice the slots
            r = http.post("/v1/pipelines/gen/runs", json={"question": 123})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "FieldError" and err["stage"] == "answer"
            assert err["message"] == ("stage 'answer': FieldError: field 'question' must hold "
                                      "the prompt text")
        r = http.post("/v1/pipelines/gen/runs", json={"question": "a b"})
        assert r.status_code == 200 and r.json()["answer"] == "a b"
        wait_until(lambda: idle(gate), "gate idle")


def test_generate_with_retries_fails_the_record_in_the_service(monkeypatch):
    fakes.register_echo(monkeypatch)
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1))
    svc = PipelineService(generate_pipeline({"retries": 1}), admission=gate,
                          timeout_s=TIMEOUT_S).start()
    try:
        with pytest.raises(RequestFailed, match="field 'question' must hold") as ei:
            asyncio.run(svc.submit({"question": ["not", "text"]}))
        assert ei.value.status == 400
        assert asyncio.run(svc.submit({"question": "x"}))["answer"] == "x"
        wait_until(lambda: idle(gate), "gate idle")
    finally:
        svc.stop()
        gate.close()


# -- (d) stopping with requests in flight ------------------------------------------------------

def test_stop_answers_every_caller_and_leaves_nothing_behind(gate_closed):
    before = tailrace_threads()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=4))
    svc = PipelineService(held_pipeline(), admission=gate, timeout_s=60).start()

    async def main():
        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(svc.submit({"text": str(i)})) for i in range(3)]
        assert await loop.run_in_executor(None, fakes.ENTERED.wait, 10)
        await loop.run_in_executor(None, wait_until,
                                   lambda: gate.statistics().queued == 2, "queued")
        await loop.run_in_executor(None, svc.stop, 0.5)  # one stuck in a stage, two queued
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        answers = asyncio.run(main())
        assert [type(a) for a in answers] == [ServiceUnavailable] * 3
        assert all(a.status == 503 for a in answers)
    finally:
        gate_closed.set()  # the stuck call returns; the run can end
    wait_until(lambda: idle(gate), "gate idle after stop")
    wait_until(lambda: not (tailrace_threads() - before), "tailrace threads gone")
    gate.close()


def test_server_shutdown_answers_requests_in_flight(gate_closed):
    """Stopping the server (Ctrl-C) drains the pipelines first, so requests stuck in a
    stage or waiting for admission get 503 instead of holding the shutdown."""
    before = tailrace_threads()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=4))
    hub = ServingHub([PipelineService(held_pipeline(), admission=gate, timeout_s=60)],
                     gate=gate)
    answers: list = []

    def post(url: str, text: str) -> None:
        answers.append(httpx.post(url + "/v1/pipelines/held/runs", json={"text": text},
                                  timeout=30))

    try:
        with running(hub, drain_s=0.5) as url:
            clients = [threading.Thread(target=post, args=(url, str(i))) for i in range(3)]
            for t in clients:
                t.start()
            assert fakes.ENTERED.wait(10)
            wait_until(lambda: gate.statistics().queued == 2, "queued")
        for t in clients:
            t.join(30)
        assert sorted(r.status_code for r in answers) == [503, 503, 503]
        assert all(r.json()["error"]["code"] == "service_unavailable" for r in answers)
    finally:
        gate_closed.set()
    wait_until(lambda: not (tailrace_threads() - before), "tailrace threads gone")
