"""The collaborative engine (``backend: collab``) on real llama.cpp models.

With the same model on both sides (SmolLM2-135M twice) every routing must give the very
answer the model gives alone (greedy): that checks the catch-up prefill keeps both KV
caches in step with the answer, whoever wrote which token. A different pair of
vocabularies is refused; the Qwen2.5-Coder 0.5B/1.5B pair (when assembled) is accepted
and really shares the work.
"""

from __future__ import annotations

import json
import threading

import pytest

from tailrace.engines.base import GenerationRequest
from tailrace.engines.collab import CollaborativeEngine, check_spec, make_router
from tailrace.engines.collab.router import (
    DRAFT_FEATURES,
    FEATURES,
    Threshold,
    draft_features,
    features,
)
from tailrace.engines.llama_cpp import LlamaCppEngine
from tailrace.errors import EngineError
from tests.operators.test_route_budget_real import QWEN_HOME

pytestmark = pytest.mark.engine

SMOL = {"model": "smollm2-135m-instruct", "n_threads": 2, "n_ctx": 512}
SKY = GenerationRequest(messages=({"role": "user", "content":
                                   "Name three colours and say why the sky is blue."},),
                        max_tokens=32)
HAIKU = GenerationRequest(messages=({"role": "user", "content": "Write a haiku about the sea."},),
                          max_tokens=24)
COLOURS = GenerationRequest(messages=({"role": "user", "content":
                                       "List five colours, one per line."},), max_tokens=40)


@pytest.fixture(scope="module")
def alone():
    eng = LlamaCppEngine(**SMOL, n_seq_max=2)
    yield {id(r): eng.generate([r])[0].text for r in (SKY, HAIKU, COLOURS)}
    eng.close()


@pytest.fixture(scope="module")
def twin():
    eng = CollaborativeEngine(SMOL, SMOL, router={"kind": "random", "rate": 0.5},
                              span="token", n_seq_max=4)
    yield eng
    eng.close()


@pytest.mark.parametrize("router", [{"kind": "small"}, {"kind": "large"},
                                    {"kind": "random", "rate": 0.5, "seed": 3},
                                    {"kind": "threshold", "metric": "top1", "threshold": 0.6}])
@pytest.mark.parametrize("span", ["token", "line", 5, "draft"])
def test_any_routing_of_one_model_gives_its_own_answer(twin, alone, router, span):
    from tailrace.engines.collab.engine import parse_span

    twin.span = parse_span(span)
    try:
        got = twin.collaborate([SKY, HAIKU, COLOURS], router=make_router(router))
    finally:
        twin.span = 1
    assert [g.text for g in got] == [alone[id(SKY)], alone[id(HAIKU)], alone[id(COLOURS)]]
    for g in got:
        x = g.extra
        assert x["small_tokens"] + x["large_tokens"] == g.completion_tokens > 0
        assert x["decisions"] >= 1
    if span == "draft":  # the large model wrote exactly the lines whose drafts were refused
        for g in got:
            assert g.extra["drafted_away"] >= g.extra["large_tokens"] > 0 \
                or g.extra["drafted_away"] == g.extra["large_tokens"] == 0
    if router["kind"] == "small":
        assert all(g.extra["large_tokens"] == 0 for g in got)
    elif router["kind"] == "large":
        assert all(g.extra["small_tokens"] == 0 for g in got)
    elif router["kind"] == "random":
        assert sum(g.extra["large_tokens"] for g in got) > 0
        assert sum(g.extra["small_tokens"] for g in got) > 0


