"""The live vector index: upsert/delete by id, TTL, snapshot + log restore, refusals."""

from __future__ import annotations

import threading

import pytest

from tailrace.errors import StoreError

np = pytest.importorskip("numpy")
pytest.importorskip("faiss")

from tailrace.stores.live_index import (  # noqa: E402
    LiveIndex,
    close_live_indexes,
    live_dir,
    open_live_index,
)

DIM = 8


class Clock:
    """A virtual clock: tests move time by hand."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def vec(i: int):
    v = np.random.default_rng(i).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def vecs(ids):
    return np.stack([vec(i) for i in ids])


def put(ix: LiveIndex, ids, **kw) -> int:
    return ix.upsert([f"d{i}" for i in ids], vecs(ids), [{"id": f"d{i}", "n": i} for i in ids],
                     **kw)


def top(ix: LiveIndex, i: int) -> str | None:
    hits = ix.search(vec(i), 1)[0]
    return hits[0]["id"] if hits else None


def test_upsert_search_replace_delete(tmp_path):
    ix = LiveIndex(tmp_path)
    assert ix.search(vec(0), 3) == [[]]  # empty: no hits, no error
    assert put(ix, range(5)) == 5
    assert len(ix) == 5 and "d3" in ix and top(ix, 3) == "d3"
    hit = ix.search(vec(3), 1)[0][0]
    assert hit["n"] == 3 and hit["score"] == pytest.approx(1.0, abs=1e-5)
    # replace d3's vector and document: old vector gone, new one found
    ix.upsert(["d3"], vecs([42]), [{"id": "d3", "n": 99}])
    assert len(ix) == 5 and ix.get("d3") == {"id": "d3", "n": 99}
    assert top(ix, 42) == "d3"
    assert ix.search(vec(3), 1)[0][0]["score"] < 0.99  # the old vector is gone
    assert ix.delete(["d3", "nope"]) == 1
    assert len(ix) == 4 and "d3" not in ix and ix.search(vec(42), 1)[0][0]["score"] < 0.99
    s = ix.statistics()
    assert (s.docs, s.upserts, s.deletes, s.version) == (4, 6, 1, 7)
    ix.close()


def test_a_later_duplicate_in_one_batch_wins(tmp_path):
    ix = LiveIndex(tmp_path)
    ix.upsert(["a", "a"], vecs([1, 2]), [{"id": "a", "v": 1}, {"id": "a", "v": 2}])
    assert len(ix) == 1 and ix.get("a")["v"] == 2 and top(ix, 2) == "a"
    ix.close()


def test_ttl_counts_from_the_documents_time_or_now(tmp_path):
    clock = Clock(1000.0)
    ix = LiveIndex(tmp_path, clock=clock)
    ix.ttl_s = 60
    put(ix, [1])                                   # expires at 1060
    put(ix, [2], times=[1030.0])                   # expires at 1090
    put(ix, [3], times=[900.0])                    # already past: never searchable
    assert sorted(d["id"] for d in ix.search(vec(1), 5)[0]) == ["d1", "d2"]
    clock.t = 1061
    assert [d["id"] for d in ix.search(vec(1), 5)[0]] == ["d2"]
    clock.t = 1091
    assert ix.search(vec(2), 5) == [[]]
    assert ix.statistics().expired == 3
    ix.close()


def test_reupsert_renews_the_ttl(tmp_path):
    clock = Clock(0.0)
    ix = LiveIndex(tmp_path, clock=clock)
    ix.ttl_s = 10
    put(ix, [1])
    clock.t = 8
    put(ix, [1])                                   # now expires at 18, not 10
    clock.t = 12
    assert top(ix, 1) == "d1"
    clock.t = 19
    assert top(ix, 1) is None
    ix.close()


def test_restart_after_a_crash_restores_snapshot_plus_log(tmp_path):
    ix = LiveIndex(tmp_path)
    put(ix, range(10))
    ix.snapshot()
    put(ix, range(10, 15))                         # only in the log
    ix.delete(["d0", "d11"])
    ix.upsert(["d5"], vecs([77]), [{"id": "d5", "n": 77}], cursor={"offset": 123})
    # no close(): the process "dies" here; a new one opens the same directory
    again = LiveIndex(tmp_path)
    assert len(again) == 13
    assert "d0" not in again and "d11" not in again
    assert again.get("d5") == {"id": "d5", "n": 77} and top(again, 77) == "d5"
    assert all(top(again, i) == f"d{i}" for i in range(1, 15) if i not in (5, 11))
    assert again.cursor == {"offset": 123}
    again.close()
    ix._closed = True  # the "dead" process's handle


def test_close_snapshots_and_a_reopen_needs_no_log(tmp_path):
    ix = LiveIndex(tmp_path)
    put(ix, range(6))
    ix.close()
    assert (tmp_path / "snapshot" / "meta.json").is_file()
    assert (tmp_path / "wal.jsonl").read_text() == ""
    assert not list(tmp_path.glob("wal-*.jsonl"))
    again = LiveIndex(tmp_path)
    assert len(again) == 6 and top(again, 4) == "d4"
    again.close()


def test_snapshots_are_periodic_on_the_injected_clock(tmp_path):
    clock = Clock(0.0)
    ix = LiveIndex(tmp_path, clock=clock)
    ix.snapshot_every_s = 30
    put(ix, [1])
    assert ix.statistics().snapshots == 0 and ix.statistics().wal_records == 1
    clock.t = 31
    put(ix, [2])
    assert ix.statistics().snapshots == 1 and ix.statistics().wal_records == 0
    ix.close()


def test_a_torn_last_log_line_is_ignored_and_a_corrupt_one_is_refused(tmp_path):
    ix = LiveIndex(tmp_path)
    put(ix, [1, 2])
    ix._wal.write('{"seq": 3, "op": "upsert", "id": "d3"')  # killed mid-write
    ix._wal.flush()
    again = LiveIndex(tmp_path)
    assert sorted(again._keys) == ["d1", "d2"]
    put(again, [4])  # the torn bytes were cut off: this change starts a line of its own
    third = LiveIndex(tmp_path)
    assert sorted(third._keys) == ["d1", "d2", "d4"]
    ix._closed = again._closed = third._closed = True
    (tmp_path / "wal.jsonl").write_text('garbage\n{"seq": 9, "op": "delete", "ids": []}\n')
    with pytest.raises(StoreError, match=r"wal\.jsonl:1 is not a JSON log line"):
        LiveIndex(tmp_path)


def test_bad_input_is_refused_with_the_reason(tmp_path):
    ix = LiveIndex(tmp_path)
    with pytest.raises(StoreError, match="document 0: id must be a string or an integer"):
        ix.upsert([1.5], vecs([1]), [{}])
    with pytest.raises(StoreError, match="upsert got 2 ids, 1 docs"):
        ix.upsert(["a", "b"], vecs([1, 2]), [{}])
    with pytest.raises(StoreError, match="document 0 must be a dict, got str"):
        ix.upsert(["a"], vecs([1]), ["text"])
    with pytest.raises(StoreError, match="not JSON-serialisable"):
        ix.upsert(["a"], vecs([1]), [{"x": object()}])
    put(ix, [1])
    with pytest.raises(StoreError, match=r"vectors must have shape \(n, 8\), got \(1, 4\)"):
        ix.upsert(["b"], np.ones((1, 4), np.float32), [{}])
    with pytest.raises(StoreError, match="NaN or infinite"):
        ix.upsert(["b"], np.full((1, DIM), np.nan, np.float32), [{}])
    assert len(ix) == 1  # nothing of the refused calls was applied ...
    ix.close()
    assert len(LiveIndex(tmp_path)) == 1  # ... or logged


def test_embedding_models_must_match_between_writer_and_readers(tmp_path):
    ix = LiveIndex(tmp_path)
    ix.expect_model("minilm-l6-int8")  # a retrieve stage reads with this embedder
    with pytest.raises(StoreError, match="queried with embedding model 'minilm-l6-int8'; "
                                         "refusing vectors of 'minilm-l3'"):
        put(ix, [1], model="minilm-l3")
    put(ix, [1], model="minilm-l6-int8")
    with pytest.raises(StoreError, match="holds vectors of embedding model 'minilm-l6-int8' "
                                         "but this pipeline embeds queries with 'minilm-l3'"):
        ix.expect_model("minilm-l3")
    ix.close()


def test_the_registry_shares_one_index_per_name(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILRACE_HOME", str(tmp_path))
    a = open_live_index("news")
    assert open_live_index("news") is a
    assert live_dir("news") == tmp_path / "live" / "news"
    assert live_dir(str(tmp_path / "x")) == tmp_path / "x"
    put(a, [1])
    close_live_indexes()
    b = open_live_index("news")
    assert b is not a and len(b) == 1
    b.close()
    with pytest.raises(StoreError, match="needs a name"):
        live_dir("")


def test_searches_during_upserts_always_see_whole_documents(tmp_path):
    ix = LiveIndex(tmp_path)
    ix.snapshot_every_s = None
    stop = threading.Event()
    bad: list = []

    def reader() -> None:
        while not stop.is_set():
            for hit in ix.search(vec(0), 5)[0]:
                if hit != {**ix_docs[hit["id"]], "score": hit["score"]}:
                    bad.append(hit)

    ix_docs = {f"d{i}": {"id": f"d{i}", "n": i} for i in range(200)}
    t = threading.Thread(target=reader)
    t.start()
    for start in range(0, 200, 20):
        put(ix, range(start, start + 20))
        ix.delete([f"d{start}"])
    stop.set()
    t.join()
    assert not bad and len(ix) == 190
    ix.close()
