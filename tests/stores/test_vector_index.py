"""The faiss vector index: search, persistence, refusal of bad or foreign indexes."""

from __future__ import annotations

import json
import os
import re

import pytest

from tailrace.errors import StoreError

np = pytest.importorskip("numpy")
pytest.importorskip("faiss")

from tailrace.stores.vector_index import VectorIndex  # noqa: E402

pytestmark = pytest.mark.engine
DIM = 16


def unit(n: int, seed: int = 0):
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def docs(n: int, start: int = 0) -> list[dict]:
    return [{"id": i, "title": f"t{i}", "text": f"text {i}"} for i in range(start, start + n)]


def built(kind: str = "flat", n: int = 200, model: str = "minilm-l3") -> VectorIndex:
    index = VectorIndex.create(DIM, model=model, kind=kind)
    index.add(unit(n), docs(n))
    return index


def leftovers(parent) -> list[str]:
    return sorted(p for p in os.listdir(parent) if p.startswith("."))


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_round_trip_gives_identical_results(tmp_path, kind):
    index = built(kind)
    queries = unit(20, seed=1)
    before = index.search(queries, 5)
    index.save(tmp_path / "idx", fingerprint="sha256:abc")
    again = VectorIndex.open(tmp_path / "idx", expect_model="minilm-l3")
    assert again.search(queries, 5) == before
    assert (len(again), again.dim, again.kind, again.model, again.fingerprint) == (
        200, DIM, kind, "minilm-l3", "sha256:abc")
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())
    assert meta["count"] == 200 and meta["ef_search"] == 64 and meta["format"] == 1
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_a_stored_vector_finds_itself_first(kind):
    index = built(kind)
    vectors = unit(200)
    hits = index.search(vectors[[3, 77, 150]], 3)
    assert [h[0]["id"] for h in hits] == [3, 77, 150]
    assert hits[0][0] == {"score": pytest.approx(1.0, abs=1e-5), "id": 3, "title": "t3",
                          "text": "text 3"}
    for row in hits:
        scores = [h["score"] for h in row]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_k_larger_than_count(kind):
    index = built(kind, n=3)
    (hits,) = index.search(unit(1, seed=5), 10)
    assert sorted(h["id"] for h in hits) == [0, 1, 2]
    assert VectorIndex.create(DIM, model="m", kind=kind).search(unit(2), 4) == [[], []]


def test_a_one_dimensional_query_is_one_query():
    index = built()
    assert index.search(unit(1)[0], 2) == index.search(unit(1), 2)


def test_wrong_dim_dtype_and_count_are_refused():
    index = built(n=5)
    with pytest.raises(StoreError, match=r"vectors have dim 8 but the index has dim 16"):
        index.add(unit(2)[:, :8], docs(2))
    with pytest.raises(StoreError, match=r"queries have dim 8 but the index has dim 16"):
        index.search(unit(1)[:, :8], 1)
    with pytest.raises(StoreError, match=r"must be floating point \(float32\), got int64"):
        index.add(np.ones((2, DIM), dtype=np.int64), docs(2))
    with pytest.raises(StoreError, match=r"add\(\) got 2 vectors but 3 docs"):
        index.add(unit(2), docs(3))
    with pytest.raises(StoreError, match=r"doc 1 has a 'score' field"):
        index.add(unit(2), [{"id": 1}, {"score": 3}])
    with pytest.raises(StoreError, match=r"doc 0 is not JSON-serialisable"):
        index.add(unit(1), [{"x": object()}])
    with pytest.raises(StoreError, match=r"must have shape \(n, 16\), got \(1, 2, 16\)"):
        index.search(unit(2).reshape(1, 2, DIM), 1)
    with pytest.raises(StoreError, match="unknown index kind 'ivf'; known: flat, hnsw"):
        VectorIndex.create(DIM, model="m", kind="ivf")
    assert len(index) == 5  # nothing half-added


def test_an_index_from_another_embedder_is_refused(tmp_path):
    built(model="minilm-l3").save(tmp_path / "idx")
    where = tmp_path / "idx"
    msg = (f"index at {where} was built with embedding model 'minilm-l3' but this pipeline "
           "embeds queries with 'minilm-l6-int8'; rebuild it with `tailrace ingest --embedder "
           "minilm-l6-int8` or use the same embedder")
    with pytest.raises(StoreError, match=re.escape(msg)):
        VectorIndex.open(where, expect_model="minilm-l6-int8")
    assert len(VectorIndex.open(where)) == 200  # no expectation: opens


