"""Metadata filters: equality, in, numeric and date ranges, inside the searches."""

import numpy as np
import pytest

from tailrace.stores.filters import compile_filter
from tailrace.stores.vector_index import VectorIndex

DOCS = [{"id": str(i), "title": f"t{i}", "text": f"chunk {i} about apples",
         "path": f"docs/{'a' if i % 3 == 0 else 'b'}.md", "page": i % 7,
         "mtime": f"2026-{1 + i % 12:02d}-15T10:00:00", "draft": i % 2 == 1}
        for i in range(60)]


@pytest.mark.parametrize("spec,want", [
    ({"path": "docs/a.md"}, lambda d: d["path"] == "docs/a.md"),
    ({"draft": False}, lambda d: not d["draft"]),
    ({"page": 3}, lambda d: d["page"] == 3),
    ({"path": {"in": ["docs/a.md", "docs/c.md"]}}, lambda d: d["path"] == "docs/a.md"),
    ({"page": {"gte": 2, "lt": 5}}, lambda d: 2 <= d["page"] < 5),
    ({"page": {"gt": 5}}, lambda d: d["page"] > 5),
    ({"mtime": {"gte": "2026-03-01", "lte": "2026-04-30"}},
     lambda d: d["mtime"][:7] in ("2026-03", "2026-04")),
    ({"mtime": {"lt": "2026-02-15T10:00:00+00:00"}}, lambda d: d["mtime"][:7] == "2026-01"),
    ({"path": "docs/b.md", "page": {"lte": 1}}, lambda d: d["path"] == "docs/b.md"
     and d["page"] <= 1),
])
def test_filters_keep_exactly_the_matching_documents(spec, want):
    f = compile_filter(spec)
    assert f.mask(DOCS).tolist() == [want(d) for d in DOCS]


def test_missing_or_incomparable_values_do_not_match():
    f = compile_filter({"page": {"gte": 1}})
    assert [f.matches(d) for d in ({}, {"page": "3"}, {"page": True}, {"page": 2})] == \
        [False, False, False, True]
    d = compile_filter({"mtime": {"gte": "2026-01-01"}})
    assert [d.matches(x) for x in ({"mtime": "soon"}, {"mtime": 5}, {"mtime": "2026-02-01"},
                                    {"mtime": "2026-02-01T00:00:00Z"})] == \
        [False, False, True, True]


@pytest.mark.parametrize("spec,msg", [
    ({}, "filter must be a non-empty mapping"),
    ([1], "filter must be a non-empty mapping"),
    ({"page": {"between": [1, 2]}},
     "filter on 'page': unknown operator\\(s\\) between; known: eq, in"),
    ({"page": {}}, "filter on 'page' is empty"),
    ({"page": {"gte": "soon"}}, "filter on 'page': 'gte' must be a number or an ISO date"),
    ({"page": {"in": []}}, "filter on 'page': 'in' must be a non-empty list"),
    ({"page": {"in": "a.md"}}, "filter on 'page': 'in' must be a non-empty list"),
    ({"page": [1, 2]}, "filter on 'page' must be a value"),
    ({"page": {"gte": 1, "lte": "2026-01-01"}}, "filter on 'page' mixes numbers and dates"),
    ({"score": {"gte": 0.5}}, "filter on 'score': it is a search result"),
])
def test_a_bad_filter_is_one_clear_line_naming_the_field(spec, msg):
    with pytest.raises(ValueError, match=msg) as e:
        compile_filter(spec)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_a_filtered_search_returns_k_hits_when_k_documents_match(kind):
    rng = np.random.default_rng(1)
    n = 2000
    docs = [{"id": str(i), "title": f"t{i}", "text": "apples " * (1 + i % 5),
             "shard": i % 100} for i in range(n)]
    vecs = rng.normal(size=(n, 16)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    idx = VectorIndex.create(16, model="m", kind=kind, ef_search=16)
    idx.add(vecs, docs)
    allow = idx.select(compile_filter({"shard": {"in": [7, 8]}}))  # 40 of 2000 (2%)
    assert len(allow) == 40
    q = vecs[:3]
    for hits in idx.search(q, 10, allow=allow):
        assert len(hits) == 10 and {h["shard"] for h in hits} <= {7, 8}
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    exact = (vecs[allow.rows] @ q[0])  # the true top 10 among the allowed ones
    top = sorted(exact, reverse=True)[:10]
    got = [h["score"] for h in idx.search(q[0], 10, allow=allow)[0]]
    assert got == pytest.approx(top, abs=1e-5)
    for hits in idx.search_text(["apples"] * 2, 10, allow=allow):
        assert len(hits) == 10 and {h["shard"] for h in hits} <= {7, 8}
    for hits in idx.hybrid_search(q, ["apples"] * 3, 10, allow=allow):
        assert len(hits) == 10 and {h["shard"] for h in hits} <= {7, 8}
    few = idx.select(compile_filter({"shard": 3}))  # 20 match: all 20 when k is 50
    assert len(idx.search(q[0], 50, allow=few)[0]) == 20
    none = idx.select(compile_filter({"shard": 1000}))
    assert idx.search(q, 5, allow=none) == [[], [], []]
