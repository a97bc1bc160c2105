"""``PipelineService(runtime="ray")``: a served pipeline whose stages run in Ray actors,
this process the driver. Outputs, error records, drops, admission, cancellation and
streamed pieces reach the callers as on the local runtime; a live server answers the
official ``openai`` client, plain and streamed."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.errors import RecordDropped, RequestFailed
from tests.serving import fakes
from tests.serving.server import running


@pytest.fixture(autouse=True)
def _ray(ray_session):
    return ray_session


# -- operators (module level: the actors import them) ---------------------------------------
def check(r):
    if r["x"] == 3:
        raise ValueError("three is not allowed")
    return {**r, "y": r["x"] * 10}


def not_five(r):
    return r["x"] != 5


def talk(r):
    """Streams five pieces through the record's ``_stream``, then answers."""
    for i in range(5):
        r["_stream"](f"p{i}")
    return {**r, "said": 5}


async def spin(r):
    """A slow generation: runs until the record's caller cancels (or 120 s)."""
    for _ in range(12_000):
        if r["_cancel"].is_set():
            return {**r, "stopped": True}
        await asyncio.sleep(0.01)
    return {**r, "stopped": False}


def wait_until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def gate():
    g = AdmissionGate(make_policy("fcfs", max_in_flight=4))
    yield g
    g.close()


def test_outputs_error_records_and_drops_reach_their_callers(gate):
    p = tr.Pipeline("ray-svc")
    p.source(fields=["x"]).map(check, id="check").filter(not_five, id="keep").sink()
    svc = PipelineService(p, admission=gate, runtime="ray", timeout_s=60).start()
    try:
        assert svc.wait_ready(120), svc.failure

        async def main():
            return await asyncio.gather(*(svc.submit({"x": i}) for i in range(8)),
                                        return_exceptions=True)

        got = asyncio.run(main())
        for i, a in enumerate(got):
            if i == 3:
                assert isinstance(a, RequestFailed) and "three is not allowed" in str(a)
                assert a.record.stage == "check" and a.record.input["x"] == 3
            elif i == 5:
                assert isinstance(a, RecordDropped), a
                assert "stage 'keep' dropped this record" in str(a)
            else:
                assert a == {"x": i, "y": 10 * i}
        assert svc.pending == 0
        wait_until(lambda: gate.statistics().in_flight == 0)
        st = svc.stats()
        assert st.records_in == 8 and st.errors == 1
    finally:
        svc.stop()
    assert not svc.ready


def test_admission_rejects_with_429_and_the_gate_goes_back_to_idle():
    g = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=0))
    p = tr.Pipeline("ray-busy")
    p.source(fields=["x"]).map(spin, id="spin").sink()
    svc = PipelineService(p, admission=g, runtime="ray", timeout_s=60).start()
    try:
        assert svc.wait_ready(120), svc.failure

        async def main():
            first = asyncio.ensure_future(svc.submit({"x": 1}))
            while g.statistics().in_flight == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(RequestFailed) as ei:
                await svc.submit({"x": 2})
            first.cancel()  # the caller leaves: its spin stops
            return ei.value

        err = asyncio.run(main())
        assert err.status == 429 and err.retry_after is not None and err.retry_after > 0
        wait_until(lambda: g.statistics().in_flight == 0)
    finally:
        svc.stop()
        g.close()


def test_a_cancelled_caller_stops_its_generation_in_the_actor():
    p = tr.Pipeline("ray-cancel")
    p.source(fields=["x"]).map(spin, id="spin").sink()
    svc = PipelineService(p, runtime="ray", timeout_s=300).start()
    try:
        assert svc.wait_ready(120), svc.failure

        async def main():
            task = asyncio.ensure_future(svc.submit({"x": 1}))
            await asyncio.sleep(0.5)  # it runs in the actor by now (or soon)
            task.cancel()

        asyncio.run(main())
        # the output of the stopped spin comes back with nobody waiting for it; without
        # the cancel reaching the actor it would spin for 120 s
        wait_until(lambda: svc.unrouted == 1, timeout=30)
    finally:
        svc.stop()


def test_streamed_pieces_reach_on_token_in_order():
    p = tr.Pipeline("ray-talk")
    p.source(fields=["x"]).map(talk, id="talk").sink()
    svc = PipelineService(p, runtime="ray").start()
    try:
        assert svc.wait_ready(120), svc.failure

        async def main():
            pieces: dict[int, list] = {1: [], 2: []}
            outs = await asyncio.gather(*(svc.submit({"x": i}, on_token=pieces[i].append)
                                          for i in (1, 2)))
            return pieces, outs

        pieces, outs = asyncio.run(main())
        assert outs == [{"x": 1, "said": 5}, {"x": 2, "said": 5}]
        assert pieces == {1: ["p0", "p1", "p2", "p3", "p4"], 2: ["p0", "p1", "p2", "p3", "p4"]}
    finally:
        svc.stop()


def test_the_openai_client_through_a_ray_hosted_pipeline(monkeypatch):
    """Upstream: a local server over the echo engine; the Ray-hosted pipeline's generate
    stage calls it through the openai backend from its engine actor."""
    fakes.register_echo(monkeypatch)
    with running(ServingHub([PipelineService(fakes.echo_pipeline("up"))])) as upstream:
        p = tr.Pipeline("echo", engines={"llm": {"backend": "openai", "model": "up",
                                                 "base_url": upstream + "/v1"}})
        (p.source(fields=["question"])
         .apply("generate", id="answer", engine="llm", input="question", output="answer",
                max_tokens=8)
         .sink())
        with running(ServingHub([PipelineService(p, runtime="ray")])) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            r = client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "one two three"}])
            assert r.choices[0].message.content == "one two three"
            stream = client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "four five"}],
                stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == "four five"