def test_missing_index(tmp_path):
    with pytest.raises(StoreError, match=re.escape(
            f"no index at {tmp_path / 'nope'}; build it with `tailrace ingest`")):
        VectorIndex.open(tmp_path / "nope")


def test_corrupt_docs_are_refused(tmp_path):
    where = tmp_path / "idx"
    built(n=4).save(where)
    lines = (where / "docs.jsonl").read_text().splitlines()
    (where / "docs.jsonl").write_text("\n".join([lines[0], "{not json", *lines[2:]]) + "\n")
    with pytest.raises(StoreError, match=r"corrupt: docs.jsonl line 2 is not a JSON object"):
        VectorIndex.open(where)
    (where / "docs.jsonl").write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(StoreError, match=r"inconsistent: meta.json says 4 x 16, index.faiss "
                                         r"holds 4 x 16, docs.jsonl holds 3 docs"):
        VectorIndex.open(where)


def test_corrupt_meta_and_faiss_files_are_refused(tmp_path):
    where = tmp_path / "idx"
    built(n=4).save(where)
    (where / "index.faiss").write_bytes(b"garbage")
    with pytest.raises(StoreError, match="corrupt: cannot read index.faiss"):
        VectorIndex.open(where)
    (where / "meta.json").write_text("{")
    with pytest.raises(StoreError, match="corrupt: bad meta.json"):
        VectorIndex.open(where)


def test_save_replaces_an_existing_index(tmp_path):
    where = tmp_path / "idx"
    built(n=4).save(where)
    bigger = built(n=4)
    bigger.add(unit(3, seed=9), docs(3, start=4))
    bigger.save(where, fingerprint="v2")
    again = VectorIndex.open(where)
    assert (len(again), again.fingerprint) == (7, "v2")
    assert leftovers(tmp_path) == []


def test_a_failed_write_leaves_the_old_index_intact(tmp_path, monkeypatch):
    import faiss

    where = tmp_path / "idx"
    built(n=4).save(where)
    new = built(n=9)

    def half_write(index, path):  # writes part of the file, then "crashes"
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(faiss, "write_index", half_write)
    with pytest.raises(OSError, match="disk full"):
        new.save(where)
    monkeypatch.undo()
    assert len(VectorIndex.open(where)) == 4
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("step", ["rename", "replace"])
def test_a_failed_commit_or_switch_keeps_the_old_index(tmp_path, monkeypatch, step):
    where = tmp_path / "idx"
    built(n=4).save(where)
    real = getattr(os, step)

    def failing(src, dst):  # renaming the written folder / switching the link fails
        if ".tmp-" in str(src) or ".link-" in str(src):
            raise OSError(f"{step} failed")
        real(src, dst)

    monkeypatch.setattr(os, step, failing)
    with pytest.raises(OSError, match=f"{step} failed"):
        built(n=9).save(where)
    monkeypatch.undo()
    assert len(VectorIndex.open(where)) == 4
    assert leftovers(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == ["idx", "idx.v000001"]


def test_an_index_of_the_old_layout_keeps_working(tmp_path):
    where = tmp_path / "idx"
    built(n=4).save(where, fingerprint="old")
    version = os.readlink(where)  # make it the plain folder older tailraces wrote
    where.unlink()
    os.rename(tmp_path / version, where)
    assert VectorIndex.open(where).fingerprint == "old"
    built(n=9).save(where, fingerprint="new")
    assert (len(VectorIndex.open(where)), VectorIndex.open(where).fingerprint) == (9, "new")
    assert leftovers(tmp_path) == [] and len(os.listdir(tmp_path)) == 2


def test_a_link_to_a_missing_index_version_is_an_error_naming_it(tmp_path):
    where = tmp_path / "idx"
    built(n=4).save(where)
    version = tmp_path / os.readlink(where)
    os.rename(version, tmp_path / "moved")
    with pytest.raises(StoreError, match=rf"^{where} points to {version}, which is missing"):
        VectorIndex.open(where)
    built(n=3).save(where)  # saving a new index repairs it
    assert len(VectorIndex.open(where)) == 3


def test_a_failed_add_changes_nothing_on_disk(tmp_path):
    where = tmp_path / "idx"
    index = built(n=4)
    index.save(where)
    with pytest.raises(StoreError):
        index.add(unit(2), docs(1))
    assert len(index) == 4
    assert len(VectorIndex.open(where)) == 4
