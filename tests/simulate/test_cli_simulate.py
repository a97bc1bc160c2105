"""``tailrace simulate`` as a user runs it: the report, trace replay, --find, and a clear
one-line error for every bad input."""

from __future__ import annotations

import json

import pytest

from tailrace.cli.main import main
from tailrace.simulate import EngineProfile, LinearModel, Profile, StageProfile

RAG = """version: 1
pipeline: rag
slo: {p99_ms: 2000, priority: interactive}
source: {fields: [question]}
engines:
  llm: {backend: llama_cpp, model: smollm2-135m-instruct, replicas: 1}
stages:
  - {id: answer, op: generate, engine: llm, prompt: "{question}", output: answer,
     max_tokens: 32, batch: {max_size: 8}, replicas: 4}
"""


def rag_profile() -> Profile:
    return Profile(
        "rag",
        {"answer": StageProfile(LinearModel({"const": 0.0002}), "llm",
                                LinearModel({"const": 40.0, "tokens": 1.0}), 20.0, 24),
         "sink": StageProfile(LinearModel({}))},
        {"llm": EngineProfile("continuous", LinearModel({"const": 0.01, "decoding": 0.001,
                                                          "prefill": 0.0001}, cv=0.05),
                              n_seq_max=4, chunk=16, start_s=0.5)},
        input_tokens=10)


@pytest.fixture
def files(tmp_path):
    yaml = tmp_path / "rag.yaml"
    yaml.write_text(RAG)
    prof = tmp_path / "rag.json"
    rag_profile().save(prof)
    return tmp_path, str(yaml), str(prof)