def test_concurrent_calls_batch_on_the_shared_engines(twin, alone):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = twin.generate([SKY if i % 2 else HAIKU])[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == {i: alone[id(SKY if i % 2 else HAIKU)] for i in range(6)}


@pytest.mark.parametrize("span", ["token", "draft"])
def test_streams_pieces_and_a_caller_that_leaves_stops_its_answer(twin, alone, span):
    from tailrace.engines.collab.engine import parse_span

    twin.span = parse_span(span)
    try:
        pieces: list[str] = []
        got = twin.generate([COLOURS], on_token=lambda i, p: pieces.append(p))
        assert "".join(pieces) == got[0].text == alone[id(COLOURS)]
        (cut,) = twin.generate([COLOURS], on_token=lambda i, p: False)
        assert cut.finish_reason == "cancelled"
        # token: the first piece; draft: the first line, the first text sent
        first = alone[id(COLOURS)].split("\n")[0]
        assert cut.completion_tokens <= (2 if span == "token" else twin.count_tokens(first) + 1)
        # the slots came back: the engine still answers
        assert twin.generate([HAIKU])[0].text == alone[id(HAIKU)]
    finally:
        twin.span = 1


def test_trace_records_each_decision(twin):
    (g,) = twin.collaborate([SKY], router=make_router({"kind": "threshold", "threshold": 0.5}),
                            trace=True)
    trace = g.extra["trace"]
    assert len(trace) == g.extra["decisions"] == g.completion_tokens
    f, large, position = trace[0]
    assert position == 0 and len(f) == len(FEATURES)
    assert large == (f[0] < 0.5)  # top-1 probability below the threshold: the large one
    assert sum(1 for _, big, _ in trace if big) == g.extra["large_tokens"]


class Judge:
    """A draft router that refuses the drafts whose numbers are in ``refuse``."""

    def __init__(self, refuse):
        self.refuse, self.n, self.seen = set(refuse), 0, []

    def __call__(self, f):
        self.seen.append(f)
        self.n += 1
        return self.n - 1 in self.refuse


def test_a_refused_draft_is_taken_back_and_the_large_model_writes_that_line(twin, alone):
    from tailrace.engines.collab.engine import parse_span

    twin.span = parse_span("draft")
    try:
        pieces: list[str] = []
        judge = Judge({0, 2})
        (g,) = twin.collaborate([COLOURS], on_token=lambda i, p: pieces.append(p),
                                router=judge, trace=True)
        keep = Judge(())
        (kept,) = twin.collaborate([COLOURS], router=keep)
    finally:
        twin.span = 1
    # the caller saw only the answer: no refused draft reached it
    assert "".join(pieces) == g.text == alone[id(COLOURS)] == kept.text
    assert g.text.count("\n") >= 3  # several lines: several drafts
    x = g.extra
    assert x["decisions"] == judge.n >= 4 and x["switches"] == 4  # S L S L S...
    assert x["large_tokens"] > 0 and x["drafted_away"] >= x["large_tokens"]
    assert x["small_tokens"] + x["large_tokens"] == g.completion_tokens \
        == kept.completion_tokens
    assert [big for _, big, _ in x["trace"]] == [i in (0, 2) for i in range(judge.n)]
    # the first draft is judged by its own tokens: position 0, features of the draft
    f, _, position = x["trace"][0]
    assert position == 0 and len(f) == len(DRAFT_FEATURES)
    assert 0 < f[0] <= f[3] <= 1  # least top-1 <= mean top-1
    assert kept.extra["large_tokens"] == kept.extra["drafted_away"] == 0


def test_draft_features_of_known_confidences():
    f = draft_features([(0.9, 0.2, 0.8), (0.3, 1.5, 0.1), (0.6, 0.7, 0.4)], 64, 8, 0.5)
    assert list(f) == pytest.approx([0.3, 1.5, 0.1, 0.6, 1 / 3, 3 / 32, 0.25, 0.5, 0.5])
    assert DRAFT_FEATURES[:3] == FEATURES[:3]  # threshold metrics read the same places
    assert Threshold("top1", 0.5)(f) is True and Threshold("top1", 0.2)(f) is False


def test_a_policy_trained_for_another_span_is_refused(tmp_path):
    p = tmp_path / "policy.json"
    n = len(FEATURES)
    p.write_text(json.dumps({"version": 1, "features": list(FEATURES), "weights": [0.0] * n,
                             "bias": 2.0}))
    with pytest.raises(EngineError) as e:
        check_spec("coder", {"backend": "collab", "small": SMOL, "large": SMOL,
                             "span": "draft", "router": {"kind": "learned", "policy": str(p)}})
    assert "trained for span: line decisions; use that span or train again" in str(e.value)
    assert "\n" not in str(e.value)
    # draft is the default span: the same policy with no span is refused too
    with pytest.raises(EngineError, match="trained for span: line"):
        check_spec("coder", {"backend": "collab", "small": SMOL, "large": SMOL,
                             "router": {"kind": "learned", "policy": str(p)}})
    check_spec("coder", {"backend": "collab", "small": SMOL, "large": SMOL, "span": "line",
                         "router": {"kind": "learned", "policy": str(p)}})


def test_features_of_a_known_distribution():
    import numpy as np

    row = np.log(np.array([0.5, 0.25, 0.25], dtype=np.float32))
    f = features(row, 10, 2, 0.25, True)
    assert f[0] == pytest.approx(0.5)
    assert f[1] == pytest.approx(-(0.5 * np.log(0.5) + 0.5 * np.log(0.25)), rel=1e-5)
    assert f[2] == pytest.approx(0.25)
    assert list(f[3:]) == pytest.approx([10 / 256, 2 / 16, 0.25, 1.0])
    assert Threshold("entropy", 1.0)(f) is True
    assert Threshold("top1", 0.4)(f) is False


def test_models_with_different_vocabularies_are_refused_at_compile_time(tmp_path):
    import tailrace as tr

    with pytest.raises(EngineError, match="do not share a tokenizer"):
        CollaborativeEngine(SMOL, {"model": "gemma3-270m", "n_threads": 2, "n_ctx": 512})
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\npipeline: duo\nsource: {fields: [q]}\nengines:\n"
                    "  duo: {backend: collab, small: {model: smollm2-135m-instruct},\n"
                    "        large: {model: gemma3-270m}}\nstages:\n"
                    "  - {id: a, op: generate, engine: duo, input: q, output: a}\n")
    with pytest.raises(Exception) as e:
        tr.compile_pipeline(tr.Pipeline.from_yaml(str(path)))
    msg = str(e.value)
    assert "engine 'duo'" in msg and "do not share a tokenizer (49,152 vs 262,144 tokens)" \
        in msg and "\n" not in msg, msg


