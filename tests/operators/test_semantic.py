"""semantic_state: documents in, a live index out that retrieve stages of other pipelines
read by name; deletes, bad documents, compile-time refusals, the JSONL tail."""

from __future__ import annotations

import json
import threading

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler import compile_pipeline
from tailrace.errors import PlanError

np = pytest.importorskip("numpy")
pytest.importorskip("faiss")

from tailrace.operators.follow import JsonlTail, follow_jsonl  # noqa: E402
from tailrace.stores.live_index import close_live_indexes, open_live_index  # noqa: E402


@pytest.fixture(autouse=True)
def _close_indexes():
    yield
    close_live_indexes()


@pytest.fixture(params=[True, False], ids=["local-fused", "local-unfused"])
def run(request):
    """Local executors only: a live index is shared within one process; on Ray the stage's
    index would live in a host actor's process."""
    return lambda p, **kw: tr.run(p, runtime="local", fuse=request.param, **kw)


def unit(i: int):
    v = np.random.default_rng(i).standard_normal(8).astype(np.float32)
    return (v / np.linalg.norm(v)).tolist()


def ingest(run, index: str, docs: list, **kw):
    p = tr.Pipeline("ingest")
    (p.source(docs).apply("semantic_state", id="state", index=index, vector="v", **kw)
     .sink(out := []))
    return out, run(p)


def query(run, index: str, vecs: list, k: int = 3) -> list:
    p = tr.Pipeline("ask")
    (p.source([{"q": np.asarray(v, np.float32)} for v in vecs])
     .apply("retrieve", index=f"live:{index}", query="q", k=k).sink(out := []))
    run(p)
    return [[h["id"] for h in r["passages"]] for r in out]


def test_documents_become_retrievable_by_another_pipeline(run, tmp_path):
    index = str(tmp_path / "news")
    docs = [{"id": f"n{i}", "title": f"t{i}", "text": f"story {i}", "v": unit(i)}
            for i in range(5)]
    out, result = ingest(run, index, docs, output="ack")
    assert not result.errors and len(out) == 5
    assert out[-1]["ack"] == {"index": index, "action": "upsert", "docs": 5}
    assert [ids[0] for ids in query(run, index, [unit(i) for i in range(5)])] == \
        [f"n{i}" for i in range(5)]
    hit = open_live_index(index).search(np.asarray(unit(2), np.float32), 1)[0][0]
    assert set(hit) == {"id", "title", "text", "score"}  # the vector is not stored twice


def test_upsert_replaces_and_deleted_true_deletes(run, tmp_path):
    index = str(tmp_path / "news")
    ingest(run, index, [{"id": "a", "text": "old", "v": unit(1)},
                        {"id": "b", "text": "b", "v": unit(2)}])
    ingest(run, index, [{"id": "a", "text": "new", "v": unit(3)},
                        {"id": "b", "deleted": True}])
    live = open_live_index(index)
    assert len(live) == 1 and live.get("a")["text"] == "new"
    assert query(run, index, [unit(3)]) == [["a"]]


def test_bad_documents_become_error_records_and_the_rest_go_on(run, tmp_path):
    docs = [{"text": "no id", "v": unit(1)},
            {"id": 1.5, "v": unit(2)},
            {"id": "t", "when": "yesterday", "v": unit(3)},
            {"id": "ok", "when": "2025-01-31T12:00:00Z", "v": unit(4)}]
    out, result = ingest(run, str(tmp_path / "x"), docs, time="when")
    assert [r["id"] for r in out] == ["ok"]
    msgs = sorted(e.message for e in result.errors)
    assert len(msgs) == 3 and all(e.stage == "state" for e in result.errors)
    assert "field 'id' (the document id) must be a string or an integer, got float" in msgs[0]
    assert "record has no field 'id'" in msgs[1]
    assert "time must be seconds since the epoch or an ISO 8601 text" in msgs[2]


def test_vectors_the_index_refuses_fail_their_records_only(run, tmp_path):
    index = str(tmp_path / "x")
    ingest(run, index, [{"id": "a", "v": unit(1)}])
    out, result = ingest(run, index, [{"id": "b", "v": [1.0, 0.0]}])  # dim 2, index dim 8
    assert out == [] and len(result.errors) == 1
    assert "vectors must have shape (n, 8), got (1, 2)" in result.errors[0].message
    assert len(open_live_index(index)) == 1


def test_compile_time_refusals():
    def plan(stage: str) -> None:
        compile_pipeline(loads_pipeline(
            "version: 1\npipeline: p\nengines: {e: {backend: onnx, model: minilm-l6-int8}}\n"
            f"stages:\n  - {stage}\n", "p.yaml"))

    with pytest.raises(PlanError, match="p.yaml:5: stage 's': semantic_state needs exactly "
                                        "one of 'engine'"):
        plan("{id: s, op: semantic_state, index: n}")
    with pytest.raises(PlanError, match="'follow' reads raw lines, so it needs 'engine'"):
        plan("{id: s, op: semantic_state, index: n, vector: v, follow: f.jsonl}")
    with pytest.raises(PlanError, match="ttl_s"):
        plan("{id: s, op: semantic_state, index: n, vector: v, ttl_s: -1}")
    with pytest.raises(PlanError, match="cannot have replicas"):
        plan("{id: s, op: semantic_state, index: n, vector: v, replicas: 2}")


def test_the_tail_reads_whole_lines_only_and_survives_bad_and_replaced_files(tmp_path):
    path = tmp_path / "f.jsonl"
    tail = JsonlTail(str(path))
    assert tail.read(10) == []  # not there yet
    path.write_text('{"a": 1}\n[1, 2]\nnot json\n{"b": 2')  # the last line is half-written
    got = tail.read(10)
    assert [r for r, _ in got] == [{"a": 1}] and tail.bad_lines == 2
    assert "is not a JSON object" in tail.last_problem
    with open(path, "a") as f:
        f.write("}\n")
    assert [r for r, _ in tail.read(10)] == [{"b": 2}]
    assert tail.offset == path.stat().st_size
    path.write_text('{"c": 3}\n')  # replaced by a shorter file: read again from the start
    assert [r for r, _ in tail.read(10)] == [{"c": 3}]


def test_follow_jsonl_is_an_async_source_that_stops_on_its_event(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(3)))
    stop = threading.Event()
    seen: list = []

    def sink(rec: dict) -> None:
        seen.append(rec["i"])
        if rec["i"] == 2:
            with open(path, "a") as f:
                f.write(json.dumps({"i": 3}) + "\n")
        if rec["i"] == 3:
            stop.set()

    p = tr.Pipeline("follow")
    p.source(follow_jsonl(str(path), poll_s=0.005, stop=stop)).sink(sink)
    tr.run(p)
    assert seen == [0, 1, 2, 3]
