"""route with scripted engines that report token log-probabilities: rules by field and
prompt length, a cascade that escalates unsure answers, cost accounting, refusals."""

from __future__ import annotations

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler import compile_pipeline
from tailrace.engines import BACKENDS, Generation
from tailrace.errors import PlanError
from tailrace.operators.route import route_statistics


class SureEngine:
    """Answers ``NAME: PROMPT``; confidence -2.0 when the prompt says 'hard', else -0.1.
    Prompt tokens are words; completion tokens are fixed per engine."""

    context_length = 128

    def __init__(self, path: str, model: str, completion: int = 3, chat: bool = True,
                 logprobs: bool = True) -> None:
        self.model, self.completion, self.chat, self.logprobs = model, completion, chat, logprobs
        self.calls: list[int] = []

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, requests, on_token=None):
        self.calls.append(len(requests))
        out = []
        for r in requests:
            text = r.messages[-1]["content"] if self.chat else r.prompt
            extra = {"mean_logprob": -2.0 if "hard" in text else -0.1} if self.logprobs else {}
            out.append(Generation(f"{self.model}: {text}", self.count_tokens(text),
                                  self.completion, "stop", extra))
        return out

    def close(self) -> None:
        pass


@pytest.fixture(params=[True, False], ids=["local-fused", "local-unfused"])
def run(request):
    """Local executors only: the scripted engines are registered in this process; a Ray host
    actor would not know the 'sure' backend."""
    return lambda p, **kw: tr.run(p, runtime="local", fuse=request.param, **kw)


def spec(model: str, **kw) -> dict:
    return {"backend": "sure", "path": __file__, "model": model, **kw}


@pytest.fixture(autouse=True)
def sure_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "sure",
                        ("tests.operators.test_route", "SureEngine", ("generate",)))


def pipeline(engines: dict, **kw) -> tr.Pipeline:
    p = tr.Pipeline("routed", engines=engines)
    p.source(fields=["q"]).apply("route", id="route", prompt="{q}", **kw).sink()
    return p


def by_q(result) -> dict:
    assert not result.errors, result.errors
    return {r["q"]: r for r in result.outputs}


def test_cascade_escalates_unsure_answers_and_counts_tokens_per_engine(run):
    engines = {"small": spec("small"), "big": spec("big", completion=5)}
    result = run(pipeline(engines, cascade=["small", "big"], threshold=-1.0,
                          label="cascade-test"),
                 input=[{"q": "an easy one"}, {"q": "a hard one"}])
    out = by_q(result)
    easy, hard = out["an easy one"], out["a hard one"]
    assert result.stats["route"].counters == {  # this run's cost, in the run's stats
        "requests": 2, "escalated": 1, "small.requests": 2, "small.tokens": 12,
        "big.requests": 1, "big.tokens": 8}
    assert "route: requests 2, escalated 1, small.requests 2, small.tokens 12" in \
        tr.format_stats(result.stats)
    assert easy["answer"] == "small: an easy one"
    assert easy["route"] == {"engine": "small", "confidence": [-0.1], "escalated": False}
    assert easy["cost"] == {"small": {"prompt_tokens": 3, "completion_tokens": 3}}
    assert hard["answer"] == "big: a hard one"
    assert hard["route"] == {"engine": "big", "confidence": [-2.0, -2.0], "escalated": True}
    assert hard["cost"] == {"small": {"prompt_tokens": 3, "completion_tokens": 3},
                            "big": {"prompt_tokens": 3, "completion_tokens": 5}}
    stats = route_statistics()["cascade-test"]
    assert (stats.requests, stats.escalated) == (2, 1)
    assert stats.engines["small"]["requests"] == 2 and stats.engines["big"]["requests"] == 1
    assert stats.engines["big"]["completion_tokens"] == 5
    route_statistics()  # snapshots are copies
    from tailrace.operators import route as mod

    mod._LEDGERS.pop("cascade-test")