@pytest.mark.parametrize("spec, message", [
    ({"router": {"kind": "oracle"}}, "unknown router kind 'oracle'; kinds: small, large"),
    ({"router": {"kind": "learned"}}, "router learned needs policy: FILE"),
    ({"router": {"kind": "learned", "policy": "/nope/policy.json"}},
     "policy file not found: /nope/policy.json"),
    ({"router": {"kind": "threshold", "metric": "top3"}}, "threshold metric must be one of"),
    ({"router": {"kind": "threshold", "threshold": 2}}, "threshold between 0.0 and 1.0"),
    ({"router": {"kind": "random"}}, "router random needs rate between"),
    ({"router": {"kind": "random", "rate": 0.2, "temp": 1}}, "does not take temp"),
    ({"span": "paragraph"}, "span must be token, line, draft or a number"),
    ({"large": None}, "collab needs large: {model: NAME}"),
    ({"large": {"model": "no-such-model"}}, "no-such-model"),
    ({"large": {"model": "smollm2-135m-instruct", "replicas": 2}}, "keys from model, path"),
    ({"n_seq_max": 0}, "n_seq_max must be an integer from 1 to 64"),
    ({"grammar": "x"}, "does not take grammar"),
])
def test_bad_specs_are_one_line_errors_naming_the_engine(spec, message):
    full = {"backend": "collab", "small": {"model": "smollm2-135m-instruct"},
            "large": {"model": "smollm2-135m-instruct"}, **spec}
    with pytest.raises(EngineError) as e:
        check_spec("coder", full)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("engine 'coder")


