"""The command line: run, plan and demo, and every bad input's one-line error (exit 2)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tailrace.cli.main import main
from tailrace.request import REQUEST

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPE = """\
version: 1
pipeline: cli
source: {fields: [text]}
stages:
  - {id: up, op: map, fn: tests.fixtures.ops.upper, input: text, output: loud}
  - {id: size, op: map, fn: tests.fixtures.ops.n_chars, input: loud, output: n}
"""


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    pipe = tmp_path / "p.yaml"
    pipe.write_text(PIPE)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"text": "ab"}\n{"text": "cde"}\n')
    return pipe, inp, tmp_path


def test_run_jsonl_in_and_out_with_metrics(files, capsys):
    pipe, inp, tmp = files
    out, metrics = tmp / "out.jsonl", tmp / "m.json"
    rc = main(["run", str(pipe), "--input", str(inp), "--output", str(out),
               "--metrics-json", str(metrics)])
    assert rc == 0
    assert [json.loads(x) for x in out.read_text().splitlines()] == [
        {"text": "ab", "loud": "AB", "n": 2}, {"text": "cde", "loud": "CDE", "n": 3}]
    m = json.loads(metrics.read_text())
    assert (m["records_in"], m["records_out"], m["errors"]) == (2, 2, 0)
    assert [s["stage"] for s in m["stages"]] == ["source", "up", "size", "sink"]
    assert set(m["stages"][1]["service_us"]) == {"count", "mean", "min", "max", "p50", "p95",
                                                 "p99"}
    table = capsys.readouterr().err
    assert "stage" in table and "wait p99" in table and "2 in, 2 out, 0 errors" in table


def test_run_to_stdout(files, capsys):
    pipe, inp, _ = files
    assert main(["run", str(pipe), "-i", str(inp), "-q"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == '{"text": "ab", "loud": "AB", "n": 2}'


def test_bad_jsonl_lines_become_error_records_and_exit_2(files, capsys):
    pipe, _, tmp = files
    inp = tmp / "bad.jsonl"
    inp.write_text('{"text": "ok"}\n{"text": \n[1, 2]\n{"other": 1}\n')
    out = tmp / "out.jsonl"
    rc = main(["run", str(pipe), "-i", str(inp), "-o", str(out), "-q"])
    assert rc == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"tailrace: error: {inp}:2: invalid JSON: Expecting value (column 11)",
        f"tailrace: error: {inp}:3: expected a JSON object, got an array",
    ]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4  # every input line produced an output or an error record
    assert rows[0]["error"]["stage"] == "input" and rows[0]["input"]["line"] == 2
    assert {"text": "ok", "loud": "OK", "n": 2} in rows
    missing = [r for r in rows if r.get("error", {}).get("stage") == "up"]
    assert missing[0]["error"]["message"] == "record has no field 'text' (it has: other)"


@pytest.mark.parametrize("args,message", [
    (["run", "missing.yaml"], "tailrace: error: missing.yaml: no such file; check the path"),
    (["plan", "missing.yaml"], "tailrace: error: missing.yaml: no such file; check the path"),
])
def test_missing_pipeline_file(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == message


def test_missing_input_file(files, capsys):
    pipe, _, tmp = files
    assert main(["run", str(pipe), "-i", str(tmp / "nope.jsonl")]) == 2
    missing = tmp / "nope.jsonl"
    assert capsys.readouterr().err.strip() == f"tailrace: error: {missing}: no such input file"


def test_invalid_yaml_is_one_line_and_debug_shows_traceback(files, capsys):
    _, _, tmp = files
    bad = tmp / "bad.yaml"
    bad.write_text("version: 1\npipeline: x\nstages: [\n")
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:4: invalid YAML" in err
    assert main(["plan", str(bad), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_plan_formats(files, capsys):
    pipe, _, _ = files
    assert main(["plan", str(pipe), "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [s["id"] for s in plan["stages"]] == ["source", "up+size+sink"]
    assert main(["plan", str(pipe), "-f", "mermaid", "--no-fuse"]) == 0
    assert capsys.readouterr().out.startswith("flowchart LR\n")


def test_ctrl_c_stops_cleanly_and_keeps_output(tmp_path):
    """SIGINT mid-run: exit 130, partial stats, no traceback, output flushed."""
    pipe = tmp_path / "slow.yaml"
    pipe.write_text("version: 1\npipeline: slow\nstages:\n"
                    "  - {id: nap, op: map, fn: tests.fixtures.ops.slow_identity, "
                    "blocking: true}\n")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"i": 1}\n' * 10_000)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailrace.cli.main", "run", str(pipe), "-i", str(inp),
         "-o", str(out)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while (not out.exists() or out.stat().st_size == 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # wait for the run to be under way (polling, not timing)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "INTERRUPTED" in err and "tailrace: interrupted; output so far was written" in err
    lines = out.read_text().splitlines()
    assert 0 < len(lines) < 10_000 and all(json.loads(x) == {"i": 1} for x in lines)


def test_run_with_admission_policy(files, capsys):
    pipe, inp, tmp = files
    out = tmp / "out.jsonl"
    assert main(["run", str(pipe), "-i", str(inp), "-o", str(out), "-q",
                 "--admission", "slo", "--max-in-flight", "1"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["text"] for r in rows) == ["ab", "cde"]
    assert all(REQUEST not in r for r in rows)


def test_negative_slo_budget_is_a_clear_error(files, capsys):
    pipe, inp, tmp = files
    bad = tmp / "slo.yaml"
    bad.write_text(PIPE.replace("source:", "slo: {p99_ms: -5}\nsource:"))
    assert main(["run", str(bad), "-i", str(inp), "--admission", "slo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tailrace: error: {bad}: slo for pipeline 'cli': p99_ms must be a "
                   "positive number of milliseconds, got -5")


def test_unknown_admission_policy_is_refused_by_the_parser(files, capsys):
    pipe, inp, _ = files
    with pytest.raises(SystemExit) as e:
        main(["run", str(pipe), "--admission", "lifo"])
    assert e.value.code == 2
    assert "invalid choice: 'lifo'" in capsys.readouterr().err
