"""``tailrace run --trace-out``: one JSON line per input record as it ends (arrival,
tokens, latency, outcome), the output unchanged; a bad path or ``--runtime ray`` is a
one-line error before anything runs."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tailrace.cli.main import main
from tailrace.control.gate import approx_prompt_tokens
from tests.serving import fakes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "src", "tailrace", "demo", "text-stats.yaml")
KEYS = ["t", "pipeline", "prompt_tokens", "max_tokens", "output_tokens", "latency_s",
        "outcome"]


def lines(path) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        assert list(r) == KEYS, r  # exactly these keys, in this order
        assert type(r["t"]) is float and r["t"] >= 0
        assert type(r["latency_s"]) is float and r["latency_s"] >= 0
        assert type(r["prompt_tokens"]) is int and r["prompt_tokens"] > 0
        assert r["max_tokens"] is None or type(r["max_tokens"]) is int
        assert r["output_tokens"] is None or type(r["output_tokens"]) is int
        assert r["outcome"] in ("ok", "error", "rejected")
    ends = [r["t"] + r["latency_s"] for r in rows]
    assert all(b >= a - 2e-6 for a, b in itertools.pairwise(ends)), ends  # in end order
    return rows


@pytest.mark.parametrize("admission", [[], ["--admission", "fcfs", "--max-in-flight", "1"]],
                         ids=["no-admission", "fcfs"])
def test_run_writes_one_line_per_input_record(tmp_path, monkeypatch, admission):
    monkeypatch.chdir(ROOT)
    # distinct sizes: a record's prompt_tokens tells which line is its own
    records = [{"id": i, "topic": "hydro", "text": "water " * (8 * i)} for i in range(1, 6)]
    records.insert(2, {"id": 99, "topic": "no text field here, so normalize fails"})
    inp, out, trace = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "trace.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["run", DEMO, "-i", str(inp), "-o", str(out), "-q", "--trace-out", str(trace),
                 *admission]) == 0
    outputs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(outputs) == 6 and all("_request" not in r for r in outputs)
    assert sum("error" in r for r in outputs) == 1
    rows = lines(trace)
    assert len(rows) == len(records)
    assert {r["pipeline"] for r in rows} == {"text-stats"}
    assert all(r["max_tokens"] is None and r["output_tokens"] is None for r in rows)
    by_size = {r["prompt_tokens"]: r for r in rows}
    sizes = [approx_prompt_tokens(r) for r in records]
    assert sorted(by_size) == sorted(sizes)  # every record has its line, once
    assert [by_size[n]["outcome"] for n in sizes] == ["ok", "ok", "error", "ok", "ok", "ok"]
    arrivals = [by_size[n]["t"] for n in sizes]
    assert arrivals == sorted(arrivals)  # read in input order


def test_generate_stage_gives_budget_and_output_tokens(tmp_path, monkeypatch):
    fakes.register_echo(monkeypatch)
    monkeypatch.chdir(ROOT)
    pipe = tmp_path / "echo.yaml"
    pipe.write_text(f"""\
version: 1
pipeline: echo-qa
engines:
  llm: {{backend: echo, model: echo, path: {fakes.__file__}}}
source: {{fields: [question]}}
stages:
  - {{id: answer, op: generate, engine: llm, input: question, output: answer,
     max_tokens: 8, usage: usage}}
""")
    inp, out, trace = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "trace.jsonl"
    inp.write_text('{"question": "one two three"}\n{"nothing": 1}\n'
                   '{"question": "a b c d e f g h i j k l"}\n')
    assert main(["run", str(pipe), "-i", str(inp), "-o", str(out), "-q",
                 "--trace-out", str(trace)]) == 0
    rows = lines(trace)
    assert len(rows) == 3 and {r["pipeline"] for r in rows} == {"echo-qa"}
    assert all(r["max_tokens"] == 8 for r in rows)
    got = sorted((r["outcome"], r["output_tokens"]) for r in rows)
    assert got == [("error", None), ("ok", 3), ("ok", 8)]  # the echo's words, at most 8


def test_a_bad_trace_path_is_one_line_before_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"text": "x"}\n')
    missing = tmp_path / "no" / "such" / "trace.jsonl"
    out = tmp_path / "out.jsonl"
    assert main(["run", DEMO, "-i", str(inp), "-o", str(out), "--trace-out",
                 str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tailrace: error: {missing}: cannot write the trace: No such file or "
                   "directory; give a writable file in an existing directory"]
    assert out.read_text() == ""  # nothing ran
    assert main(["run", DEMO, "-i", str(inp), "--trace-out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tailrace: error: {tmp_path}: cannot write "
                                               "the trace: Is a directory")


def test_trace_out_with_ray_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    trace = tmp_path / "trace.jsonl"
    assert main(["run", DEMO, "--runtime", "ray", "--trace-out", str(trace)]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --trace-out is not available with --runtime ray (records a stage "
        "drops are not reported to the driver); run with --runtime local to record a trace")
    assert not trace.exists()


def test_ctrl_c_writes_the_lines_of_what_was_read(tmp_path):
    """SIGINT mid-run: the records that ended have ok lines, those read and not
    finished error lines (one still in a stage's thread may be written after the
    interrupt: its line says error); the file is complete JSONL."""
    pipe = tmp_path / "slow.yaml"
    pipe.write_text("version: 1\npipeline: slow\nstages:\n"
                    "  - {id: nap, op: map, fn: tests.fixtures.ops.slow_identity, "
                    "blocking: true}\n")
    inp, out, trace = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "trace.jsonl"
    inp.write_text('{"i": 1}\n' * 10_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailrace.cli.main", "run", str(pipe), "-i", str(inp),
         "-o", str(out), "-q", "--trace-out", str(trace)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (trace.exists() and trace.stat().st_size):
        assert time.monotonic() < deadline, "no trace line within 20 s"
        time.sleep(0.05)  # under way: the first lines were written while it runs
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    outputs = out.read_text().splitlines()
    rows = lines(trace)
    assert 0 < len(outputs) < 10_000
    assert {r["outcome"] for r in rows} <= {"ok", "error"}
    assert 0 < sum(r["outcome"] == "ok" for r in rows) <= len(outputs) <= len(rows) < 10_000