def test_a_policy_file_of_another_shape_is_refused(tmp_path):
    p = tmp_path / "policy.json"
    p.write_text("not json")
    with pytest.raises(EngineError, match="is not JSON"):
        make_router({"kind": "learned", "policy": str(p)})
    p.write_text(json.dumps({"version": 1, "features": ["top1"], "weights": [1], "bias": 0}))
    with pytest.raises(EngineError, match="train it again"):
        make_router({"kind": "learned", "policy": str(p)})
    n = len(FEATURES)
    p.write_text(json.dumps({"version": 1, "features": list(FEATURES), "weights": [0.0] * n,
                             "bias": 2.0}))
    assert make_router({"kind": "learned", "policy": str(p)})(features_row()) is True
    assert make_router({"kind": "learned", "policy": str(p), "threshold": 0.95})(
        features_row()) is False


def features_row():
    import numpy as np

    return features(np.zeros(4, dtype=np.float32), 0, 0, 0.0, False)


@pytest.mark.skipif(QWEN_HOME is None, reason="needs make models-arbitrage (Qwen chunk packages)")
def test_the_qwen_coder_pair_shares_a_tokenizer_and_the_work(monkeypatch):
    monkeypatch.setenv("TAILRACE_HOME", QWEN_HOME)
    eng = CollaborativeEngine({"model": "qwen2.5-coder-0.5b-instruct", "n_ctx": 512},
                              {"model": "qwen2.5-coder-1.5b-instruct", "n_ctx": 512},
                              router={"kind": "random", "rate": 0.5}, span="line")
    try:
        req = GenerationRequest(messages=({"role": "user", "content":
                                           "Write a Python function add(a, b) returning a + b. "
                                           "Code only."},), max_tokens=48)
        (g,) = eng.generate([req])
        assert "def add" in g.text
        assert g.extra["small_tokens"] > 0 and g.extra["large_tokens"] > 0
        assert g.extra["small_model"] == "qwen2.5-coder-0.5b-instruct"
        # drafts: the small model's unsure lines go to the large model
        eng.span = -1
        (d,) = eng.collaborate([req], router=make_router(
            {"kind": "threshold", "threshold": 0.9}, names=DRAFT_FEATURES))
        assert "def add" in d.text and d.extra["decisions"] >= 2
        assert d.extra["drafted_away"] >= d.extra["large_tokens"]
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["qwen2.5-coder-line.json", "qwen2.5-coder-draft.json"])
def test_the_shipped_policies_load_for_the_span_they_were_trained_for(name):
    from pathlib import Path

    from tailrace.engines.collab.router import read_policy

    path = Path(__file__).resolve().parents[2] / "examples" / "routers" / name
    span = json.loads(path.read_text())["trained"]["span"]
    names = DRAFT_FEATURES if span == "draft" else FEATURES
    policy = read_policy(path, "router", names)
    assert policy["trained"]["paths"] > 0
    with pytest.raises(EngineError, match="trained for span"):
        read_policy(path, "router", FEATURES if span == "draft" else DRAFT_FEATURES)


def test_a_draft_policy_without_mean_and_scale_reads_draft_features(tmp_path):
    p = tmp_path / "draft.json"
    n = len(DRAFT_FEATURES)
    p.write_text(json.dumps({"version": 1, "features": list(DRAFT_FEATURES),
                             "weights": [0.0] * (n - 1) + [-8.0], "bias": 2.0}))
    route = make_router({"kind": "learned", "policy": str(p)}, names=DRAFT_FEATURES)
    f = draft_features([(0.9, 0.2, 0.8)], 0, 0, 0.0)
    assert route(f) is True  # large share 0: the bias decides
    f[-1] = 1.0
    assert route(f) is False  # the last weight reads the large model's share