def test_rules_route_by_field_and_prompt_length_in_batched_calls(run):
    from tailrace.engines import open_engine

    engines = {"small": spec("small2"), "big": spec("big2")}
    rules = [{"when": {"field": "tier", "equals": "gold"}, "engine": "big"},
             {"when": {"field": "lang", "in": ["fr", "de"]}, "engine": "big"},
             {"when": {"prompt_tokens_over": 4}, "engine": "big"}]
    records = [{"q": "hi", "tier": "gold"}, {"q": "salut", "lang": "fr"},
               {"q": "one two three four five"}, {"q": "short"}, {"q": "also short"}]
    out = by_q(run(pipeline(engines, rules=rules, default="small"), input=records))
    assert {q: r["route"]["engine"] for q, r in out.items()} == {
        "hi": "big", "salut": "big", "one two three four five": "big", "short": "small",
        "also short": "small"}
    assert out["short"]["answer"] == "small2: short"
    assert out["hi"]["cost"] == {"big": {"prompt_tokens": 1, "completion_tokens": 3}}
    assert open_engine(engines["big"]).calls[-1] == 3  # one batched call per engine


def test_per_engine_prompts_for_base_models_and_cascade_thresholds(run):
    engines = {"a": spec("a"), "b": spec("b"), "base": spec("base", chat=False)}
    out = by_q(run(pipeline(engines, cascade=["a", "b", "base"], threshold=[-1.0, -3.0],
                            per_engine={"base": {"prompt": "Q: {q}\nA:"}}),
                   input=[{"q": "hard"}]))
    assert out["hard"]["route"]["engine"] == "b"  # -2.0 passes the second threshold (-3.0)
    engines2 = {"a": spec("a"), "base": spec("base", chat=False)}
    out = by_q(run(pipeline(engines2, cascade=["a", "base"],
                            per_engine={"base": {"prompt": "Q: {q}\nA:"}}),
                   input=[{"q": "hard"}]))
    assert out["hard"]["answer"] == "base: Q: hard\nA:"


def test_an_engine_without_logprobs_cannot_decide_a_cascade(run):
    engines = {"small": spec("nolp", logprobs=False), "big": spec("big")}
    result = run(pipeline(engines, cascade=["small", "big"]), input=[{"q": "x"}])
    [err] = result.errors
    assert err.message.startswith("cascade level 1: engine 'small' reports no token "
                                  "log-probabilities")
    # ... but it can be the last level, or a rule target
    engines = {"big": spec("big"), "small": spec("nolp", logprobs=False)}
    assert by_q(run(pipeline(engines, cascade=["big", "small"]), input=[{"q": "hard"}]))


def test_an_overlong_prompt_is_an_error_record_and_the_rest_go_on(run):
    engines = {"small": spec("small"), "big": spec("big")}
    result = run(pipeline(engines, rules=[], default="small", max_tokens=120),
                 input=[{"q": "w " * 10}, {"q": "ok"}])
    [err] = result.errors
    assert err.error == "ContextOverflow"
    assert "engine 'small': prompt has 10 tokens; with max_tokens=120 it exceeds the model " \
           "context of 128 tokens" in err.message
    assert [r["q"] for r in result.outputs] == ["ok"]


@pytest.mark.parametrize("stage,message", [
    ("{id: r, op: route, prompt: '{q}', cascade: [a]}",
     "'cascade' must list at least two engine names"),
    ("{id: r, op: route, prompt: '{q}', cascade: [a, b], rules: []}",
     "route needs exactly one of 'rules' \\(with 'default'\\), 'cascade'"),
    ("{id: r, op: route, prompt: '{q}', rules: []}", "'rules' needs 'default'"),
    ("{id: r, op: route, prompt: '{q}', rules: [{when: {equals: 1}, engine: a}], default: a}",
     r"rules\[0\]\.when: use field \+ equals/in/exists, or prompt_tokens_over"),
    ("{id: r, op: route, prompt: '{q}', cascade: [a, b], threshold: [-1, -2]}",
     r"'threshold' needs one value per escalation \(1\), got 2"),
    ("{id: r, op: route, prompt: '{q}', cascade: [a, nope]}", "unknown engine 'nope'"),
    ("{id: r, op: route, prompt: '{q}', cascade: [a, b], per_engine: {b: {top_p: 1}}}",
     "per_engine.b: must name a routed engine"),
])
def test_compile_time_refusals(stage, message):
    text = ("version: 1\npipeline: p\nengines:\n  a: {backend: llama_cpp, model: "
            "smollm2-135m-instruct}\n  b: {backend: llama_cpp, model: smollm2-135m-instruct}\n"
            f"stages:\n  - {stage}\n")
    with pytest.raises(PlanError, match=r"p\.yaml:7: stage 'r': " + message):
        compile_pipeline(loads_pipeline(text, "p.yaml"))
