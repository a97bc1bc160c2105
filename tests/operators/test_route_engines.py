"""route with the two real local models: SmolLM2-135M-Instruct (chat) and Gemma 3 270M
(base model: completion prompt and stop strings), by rule and by cascade."""

from __future__ import annotations

from dataclasses import fields

import pytest

import tailrace as tr
from tailrace.engines import GenerationRequest, model_info, model_path, open_engine
from tailrace.errors import EngineError

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SMALL = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 2}
BIG = {"backend": "llama_cpp", "model": "gemma3-270m", "n_threads": 2}


@pytest.fixture(scope="module", autouse=True)
def models():
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        try:
            model_path(model_info(name, "llama_cpp"))
        except EngineError as e:
            pytest.skip(str(e))


def routed(**kw) -> tr.Pipeline:
    p = tr.Pipeline("routed", engines={"small": SMALL, "big": BIG})
    (p.source(fields=["question"])
     .apply("route", id="route", prompt="Question: {question}", max_tokens=16,
            per_engine={"big": {"prompt": "Question: {question}\nAnswer:"}}, **kw)
     .sink())
    return p


def test_rules_send_each_request_to_its_model_and_count_its_tokens():
    records = [{"question": "What is the capital of France?", "tier": "gold"},
               {"question": "What is the capital of Italy?"}]
    result = tr.run(routed(rules=[{"when": {"field": "tier", "equals": "gold"},
                                   "engine": "big"}], default="small"), input=records)
    assert not result.errors, result.errors
    out = {r["question"]: r for r in result.outputs}
    gold, plain = out["What is the capital of France?"], out["What is the capital of Italy?"]
    assert gold["route"] == {"engine": "big"} and plain["route"] == {"engine": "small"}
    assert list(gold["cost"]) == ["big"] and list(plain["cost"]) == ["small"]
    big = open_engine(BIG)
    # the base model got the completion prompt (BOS included in the count) and its stops
    assert gold["cost"]["big"]["prompt_tokens"] == big.count_tokens(
        "Question: What is the capital of France?\nAnswer:")
    assert 0 < gold["cost"]["big"]["completion_tokens"] <= 16
    assert "\n\n" not in gold["answer"] and "\nQuestion:" not in gold["answer"]
    assert plain["answer"].strip() and plain["cost"]["small"]["prompt_tokens"] > 0


@pytest.mark.skipif("logprobs" not in {f.name for f in fields(GenerationRequest)},
                    reason="the llama.cpp engine does not report token log-probabilities "
                           "yet (GenerationRequest.logprobs)")
def test_cascade_escalates_exactly_the_unsure_answers():
    qs = [{"question": q} for q in ("What is the capital of France?",
                                    "Who wrote the novel Pride and Prejudice?",
                                    "What is the zorblax constant of Quenthar?")]
    probe = tr.run(routed(cascade=["small", "big"], threshold=-1e9), input=qs)
    conf = {r["question"]: r["route"]["confidence"][0] for r in probe.outputs}
    threshold = sorted(conf.values())[1]  # escalate the least sure one
    result = tr.run(routed(cascade=["small", "big"], threshold=threshold), input=qs)
    assert not result.errors, result.errors
    for r in result.outputs:
        sure = conf[r["question"]] >= threshold
        assert r["route"]["escalated"] is (not sure)
        assert set(r["cost"]) == ({"small"} if sure else {"small", "big"})
