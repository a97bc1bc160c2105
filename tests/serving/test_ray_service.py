"""``PipelineService(runtime="ray")``: a served pipeline whose stages run in Ray actors,
this process the driver. Outputs, error records, drops, admission, cancellation and
streamed pieces reach the callers as on the local runtime; a live server answers the
official ``openai`` client, plain and streamed."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.cli.main import main
from tailrace.control import AdmissionGate, make_policy
from tailrace.request import request_of
from tailrace.runtime.ray import ActiveRuns
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.errors import RecordDropped, RequestFailed
from tests.conftest import free_port
from tests.serving import fakes
from tests.serving.conftest import ROOT
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
    """Streams five pieces through the record's request's sink, then answers."""
    for i in range(5):
        request_of(r).sink(f"p{i}")
    return {**r, "said": 5}


async def spin(r):
    """A slow generation: runs until the record's caller cancels (or 120 s)."""
    for _ in range(12_000):
        if request_of(r).cancel.is_set():
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
    runs = ActiveRuns()
    svc = PipelineService(p, admission=gate, runtime="ray", timeout_s=60, runs=runs).start()
    try:
        assert svc.wait_ready(120), svc.failure
        assert [r for r in runs.describe() if r["pipeline"] == "ray-svc"]  # the run is on

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
    assert not svc.ready and svc.failure is None
    assert not [r for r in runs.describe() if r["pipeline"] == "ray-svc"]  # the run ended


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


