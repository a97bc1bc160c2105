"""prompt, refine (token packing), MMR and select without any model."""

import numpy as np
import pytest

import tailrace as tr
from tailrace.operators.retrieval import Packer, mmr


def test_prompt(run):
    p = tr.Pipeline("t")
    (p.source([{"q": "2+2", "n": 1}, {"n": 2}])
     .apply("prompt", id="p", template="Q{n}: {q}", output="text").sink())
    result = run(p)
    assert result.outputs == [{"q": "2+2", "n": 1, "text": "Q1: 2+2"}]
    assert result.errors[0].message == "template needs field 'q' (record has: n)"


def test_prompt_fields_are_checked_at_compile_time():
    p = tr.Pipeline("t")
    p.source(fields=["question"]).apply("prompt", id="p", template="{questoin}").sink()
    with pytest.raises(tr.PlanError, match="stage 'p': reads unknown field 'questoin'; did you "
                       "mean 'question'"):
        tr.compile_pipeline(p)


def test_select(run):
    p = tr.Pipeline("t")
    s = p.source([{"a": 1, "b": 2, "c": 3}])
    s.apply("select", fields=["a", "c"]).sink(keep := [])
    s.apply("select", drop=["a"]).sink(dropped := [])
    run(p)
    assert keep == [{"a": 1, "c": 3}] and dropped == [{"b": 2, "c": 3}]


def words(text):
    return len(text.split())


def test_packer_dedups_keeps_order_and_truncates():
    passages = [{"title": "A", "text": "alpha beta gamma delta"},
                {"title": "A2", "text": "alpha beta gamma delta"},  # duplicate text
                {"title": "B", "text": "one two three four five six seven eight nine ten"}]
    context, kept = Packer(max_tokens=16, dedup=0.8, count=words).pack(passages)
    assert [p["title"] for p in kept] == ["A", "B"]
    assert context.splitlines()[0] == "[1] A: alpha beta gamma delta"
    assert context.splitlines()[1].startswith("[2] B: one two") and context.endswith("...")
    assert words(context) <= 16


def test_packer_budget_too_small_for_anything():
    context, kept = Packer(max_tokens=3, dedup=0.8, count=words).pack(
        [{"title": "A", "text": "a b c d e f"}])
    assert context == "" and kept == []


def test_mmr_prefers_diverse_documents():
    q = np.array([1.0, 0.0])
    docs = np.array([[1.0, 0.0], [0.99, 0.141], [0.7, 0.714]], dtype=np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    assert mmr(q, docs, 2, diversity=0.0) == [0, 1]  # pure relevance
    assert mmr(q, docs, 2, diversity=0.7) == [0, 2]  # the near-duplicate is skipped


def test_engine_operator_batch_sizes_must_be_positive():
    p = tr.Pipeline("t", engines={"e": {"backend": "onnx", "model": "minilm-l6-int8"}})
    p.source(fields=["q"]).apply("embed", id="emb", engine="e", input="q", output="v",
                                 max_batch=0).sink()
    with pytest.raises(tr.PlanError, match=r"stage 'emb': 'max_batch' must be a positive "
                       r"integer, got 0$"):
        tr.compile_pipeline(p)
