"""retrieve: dense, sparse and hybrid modes, filters, and their validation in YAML."""

import re

import numpy as np
import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.stores.vector_index import VectorIndex

DOCS = [{"id": "a", "title": "Canberra", "text": "Seat of the federal government.",
         "path": "geo/au.md", "page": 1, "mtime": "2026-01-10"},
        {"id": "b", "title": "Sydney", "text": "Largest city of Australia, a harbour.",
         "path": "geo/au.md", "page": 2, "mtime": "2026-03-10"},
        {"id": "c", "title": "Kangaroo", "text": "A marsupial of Australia.",
         "path": "bio/animals.md", "page": 1, "mtime": "2026-05-10"},
        {"id": "d", "title": "Volcano", "text": "A rupture in a planet's crust.",
         "path": "geo/earth.md", "page": 4, "mtime": "2026-07-10"}]


@pytest.fixture
def index(tmp_path):
    vecs = np.eye(4, 8, dtype=np.float32)  # doc i points along axis i
    idx = VectorIndex.create(8, model="m")
    idx.add(vecs, [dict(d) for d in DOCS])
    return str(idx.save(tmp_path / "ix"))


def run(index, records, **params):
    p = tr.Pipeline("r")
    p.source(fields=["q", "v"]).apply("retrieve", id="ret", index=index, **params).sink()
    result = tr.run(p, input=records)
    assert not result.errors, result.errors
    return [[h["title"] for h in r["passages"]] for r in result.outputs]


def axis(i):
    return np.eye(1, 8, i, dtype=np.float32)[0]


def test_dense_is_the_default_mode(index):
    assert run(index, [{"v": axis(3)}], query="v", k=1) == [["Volcano"]]


def test_sparse_searches_the_words(index):
    assert run(index, [{"q": "marsupial"}], mode="sparse", text="q", k=3) == [["Kangaroo"]]


def test_hybrid_fuses_vector_and_words(index):
    out = run(index, [{"v": axis(3), "q": "marsupial"}], mode="hybrid", query="v", text="q",
              k=2, fusion={"k": 60, "dense": 1.0, "sparse": 2.0})
    assert out == [["Kangaroo", "Volcano"]]  # the sparse ranking weighs twice


def test_filters_apply_inside_the_search(index):
    # the vector points at Volcano, but only geo/au.md pages from before April may come back
    flt = {"path": {"in": ["geo/au.md"]}, "mtime": {"lt": "2026-04-01"}}
    [dense] = run(index, [{"v": axis(3)}], query="v", k=2, filter=flt)
    assert sorted(dense) == ["Canberra", "Sydney"]  # both at cosine 0: k hits all the same
    assert run(index, [{"q": "Australia"}], mode="sparse", text="q", k=5,
               filter={"page": {"gte": 2}}) == [["Sydney"]]
    assert run(index, [{"v": axis(0), "q": "Australia"}], mode="hybrid", query="v", text="q",
               k=5, filter={"path": "bio/animals.md"}) == [["Kangaroo"]]


def test_a_record_without_the_text_field_is_an_error_record(index):
    p = tr.Pipeline("r")
    p.source(fields=["q"]).apply("retrieve", id="ret", index=index, mode="sparse",
                                 text="q").sink()
    result = tr.run(p, input=[{"q": 5}, {"q": "volcano"}])
    assert [h["title"] for h in result.outputs[0]["passages"]] == ["Volcano"]
    assert [e.message for e in result.errors] == ["field 'q' must be text, got int"]


BAD = {
    "unknown mode": ("{mode: fuzzy, query: v}",
                     "'mode' must be one of dense, sparse, hybrid, got 'fuzzy'"),
    "sparse without text": ("{mode: sparse}",
                            "mode sparse needs 'text' (the field holding the query text, "
                            "for BM25)"),
    "hybrid without query": ("{mode: hybrid, text: q}",
                             "mode hybrid needs 'query' (a vector field written by an embed "
                             "stage)"),
    "dense without query": ("{k: 3}", "mode dense needs 'query' (a vector field written by "
                                      "an embed stage)"),
    "text in dense": ("{query: v, text: q}",
                      "mode dense searches vectors only; drop 'text' or use mode: hybrid"),
    "fusion outside hybrid": ("{mode: sparse, text: q, fusion: {k: 10}}",
                              "'fusion' applies to mode hybrid, not sparse"),
    "unknown fusion key": ("{mode: hybrid, query: v, text: q, fusion: {rrf_k: 10}}",
                           "unknown fusion key(s) rrf_k; known: k, dense, sparse, candidates"),
    "bad fusion weight": ("{mode: hybrid, query: v, text: q, fusion: {sparse: -1}}",
                          "fusion 'sparse' (a weight) must be a number >= 0, got -1"),
    "zero weights": ("{mode: hybrid, query: v, text: q, fusion: {sparse: 0, dense: 0}}",
                     "fusion weights 'dense' and 'sparse' are both 0; give one > 0"),
    "bad filter": ("{query: v, filter: {page: {between: [1, 2]}}}",
                   "filter on 'page': unknown operator(s) between; known: eq, in, gt, gte, "
                   "lt, lte"),
    "live sparse": ("{mode: sparse, text: q, index: 'live:news'}",
                    "a live index searches dense vectors without filters; use a saved index "
                    "(tailrace ingest) for sparse, hybrid or filtered retrieval"),
}


@pytest.mark.parametrize("params,message", BAD.values(), ids=list(BAD))
def test_bad_retrieve_params_fail_at_compile_time_with_one_line(params, message):
    extra = params[1:-1]
    if "index:" not in extra:
        extra += ", index: ix"
    text = ("version: 1\npipeline: t\nsource: {fields: [q, v]}\nstages:\n"
            f"  - {{id: r, op: retrieve, {extra}}}\n")
    with pytest.raises(tr.PlanError, match=re.escape(f"p.yaml:5: stage 'r': {message}") + "$"):
        tr.compile_pipeline(loads_pipeline(text, "p.yaml"))


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_hybrid_with_a_filter_on_both_runtimes(index, runtime, request):
    if runtime == "ray":
        request.getfixturevalue("ray_session")
    p = tr.Pipeline("r")
    (p.source(fields=["q", "v"])
     .apply("retrieve", id="ret", index=index, mode="hybrid", query="v", text="q", k=5,
            filter={"path": {"in": ["geo/au.md", "geo/earth.md"]}},
            fusion={"dense": 1.0, "sparse": 3.0})
     .sink())
    result = tr.run(p, input=[{"v": axis(3), "q": "harbour"}], runtime=runtime)
    assert not result.errors
    assert [h["title"] for h in result.outputs[0]["passages"]][:2] == ["Sydney", "Volcano"]
    assert "Kangaroo" not in [h["title"] for h in result.outputs[0]["passages"]]
