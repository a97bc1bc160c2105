"""rerank with any scoring function, and refine's sources with passage metadata."""

import re

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tests.rag_fixtures import EMBEDDER

PASSAGES = [{"title": "A", "text": "red apples", "path": "f/a.md", "page": 1,
             "heading": "Fruit > Apples"},
            {"title": "B", "text": "green pears and red apples", "path": "f/b.md", "page": 3},
            {"title": "C", "text": "blue sky", "path": "f/c.md", "page": 2}]


def overlap(question, texts):
    """A stand-in cross-encoder: how many question words each text holds."""
    words = set(question.lower().split())
    return [len(words & set(t.lower().split())) for t in texts]


def run(stage_params, records, op="rerank"):
    p = tr.Pipeline("r", engines={"embedder": EMBEDDER})
    p.source(fields=["q", "passages"]).apply(op, id="s", **stage_params).sink()
    result = tr.run(p, input=records)
    return result


def test_a_scorer_alone_orders_passages_by_its_scores():
    result = run({"input": "passages", "query": "q", "k": 2, "scorer": overlap},
                 [{"q": "green pears red apples", "passages": PASSAGES}])
    [rec] = result.outputs
    assert [(p["title"], p["rerank_score"]) for p in rec["passages"]] == [("B", 4.0),
                                                                         ("A", 2.0)]
    assert rec["passages"][0]["path"] == "f/b.md"  # passages keep their metadata


def test_a_scorer_by_dotted_path_in_yaml():
    text = ("version: 1\npipeline: t\nsource: {fields: [q, passages]}\nstages:\n"
            "  - {id: s, op: rerank, input: passages, query: q, k: 1,\n"
            "     scorer: tests.operators.test_rerank_sources.overlap}\n")
    result = tr.run(loads_pipeline(text), input=[{"q": "blue", "passages": PASSAGES}])
    assert [p["title"] for p in result.outputs[0]["passages"]] == ["C"]


def test_a_scorer_returning_the_wrong_count_is_a_record_error():
    result = run({"input": "passages", "query": "q", "scorer": lambda q, ts: [1.0]},
                 [{"q": "x", "passages": PASSAGES}])
    assert not result.outputs
    assert "one number per passage; got 1 values for 3 passages" in result.errors[0].message


@pytest.mark.parametrize("params,message", [
    ("input: passages, query: q", "rerank needs 'engine' (an embedding engine: MMR by "
     "cosine), 'scorer' (a function (question, texts) -> scores, e.g. a cross-encoder) or "
     "both (scorer relevance, MMR diversity)"),
    ("input: passages, query: q, scorer: tests.operators.test_rerank_sources.overlap, "
     "diversity: 0.5", "'diversity' needs 'engine' (an embedding engine measures how alike "
     "passages are); drop it or add the engine"),
])
def test_bad_rerank_params_fail_at_compile_time(params, message):
    text = ("version: 1\npipeline: t\nsource: {fields: [q, passages]}\nstages:\n"
            f"  - {{id: s, op: rerank, {params}}}\n")
    with pytest.raises(tr.PlanError, match=re.escape(f"stage 's': {message}") + "$"):
        tr.compile_pipeline(loads_pipeline(text, "p.yaml"))


@pytest.mark.engine
def test_scorer_relevance_with_embedding_diversity():
    near_dupes = [{"title": "A1", "text": "red apples are sweet"},
                  {"title": "A2", "text": "red apples are sweet fruit"},
                  {"title": "P", "text": "pears are green"}]
    params = {"input": "passages", "query": "q", "k": 2, "scorer": overlap,
              "engine": "embedder"}
    plain = run({**params, "diversity": 0.0}, [{"q": "red apples sweet fruit pears",
                                                 "passages": near_dupes}])
    diverse = run({**params, "diversity": 0.9}, [{"q": "red apples sweet fruit pears",
                                                  "passages": near_dupes}])
    assert [p["title"] for p in plain.outputs[0]["passages"]] == ["A2", "A1"]
    assert [p["title"] for p in diverse.outputs[0]["passages"]] == ["A2", "P"]
    assert diverse.outputs[0]["passages"][0]["rerank_score"] == 4.0  # the scorer's score


def test_refine_sources_carry_the_passages_metadata():
    result = run({"input": "passages", "output": "context", "sources": "sources",
                  "source_fields": ["title", "path", "page", "heading"]},
                 [{"q": "x", "passages": PASSAGES[:2]}], op="refine")
    [rec] = result.outputs
    assert rec["sources"] == [{"title": "A", "path": "f/a.md", "page": 1,
                               "heading": "Fruit > Apples"},
                              {"title": "B", "path": "f/b.md", "page": 3}]
    titles = run({"input": "passages", "sources": "sources"},
                 [{"q": "x", "passages": PASSAGES[:2]}], op="refine")
    assert titles.outputs[0]["sources"] == ["A", "B"]  # without source_fields: titles


def test_source_fields_without_sources_is_refused():
    text = ("version: 1\npipeline: t\nsource: {fields: [passages]}\nstages:\n"
            "  - {id: s, op: refine, input: passages, source_fields: [path]}\n")
    with pytest.raises(tr.PlanError, match=re.escape(
            "stage 's': 'source_fields' says what each source holds; add 'sources' (the "
            "field to write them to)") + "$"):
        tr.compile_pipeline(loads_pipeline(text, "p.yaml"))


def test_refine_cites_a_place_once_when_several_of_its_chunks_are_kept():
    chunks = [{"title": "A", "text": f"part {i} of the apples section", "path": "f/a.md",
               "heading": "Fruit > Apples"} for i in range(3)] + [PASSAGES[1]]
    result = run({"input": "passages", "output": "context", "sources": "sources",
                  "source_fields": ["path", "heading"]},
                 [{"q": "x", "passages": chunks}], op="refine")
    [rec] = result.outputs
    assert rec["sources"] == [{"path": "f/a.md", "heading": "Fruit > Apples"},
                              {"path": "f/b.md"}]
    assert rec["context"].count("of the apples section") == 3  # the text keeps all three