def test_client_tools_through_a_ray_hosted_pipeline(monkeypatch):
    """Client tools on Ray: the request (with its tools) crosses to the Ray-hosted
    pipeline, whose generate stage passes them through the openai backend to a local
    server over the scripted tool engine; the call comes back plain and streamed."""
    fakes.register_tools(monkeypatch)
    up = tr.Pipeline("up", engines={"llm": {"backend": "tools", "model": "tools",
                                            "path": fakes.__file__}})
    (up.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=64)
     .sink())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    ask = [{"role": "user", "content": "weather?"}]
    with running(ServingHub([PipelineService(up)])) as upstream:
        p = tr.Pipeline("agent", engines={"llm": {"backend": "openai", "model": "up",
                                                  "base_url": upstream + "/v1"}})
        (p.source(fields=["question"])
         .apply("generate", id="answer", engine="llm", input="question", output="answer",
                max_tokens=64)
         .sink())
        with running(ServingHub([PipelineService(p, runtime="ray")])) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            r = client.chat.completions.create(model="agent", messages=ask, tools=tools)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls"
            assert (call.function.name, call.function.arguments) == (
                "get_weather", '{"city": "Paris"}')
            with client.chat.completions.stream(model="agent", messages=ask,
                                                tools=tools) as s:
                streamed = s.get_final_completion().choices[0]
            assert streamed.finish_reason == "tool_calls"
            assert streamed.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
            done = client.chat.completions.create(model="agent", tools=tools, messages=[
                *ask, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
            assert done.choices[0].message.content == "The tool said: sunny"


# -- tailrace serve --runtime ray ------------------------------------------------------------
@pytest.mark.slow
def test_serve_runtime_ray_answers_then_drains_on_ctrl_c(pipe, ray_session):
    """A server process joins this session's Ray (``--address``), answers (an error
    record too), reports its Ray run on /metrics and the dashboard, and drains on
    Ctrl-C."""
    address = ray_session.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailrace.cli.main", "serve", str(pipe), "--port", "0",
         "--metrics-public", "--admission", "fcfs", "--runtime", "ray",
         "--address", address],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        while line.startswith("\x1b[33m(raylet)"):  # Ray's own warnings share the stream
            line = proc.stdout.readline()
        assert line.startswith("tailrace: serving loud on http://127.0.0.1:"), line
        base = line.split(" on ")[1].split()[0]
        root = base.removesuffix("/v1")
        deadline = time.monotonic() + 120
        while httpx.get(root + "/readyz").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "never ready"
            time.sleep(0.1)
        r = httpx.post(base + "/pipelines/loud/runs", json={"text": "hey"})
        assert r.status_code == 200 and r.json() == {"text": "hey", "loud": "HEY"}
        r = httpx.post(base + "/pipelines/loud/runs", json={"text": 5})
        assert r.status_code == 500 and "AttributeError" in r.text  # an error record, routed back
        metrics = httpx.get(root + "/metrics").text
        assert 'tailrace_pipeline_requests_total{pipeline="loud"} 2.0' in metrics, metrics[:3000]
        data = httpx.get(root + "/dashboard/data")
        assert data.status_code == 200 and "loud" in data.text
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and err.strip().endswith("tailrace: stopped (interrupted)")


def test_serve_runtime_ray_one_line_errors(pipe, capsys, monkeypatch):
    port = free_port()  # closed again: nothing listens there
    assert main(["serve", str(pipe), "--runtime", "ray", "--address", f"127.0.0.1:{port}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"tailrace: error: cannot reach the Ray cluster at 127.0.0.1:{port}: Connection "
        "refused; start one with `ray start --head` or check --address")
    assert main(["serve", str(pipe), "--address", "127.0.0.1:6379"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --address names a Ray cluster: add --runtime ray")
    assert main(["serve", str(pipe), "--runtime", "ray", "--ingress-max-outstanding", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --ingress-max-outstanding must be >= 1, got 0")
    assert main(["serve", str(pipe), "--ingress-max-outstanding", "8"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --ingress-max-outstanding is an option of serving on Ray: add "
        "--runtime ray")
    assert main(["serve", str(pipe), "--ingress-proxy", "python"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --ingress-proxy is an option of serving on Ray: add --runtime ray")
    with pytest.raises(SystemExit):
        main(["serve", str(pipe), "--runtime", "ray", "--ingress-proxy", "nginx"])
    assert "invalid choice: 'nginx' (choose from" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert main(["serve", str(pipe), "--runtime", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailrace: error: --runtime ray needs the 'ray' package (")
    assert len(err.strip().splitlines()) == 1


def test_runtime_options_are_checked_when_the_service_is_made():
    p = tr.Pipeline("opts")
    p.source(fields=["x"]).map(check, id="check").sink()
    with pytest.raises(ValueError, match="runtime must be 'local' or 'ray', got 'spark'"):
        PipelineService(p, runtime="spark")
    with pytest.raises(ValueError, match="address and placement are options of runtime='ray'"):
        PipelineService(p, address="127.0.0.1:6379")
    with pytest.raises(tr.PlanError, match="nope"):
        PipelineService(p, runtime="ray", placement={"nope": {"num_cpus": 1}})


@pytest.mark.slow
def test_stop_after_a_start_that_failed_before_the_hub_still_shuts_serve_down(ray_session):
    """The hub actor's name is taken, so ``start`` fails after it started Serve:
    ``stop`` must still take Serve down (it returned early without a hub), and must not
    delete the Serve application of the server that holds the name."""
    import ray

    pytest.importorskip("ray.serve")
    from ray import serve

    from tailrace.serving.ray import ClusterServer
    from tailrace.serving.ray.hub import NAMESPACE, hub_name
    from tailrace.serving.ray.ingress import healthz_deployment
    from tailrace.serving.ray.server import serve_running

    if serve_running():  # left by an earlier test: this one starts its own
        serve.shutdown()
    squatter = ray.remote(Squatter).options(name=hub_name("tailrace-taken"),
                                            namespace=NAMESPACE).remote()
    try:
        srv = ClusterServer([], port=free_port(), app_name="tailrace-taken")
        with pytest.raises(ValueError, match="already"):
            srv.start()
        assert srv.hub is None and serve_running()  # Serve was started for it
        srv.stop()
        assert not serve_running(), "stop() left the Serve it started running"
        srv.stop()  # a second stop does nothing
        # the name is taken because a server of that name runs: its Serve application
        # stays when this failed start is stopped
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(healthz_deployment().bind(), name="tailrace-taken", route_prefix="/taken",
                  blocking=False)
        srv = ClusterServer([], port=port, app_name="tailrace-taken")
        with pytest.raises(ValueError, match="already"):
            srv.start()
        srv.stop()
        assert "tailrace-taken" in serve.status().applications, "stop() deleted another's app"
    finally:
        ray.kill(squatter)
        serve.shutdown()


class Squatter:
    """An actor that holds a hub's name."""

    def ping(self):
        return True


def show_urgency(r):
    """What the engine would get: the class and deadline admission gave the record."""
    granted = request_of(r).granted
    return {**r, "u": list(granted) if granted else None}


def test_a_served_request_carries_its_class_and_deadline_to_the_stages():
    from tailrace.control import PipelineSLO

    g = AdmissionGate(make_policy("slo", max_in_flight=4, slos={
        "ray-urgent": PipelineSLO(p99_ms=3000, priority="interactive")}))
    p = tr.Pipeline("ray-urgent")
    p.source(fields=["x"]).map(show_urgency, id="show").sink()
    svc = PipelineService(p, admission=g, runtime="ray", timeout_s=60).start()
    try:
        assert svc.wait_ready(120), svc.failure
        before = time.time()
        got = asyncio.run(svc.submit({"x": 1}))
        assert got["u"][0] == 2 and before + 2 < got["u"][1] < time.time() + 3
    finally:
        svc.stop()
        g.close()
