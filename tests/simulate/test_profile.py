"""Profiles: the fit, the file format and its errors, and ``tailrace profile`` on the
real engines (llama.cpp SmolLM2 and the ONNX embedder) and the local runtime."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tailrace.api.pipeline import Pipeline
from tailrace.cli.main import main
from tailrace.compiler import compile_pipeline
from tailrace.simulate import (
    EngineProfile,
    LinearModel,
    Profile,
    ProfileError,
    StageProfile,
    load_profile,
)
from tailrace.simulate.engines import sequence_features, step_features
from tailrace.simulate.measure import fit_relative, fit_steps, order_statistics
from tailrace.simulate.profile import CALL_DRIVERS, SEQUENCE_DRIVERS, STAGE_DRIVERS

DEMO = Path(__file__).resolve().parents[2] / "src" / "tailrace" / "demo"


# -- the fit --------------------------------------------------------------------------------

def test_fit_recovers_known_coefficients():
    rng = random.Random(1)
    rows = [{"items": n, "tokens": n * t} for n in (1, 4, 16, 64) for t in (8, 32, 128)]
    truth = {"const": 0.002, "items": 0.0005, "tokens": 0.00001}
    secs = [truth["const"] + truth["items"] * r["items"] + truth["tokens"] * r["tokens"]
            for r in rows]
    m = LinearModel.fit(rows, secs, CALL_DRIVERS)
    for k, v in truth.items():
        assert m.coef[k] == pytest.approx(v, rel=1e-6)
    assert m.error < 1e-9 and m.samples == len(rows)
    noisy = [s * (1 + rng.uniform(-0.05, 0.05)) for s in secs]
    m = LinearModel.fit(rows, noisy, CALL_DRIVERS)
    assert 0 < m.error < 0.05 and m.coef["items"] == pytest.approx(truth["items"], rel=0.2)


def test_fit_never_gives_a_negative_coefficient():
    # seconds fall with tokens: the best unconstrained coefficient is negative, dropped
    rows = [{"records": 1, "tokens": t} for t in (10, 20, 30, 40)]
    secs = [0.010 - 0.0001 * r["tokens"] for r in rows]
    m = LinearModel.fit(rows, secs, STAGE_DRIVERS)
    assert all(v >= 0 for v in m.coef.values())
    assert m.coef["tokens"] == 0.0 and m.coef["const"] + m.coef["records"] > 0


def test_fit_steps_recovers_a_step_model_from_whole_calls():
    """``const`` of a step model is per step: a call's time is const x steps + ...; the
    replayed scheduler says how many steps each call took."""
    truth = LinearModel({"const": 0.003, "decoding": 0.004, "prefill": 0.0003})
    shape = EngineProfile("continuous", LinearModel({}), n_seq_max=4, chunk=16, n_batch=512)
    rows, secs = [], []
    for n in (1, 2, 4, 8):
        for p in (32, 128, 384):
            for o in (8, 32):
                x = step_features(shape, [(p, o)] * n)
                rows.append(x)
                secs.append(truth(**x))  # const x steps + decoding x d + prefill x p
    m = fit_steps(rows, secs)
    for k, v in truth.coef.items():
        assert m.coef[k] == pytest.approx(v, rel=1e-6)
    assert m.error < 1e-9
    # the plain fit would take const for an intercept: not the step model
    assert LinearModel.fit(rows, secs, ("const", "decoding", "prefill")).coef["const"] \
        != pytest.approx(0.003, rel=0.01)


def test_fit_sequences_recovers_a_servers_model_from_whole_calls():
    truth = LinearModel({"const": 0.01, "prefill": 0.0005, "tokens": 0.02, "crowd": 0.004})
    rows = [sequence_features([(p, o)] * n) for n in (1, 2, 4, 8) for p in (32, 128, 384)
            for o in (8, 32)]
    m = LinearModel.fit(rows, [truth(**x) for x in rows], SEQUENCE_DRIVERS)
    for k, v in truth.coef.items():
        assert m.coef[k] == pytest.approx(v, rel=1e-6)


def test_fit_relative_recovers_coefficients_and_weighs_small_rows():
    rows = [{"records": r, "tokens": t * r} for r in (1, 8, 64) for t in (5, 20)]
    truth = LinearModel({"const": 0.0002, "records": 0.0001, "tokens": 0.00001})
    m = fit_relative(rows, [truth(**x) for x in rows], STAGE_DRIVERS)
    for k, v in truth.coef.items():
        assert m.coef[k] == pytest.approx(v, rel=1e-6)
    # single records at 0.2 ms +-20%, one batch of 64 at 6.6 ms: the plain fit serves the
    # batch and misses the small rows; weighed by 1 / seconds, the mean relative error
    # (what ``error`` reports) is smaller
    rows = [{"records": 1, "tokens": 10}] * 4 + [{"records": 64, "tokens": 640}]
    secs = [0.00024, 0.00016, 0.0003, 0.0001, 0.0066]
    plain, weighed = (LinearModel.fit(rows, secs, STAGE_DRIVERS),
                      fit_relative(rows, secs, STAGE_DRIVERS))
    assert weighed.error < plain.error
    assert all(v >= 0 for v in weighed.coef.values()) and weighed.samples == 5


def test_fit_relative_spread_is_not_blown_up_by_one_busy_row():
    rows = [{"records": r, "tokens": 10.0 * r} for r in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)]
    secs = [0.001 * r * (1.1 if r % 2 else 0.9) for r in range(1, 11)]
    secs[4] *= 20  # one row measured while something else ran
    m = fit_relative(rows, secs, STAGE_DRIVERS)
    assert 0.05 < m.cv < 0.5  # the others' +-10%; std(measured / predicted) would be ~5
    assert LinearModel.fit(rows, secs, STAGE_DRIVERS).cv > 1


# -- the file ---------------------------------------------------------------------------------

def sample_profile() -> Profile:
    return Profile(
        "wiki-qa",
        {"embed": StageProfile(LinearModel({"const": 0.001, "records": 0.0001}, 0.1, 10),
                               "embedder", LinearModel({})),
         "answer": StageProfile(LinearModel({"const": 0.002}, 0.2, 10, 0.3), "llm",
                                LinearModel({"const": 150.0, "tokens": 1.0}, 0.05, 20), 30.5,
                                29, (12, 30, 32, 32)),
         "output+sink": StageProfile(LinearModel({"const": 1e-5}))},
        {"llm": EngineProfile("continuous", LinearModel({"const": 0.003, "decoding": 0.004,
                                                          "prefill": 0.003}, 0.02, 48),
                              8, 16, 512, 0.4),
         "embedder": EngineProfile("calls", LinearModel({"const": 0.002, "items": 0.0005,
                                                         "tokens": 0.0001}), start_s=0.25)},
        "Linux, x86_64, 2 CPUs", "2026-01-01T00:00:00+00:00", ("measured",), 11.5)


def test_order_statistics_keep_the_ends_and_thin_the_middle():
    assert order_statistics([5, 1, 3]) == (1, 3, 5)
    kept = order_statistics(list(range(1000)), 11)
    assert kept == (0, 100, 200, 300, 400, 500, 599, 699, 799, 899, 999)


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "p.json"
    prof = sample_profile()
    prof.save(path)
    assert load_profile(path) == prof
    assert json.loads(path.read_text())["version"] == 1


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["engines"]["llm"]["model"]["coef"].update(steps=1.0),
     "engines.llm.model.coef: unknown driver 'steps'"),
    (lambda d: d["stages"]["answer"]["service"]["coef"].update(const=-0.5),
     "stages.answer.service.coef.const: must be a number >= 0, got -0.5"),
    (lambda d: d.update(version=2), "version must be 1, got 2"),
    (lambda d: d["stages"]["answer"].update(engine="gpu"),
     "stages.answer.engine: 'gpu' is not among the profile's engines"),
    (lambda d: d["engines"]["llm"].update(kind="batch"), "engines.llm.kind: must be one of"),
    (lambda d: d["stages"]["answer"].update(output_samples=[3, -1]),
     "stages.answer.output_samples: must be a list of integers >= 0"),
])
def test_load_names_the_file_and_the_bad_key(tmp_path, edit, message):
    path = tmp_path / "bad.json"
    raw = sample_profile().to_dict()
    edit(raw)
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_load_of_a_missing_or_broken_file_names_it(tmp_path):
    with pytest.raises(ProfileError, match=r"nope\.json: no such profile \(make one with: "
                                           r"tailrace profile PIPELINE\.yaml"):
        load_profile(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match=r"x\.json: not a JSON profile"):
        load_profile(tmp_path / "x.json")


# -- the command --------------------------------------------------------------------------------

def profile(argv, capsys):
    code = main(["profile", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_pipeline_without_engines_is_profiled_from_its_bundled_sample(tmp_path, capsys):
    out = tmp_path / "p.json"
    code, stdout, err = profile([str(DEMO / "text-stats.yaml"), "--out", str(out),
                                 "--repeat", "1"], capsys)
    assert code == 0, err
    prof = load_profile(out)
    plan = compile_pipeline(Pipeline.from_yaml(str(DEMO / "text-stats.yaml")))
    assert set(prof.stages) == {s.id for s in plan.stages if s.execution is not None}
    assert "normalize+words+long" in prof.stages and not prof.engines
    assert prof.input_tokens > 0 and prof.created and "CPUs" in prof.machine
    assert any("sample.jsonl" in n for n in prof.notes)
    assert "normalize+words+long" in stdout and "FIT ERR" in stdout
    assert "stages: " in err


def test_bad_input_is_one_clear_line(tmp_path, capsys):
    ok = str(DEMO / "text-stats.yaml")
    cases = [
        ([str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "p.json")],
         "nope.yaml: no such pipeline file"),
        ([ok, "--out", str(tmp_path / "no" / "p.json")], "no such directory"),
        ([ok, "--out", str(tmp_path)], "is a directory"),
        ([ok, "--out", str(tmp_path / "p.json"), "--input", str(tmp_path / "in.jsonl")],
         "in.jsonl: no such input file"),
        ([ok, "--out", str(tmp_path / "p.json"), "--records", "0"],
         "--records and --repeat must be at least 1"),
    ]
    for argv, message in cases:
        code, stdout, err = profile(argv, capsys)
        assert code == 2, (argv, err)
        lines = err.strip().splitlines()
        assert lines[-1].startswith("tailrace: error: ") and message in lines[-1], err
        assert not (tmp_path / "p.json").exists()


def test_a_pipeline_without_a_sample_needs_input(tmp_path, capsys):
    shutil.copy(DEMO / "text-stats.yaml", tmp_path / "mine.yaml")
    code, _, err = profile([str(tmp_path / "mine.yaml"), "--out", str(tmp_path / "p.json")],
                           capsys)
    assert code == 2 and "--input: give the records to profile pipeline 'text-stats'" in err


def test_an_engine_that_fails_is_one_clear_line(tmp_path, capsys):
    pytest.importorskip("openai")
    (tmp_path / "p.yaml").write_text(
        "version: 1\npipeline: remote\nsource: {fields: [question]}\nengines:\n"
        "  llm: {backend: openai, base_url: 'http://127.0.0.1:9/v1', model: m, "
        "timeout_s: 2, retries: 0}\n"
        "stages:\n  - {id: answer, op: generate, engine: llm, prompt: '{question}'}\n")
    (tmp_path / "in.jsonl").write_text('{"question": "hi"}\n')
    code, _, err = profile([str(tmp_path / "p.yaml"), "--out", str(tmp_path / "p.json"),
                            "--input", str(tmp_path / "in.jsonl")], capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("tailrace: error: ") and "cannot connect" in last, err
    assert not (tmp_path / "p.json").exists()


# -- on the real engines -------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    from tailrace.engines.models import model_info, model_path
    from tailrace.errors import TailraceError

    try:
        model_path(model_info("smollm2-135m-instruct", "llama_cpp"))
        model_path(model_info("minilm-l6-int8", "onnx"))
        from tailrace.stores.corpus import read_fanoutqa

        read_fanoutqa(None, 1)
    except TailraceError as e:
        pytest.skip(str(e))


@pytest.mark.engine
@pytest.mark.slow
def test_profile_of_wiki_qa_on_the_real_engines(models, tailrace_home, tmp_path, capsys):
    out = tmp_path / "wiki-qa.json"
    yaml = str(DEMO / "wiki-qa.yaml")
    code, stdout, err = profile([yaml, "--out", str(out), "--quick", "--records", "6",
                                 "--repeat", "2"], capsys)
    assert code == 0, err
    prof = load_profile(out)
    plan = compile_pipeline(Pipeline.from_yaml(yaml))
    assert set(prof.stages) == {s.id for s in plan.stages if s.execution is not None}
    llm, emb = prof.engines["llm"], prof.engines["embedder"]
    assert llm.kind == "continuous" and (llm.n_seq_max, llm.chunk) == (8, 16)
    # a step costs something per token; which term takes it is the fit's choice: --quick's
    # 8 medians on a busy machine have put the per-sequence cost into the constant
    # (decoding 0.0, const 0.021 s), so either term counts
    c = llm.model.coef
    assert llm.model.error < 0.5 and c["const"] >= 0 and llm.start_s > 0
    assert c["decoding"] > 0 or c["prefill"] > 0
    assert emb.kind == "calls" and emb.model.samples == 4
    answer = prof.stages["answer"]
    assert answer.engine == "llm" and answer.prompt_tokens is not None
    assert 0 < answer.output_tokens <= 32
    assert len(answer.output_samples) >= 6 and answer.output_samples == tuple(sorted(
        answer.output_samples)) and max(answer.output_samples) <= 32
    assert min(answer.output_samples) <= answer.output_tokens <= max(answer.output_samples)
    # the system prompt and the template's head: shared by every request
    assert 10 < answer.shared_tokens < answer.prompt_tokens(tokens=prof.input_tokens)
    assert prof.stages["embed"].engine == "embedder"
    assert prof.stages["refine"].engine is None  # it only counts tokens with the llm's
    assert prof.stages["output+sink"].engine is None
    assert "FanOutQA" in prof.notes[0] and prof.input_tokens > 1
    assert "llm" in stdout and "answer" in stdout and "engine llm: " in err
