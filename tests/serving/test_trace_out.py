"""``tailrace serve --trace-out``: one JSON line per served request as it ends (chat and
completions, streamed or not, /runs, /v1/responses), outcome ok / error / rejected (429),
the budget it asked for and the tokens it got; lines reach the file while the server
runs and the rest when it stops; a bad path or ``--runtime ray`` is a one-line error."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.cli.main import main
from tailrace.control import AdmissionGate, make_policy
from tailrace.control.gate import approx_prompt_tokens
from tailrace.runtime.trace_out import TraceWriter
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.responses_store import Retention
from tests.serving import fakes
from tests.serving.conftest import ROOT
from tests.serving.server import running

KEYS = ["t", "pipeline", "prompt_tokens", "max_tokens", "output_tokens", "latency_s",
        "outcome"]


def read(path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        assert list(r) == KEYS, r
        assert type(r["t"]) is float and r["t"] >= 0
        assert type(r["latency_s"]) is float and r["latency_s"] >= 0
    return rows


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_each_served_request_has_its_line(tmp_path, monkeypatch):
    fakes.register_echo(monkeypatch)
    path = tmp_path / "trace.jsonl"
    trace = TraceWriter.open(str(path))
    db = tmp_path / "memory.sqlite"
    hub = ServingHub([PipelineService(fakes.echo_pipeline(), trace=trace),
                      PipelineService(fakes.shout_pipeline(), trace=trace)],
                     responses=Retention(store={"backend": "sqlite", "path": str(db)}))
    question = "one two three four five six seven"
    with running(hub) as url:
        c = client(url)
        r = c.chat.completions.create(model="echo", max_tokens=5,
                                      messages=[{"role": "user", "content": question}])
        assert r.usage.completion_tokens == 5
        chunks = list(c.completions.create(model="echo", prompt="alpha beta gamma",
                                           stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == \
            "alpha beta gamma"
        assert c.responses.create(model="echo", input="red green",
                                  max_output_tokens=16).output_text == "red green"
        ok = httpx.post(url + "/v1/pipelines/shout/runs", json={"text": "hey"})
        assert ok.status_code == 200 and ok.json()["loud"] == "HEY"
        bad = httpx.post(url + "/v1/pipelines/shout/runs", json={"text": "boom"})
        assert bad.status_code == 500
    trace.close()
    rows = read(path)
    assert [(r["pipeline"], r["outcome"], r["max_tokens"], r["output_tokens"])
            for r in rows] == [
        ("echo", "ok", 5, 5),  # asked max_tokens 5: the echo stopped there
        ("echo", "ok", 8, 3),  # asked nothing: the generate stage's max_tokens
        ("echo", "ok", 16, 2),  # max_output_tokens
        ("shout", "ok", None, None),  # no generate stage: no budget, no usage
        ("shout", "error", None, None)]
    assert rows[0]["prompt_tokens"] == approx_prompt_tokens({"question": question})
    assert rows[3]["prompt_tokens"] == approx_prompt_tokens({"text": "hey"})
    ts = [r["t"] for r in rows]
    assert ts == sorted(ts)  # one after the other
    assert all(a["t"] + a["latency_s"] <= b["t"] + 2e-6 for a, b in itertools.pairwise(rows))


def test_an_admission_rejection_is_rejected(tmp_path):
    fakes.GATE.clear()
    fakes.ENTERED.clear()
    path = tmp_path / "trace.jsonl"
    trace = TraceWriter.open(str(path))
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=0))
    p = tr.Pipeline("held")
    p.source(fields=["text"]).map(fakes.held, id="held", blocking=True).sink()
    hub = ServingHub([PipelineService(p, admission=gate, trace=trace)], gate=gate)
    try:
        with running(hub) as url:
            first: dict = {}
            t = threading.Thread(target=lambda: first.update(r=httpx.post(
                url + "/v1/pipelines/held/runs", json={"text": "a"}, timeout=30)))
            t.start()
            assert fakes.ENTERED.wait(10)  # 'a' holds the one slot
            r = httpx.post(url + "/v1/pipelines/held/runs", json={"text": "b"}, timeout=30)
            assert r.status_code == 429, r.text
            fakes.GATE.set()
            t.join(30)
            assert first["r"].status_code == 200
    finally:
        fakes.GATE.set()
        trace.close()
    rows = read(path)
    assert [(r["pipeline"], r["outcome"]) for r in rows] == [("held", "rejected"),
                                                            ("held", "ok")]
    assert rows[1]["t"] < rows[0]["t"]  # 'a' arrived first and ended last


def test_serve_process_writes_the_trace_while_it_runs(pipe, tmp_path):
    path = tmp_path / "trace.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailrace.cli.main", "serve", str(pipe), "--port", "0",
         "--trace-out", str(path)],
        cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("tailrace: serving loud on http://127.0.0.1:"), line
        base = line.split(" on ")[1].split()[0]
        deadline = time.monotonic() + 30
        while httpx.get(base.removesuffix("/v1") + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        r = httpx.post(base + "/pipelines/loud/runs", json={"text": "hey"})
        assert r.status_code == 200
        deadline = time.monotonic() + 10  # written within about a second, server running
        while not path.read_text().endswith("\n"):
            assert time.monotonic() < deadline, "the line was not written while serving"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    rows = read(path)
    assert [(r["pipeline"], r["outcome"], r["prompt_tokens"]) for r in rows] == [
        ("loud", "ok", 1)]


@pytest.mark.parametrize("extra,message", [
    (["--trace-out", "{tmp}/missing/t.jsonl"],
     "{tmp}/missing/t.jsonl: cannot write the trace: No such file or directory; give a "
     "writable file in an existing directory"),
    (["--trace-out", "{tmp}/t.jsonl", "--runtime", "ray"],
     "--trace-out is not available with --runtime ray: the pipelines are served from a Ray "
     "actor; serve with --runtime local to record a trace")])
def test_bad_trace_options_are_one_line(pipe, tmp_path, capsys, extra, message):
    args = [a.format(tmp=tmp_path) for a in extra]
    assert main(["serve", str(pipe), "--port", "0", *args]) == 2
    assert capsys.readouterr().err.strip() == "tailrace: error: " + message.format(tmp=tmp_path)
    assert not (tmp_path / "t.jsonl").exists()
