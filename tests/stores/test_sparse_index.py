"""The BM25 index beside a vector index, and reciprocal rank fusion."""

import numpy as np
import pytest

from tailrace.stores.sparse_index import TOKENIZER, SparseIndex, rrf
from tailrace.stores.vector_index import VectorIndex

DOCS = [{"id": "0", "title": "Canberra", "text": "The seat of government of the country."},
        {"id": "1", "title": "Sydney", "text": "A harbour city; the capital of New South "
                                               "Wales, not of Australia."},
        {"id": "2", "title": "Kangaroo", "text": "A marsupial found in Australia."},
        {"id": "3", "title": "Volcano", "text": "A rupture in the crust of a planet."}]


def test_bm25_ranks_by_shared_words_and_returns_only_matches():
    s = SparseIndex.build(DOCS)
    [hits] = s.search(["marsupial Australia"], 10)
    assert [i for i, _ in hits] == [2, 1]  # doc 2 has both words; 0 and 3 share none
    assert hits[0][1] > hits[1][1] > 0


def test_a_title_match_outranks_the_same_word_in_long_text():
    docs = [{"title": "Earth", "text": "The third planet from the Sun. " * 20},
            {"title": "Mars", "text": "The fourth planet, smaller than Earth."}]
    s = SparseIndex.build(docs)
    assert [i for i, _ in s.search(["Earth"], 2)[0]] == [0, 1]
    assert [i for i, _ in s.search(["Earth"], 2, title_weight=0)[0]] == [1, 0]


def test_the_mask_filters_inside_the_search_so_k_hits_still_come_back():
    docs = [{"title": f"doc {i}", "text": "apple " * (i + 1) + ("red" if i % 2 else "green")}
            for i in range(20)]
    s = SparseIndex.build(docs)
    allow = np.array([d["text"].endswith("green") for d in docs])
    [hits] = s.search(["apple"], 5, allow)
    assert len(hits) == 5 and all(i % 2 == 0 for i, _ in hits)


def test_saved_and_loaded_it_scores_the_same_and_a_stale_one_is_refused(tmp_path):
    s = SparseIndex.build(DOCS)
    s.save(tmp_path / "sp")
    again = SparseIndex.load(tmp_path / "sp", len(DOCS))
    assert again is not None
    assert again.search(["Australia capital"], 3) == s.search(["Australia capital"], 3)
    assert SparseIndex.load(tmp_path / "sp", len(DOCS) + 1) is None  # other documents
    assert SparseIndex.load(tmp_path / "nothing", 4) is None
    assert TOKENIZER in (tmp_path / "sp" / "sparse.json").read_text()


def test_documents_without_words_give_no_hits():
    s = SparseIndex.build([{"title": "", "text": "the of a"}, {"text": ""}])
    assert s.search(["the"], 3) == [[]] and s.search(["anything"], 3) == [[]]


def test_rrf_fuses_fixed_rankings_by_weighted_reciprocal_rank():
    dense, sparse = [10, 20, 30], [30, 40]
    fused = rrf([dense, sparse], [1.0, 1.0], k=60)
    want = {10: 1 / 61, 20: 1 / 62, 30: 1 / 63 + 1 / 61, 40: 1 / 62}
    assert [i for i, _ in fused] == [30, 10, 20, 40]  # 20 and 40 tie: first seen first
    assert {i: pytest.approx(s) for i, s in fused} == want
    weighted = rrf([dense, sparse], [1.0, 0.5], k=1, top=2)
    assert weighted == [(10, pytest.approx(1 / 2)), (30, pytest.approx(1 / 4 + 0.5 / 2))]
    assert rrf([dense, sparse], [0.0, 1.0], k=60)[0][0] == 30
    with pytest.raises(ValueError, match="2 rankings but 1 weights"):
        rrf([dense, sparse], [1.0])


def _index(docs, kind="flat"):
    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(len(docs), 8)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    idx = VectorIndex.create(8, model="m", kind=kind)
    idx.add(vecs, docs)
    return idx, vecs


def test_save_writes_the_bm25_index_beside_the_vectors(tmp_path):
    idx, _ = _index([dict(d) for d in DOCS])
    idx.save(tmp_path / "ix")
    assert (tmp_path / "ix" / "sparse" / "sparse.json").is_file()
    opened = VectorIndex.open(tmp_path / "ix")
    assert [h["title"] for h in opened.search_text(["marsupial"], 3)[0]] == ["Kangaroo"]


def test_an_index_saved_without_it_builds_it_once_and_caches_it(tmp_path):
    import shutil

    idx, _ = _index([dict(d) for d in DOCS])
    idx.save(tmp_path / "ix")
    shutil.rmtree(tmp_path / "ix" / "sparse")  # as an index saved by an older tailrace
    hits = VectorIndex.open(tmp_path / "ix").search_text(["volcano"], 2)
    assert [h["title"] for h in hits[0]] == ["Volcano"] and hits[0][0]["score"] > 0
    assert (tmp_path / "ix" / "sparse" / "sparse.json").is_file()
    assert not [p for p in (tmp_path / "ix").iterdir() if p.name.startswith(".sparse")]


def test_hybrid_search_fuses_dense_and_sparse_rankings():
    idx, vecs = _index([dict(d) for d in DOCS])
    # the vector points at Volcano, the words at Kangaroo: each scores 1/61 from its own
    # ranking plus 1/(60 + rank) from the other (dense ranks all four documents)
    [dense] = idx.search_rows(vecs[3], 4)
    drank = {i: r for r, (i, _) in enumerate(dense, 1)}
    [hits] = idx.hybrid_search(vecs[3], ["marsupial"], 4)
    by_title = {h["title"]: h["score"] for h in hits}
    assert by_title["Kangaroo"] == pytest.approx(1 / 61 + 1 / (60 + drank[2]))
    assert by_title["Volcano"] == pytest.approx(1 / 61)
    assert by_title["Sydney"] == pytest.approx(1 / (60 + drank[1]))
    from tailrace.stores.vector_index import Fusion

    [hits] = idx.hybrid_search(vecs[3], ["marsupial"], 1, fusion=Fusion(dense=0.1))
    assert [h["title"] for h in hits] == ["Kangaroo"]


def test_a_chunks_heading_is_searched_with_its_text():
    chunks = [{"title": "Serving", "heading": "Prometheus metrics", "text": "GET the page."},
              {"title": "Serving", "heading": "Streaming", "text": "Tokens as produced."}]
    assert [i for i, _ in SparseIndex.build(chunks).search(["prometheus"], 2)[0]] == [0]