def sim(argv, capsys):
    code = main(["simulate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_simulation_prints_the_stage_table_and_the_pipelines_figures(files, capsys):
    tmp, yaml, prof = files
    figures = tmp / "out.json"
    code, out, _ = sim([yaml, "--profile", prof, "--rate", "5", "--requests", "400",
                        "--json", str(figures)], capsys)
    assert code == 0
    assert "svc p99" in out and "answer" in out  # the per-stage table of a real run
    assert "SLO met" in out and "engine llm: 1 replicas" in out
    summary = json.loads(figures.read_text())
    rag = summary["pipelines"]["rag"]
    assert rag["arrivals"] == rag["ok"] == 400
    assert 0 < rag["p50_s"] <= rag["p99_s"] and rag["slo_attainment"] is not None


def test_a_recorded_trace_is_replayed_under_another_configuration(files, capsys):
    tmp, yaml, prof = files
    trace = tmp / "trace.jsonl"
    trace.write_text("".join(json.dumps({
        "t": i * 0.1, "pipeline": "rag", "prompt_tokens": 12, "max_tokens": 32,
        "output_tokens": 20, "latency_s": 0.5, "outcome": "ok"}) + "\n" for i in range(300)))
    figures = tmp / "out.json"
    code, out, _ = sim([yaml, "--profile", prof, "--trace", str(trace), "--replicas", "3",
                        "--admission", "slo", "--json", str(figures)], capsys)
    assert code == 0
    assert "recorded in the trace p50 500ms p99 500ms" in out
    summary = json.loads(figures.read_text())
    assert summary["pipelines"]["rag"]["arrivals"] == 300
    assert summary["pools"]["llm"]["replicas"] == 3
    assert summary["admission"]["policy"] == "slo"


def test_find_replicas_answers_the_least_that_meets_the_slo(files, capsys):
    tmp, yaml, prof = files
    code, out, err = sim([yaml, "--profile", prof, "--rate", "30", "--requests", "1500",
                          "--find", "replicas", "--slo", "p99_ms=1500"], capsys)
    assert code == 0
    n = int(out.strip().rsplit(" ", 1)[1])
    assert n > 1 and f"replicas={n}: " in err and f"replicas={n - 1}: " in err

    def p99(replicas: int) -> float:
        figures = tmp / f"r{replicas}.json"
        assert sim([yaml, "--profile", prof, "--rate", "30", "--requests", "1500",
                    "--replicas", f"llm={replicas}", "--json", str(figures)], capsys)[0] == 0
        return json.loads(figures.read_text())["pipelines"]["rag"]["p99_s"]

    assert p99(n) <= 1.5 < p99(n - 1)


def test_a_kill_and_a_slow_node_are_simulated(files, capsys):
    tmp, yaml, prof = files
    figures = tmp / "out.json"
    code, out, _ = sim([yaml, "--profile", prof, "--rate", "5", "--requests", "300",
                        "--replicas", "2", "--kill", "10:llm:0", "--slow", "5:0:3",
                        "--json", str(figures)], capsys)
    assert code == 0
    pool = json.loads(figures.read_text())["pools"]["llm"]
    assert pool["restarts"] == 1 and pool["failed_calls"] == 0


@pytest.mark.parametrize("extra, message", [
    (["--kill", "10:llm"], "--kill '10:llm': expected T:ENGINE:REPLICA"),
    (["--kill", "1:nope:0"], "--kill: no engine 'nope'"),
    (["--kill", "1:llm:5"], "--kill: engine 'llm' has replicas 0..0"),
    (["--slow", "a:0:2"], "--slow 'a:0:2': expected T:NODE:FACTOR"),
    (["--replicas", "llm=0"], "--replicas 'llm=0': expected N or ENGINE=N"),
    (["--replicas", "gpu=2"], "--replicas: no engine 'gpu'"),
    (["--find", "replicas"], "--find needs --slo p99_ms=MS"),
    (["--nodes", "0"], "--nodes and --max-in-flight must be >= 1"),
    (["--runtime", "ray", "--find", "nodes", "--slo", "p99_ms=900"],
     "--find nodes with --runtime ray: a Ray run's engines are one actor each"),
])
def test_bad_options_are_one_clear_line(files, capsys, extra, message):
    _, yaml, prof = files
    code, out, err = sim([yaml, "--profile", prof, "--rate", "5", "--requests", "50",
                          *extra], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_bad_rate_is_one_clear_line(files, capsys):
    _, yaml, prof = files
    code, _, err = sim([yaml, "--profile", prof, "--rate", "fast"], capsys)
    assert code == 2 and "--rate: 'fast' is not a number" in err
    code, _, err = sim([yaml, "--profile", prof, "--rate", "other=3"], capsys)
    assert code == 2 and "--rate: no pipeline 'other'; pipelines: rag" in err


def test_bad_profiles_name_the_file_and_what_is_wrong(files, capsys):
    tmp, yaml, prof = files
    code, _, err = sim([yaml, "--profile", str(tmp / "none.json"), "--rate", "5"], capsys)
    assert code == 2 and "none.json: no such profile (make one with: tailrace profile" in err
    raw = json.loads((tmp / "rag.json").read_text())
    raw["engines"]["llm"]["model"]["coef"]["gpu"] = 1.0
    bad = tmp / "bad.json"
    bad.write_text(json.dumps(raw))
    code, _, err = sim([yaml, "--profile", str(bad), "--rate", "5"], capsys)
    assert code == 2 and f"{bad}: engines.llm.model.coef: unknown driver 'gpu'" in err
    raw = json.loads((tmp / "rag.json").read_text())
    del raw["stages"]["answer"]
    bad.write_text(json.dumps(raw))
    code, _, err = sim([yaml, "--profile", str(bad), "--rate", "5"], capsys)
    assert code == 2 and "has no stage 'answer'" in err


def test_bad_traces_name_the_line(files, capsys):
    tmp, yaml, prof = files
    trace = tmp / "t.jsonl"
    trace.write_text('{"t": 0, "pipeline": "rag"}\n{"t": -1, "pipeline": "rag"}\n')
    code, _, err = sim([yaml, "--profile", prof, "--trace", str(trace)], capsys)
    assert code == 2 and f"{trace}:2: t must be seconds >= 0, got -1" in err
    trace.write_text('{"t": 0, "pipeline": "other"}\n')
    code, _, err = sim([yaml, "--profile", prof, "--trace", str(trace)], capsys)
    assert code == 2 and "requests for other, which are not among the pipelines" in err
    trace.write_text("not json\n")
    code, _, err = sim([yaml, "--profile", prof, "--trace", str(trace)], capsys)
    assert code == 2 and f"{trace}:1: not JSON" in err
