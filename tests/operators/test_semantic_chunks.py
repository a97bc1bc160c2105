"""semantic_state with ``chunk_tokens``: a long document is stored as its chunks (the
same chunker as ``tailrace ingest``), a passage deep inside it is retrievable, a shorter
new version drops the old extra chunks and a delete removes them all — also from a
followed feed."""

import json

import pytest

import tailrace as tr
from tailrace.stores.live_index import close_live_indexes, open_live_index
from tests.rag_fixtures import EMBEDDER

pytestmark = pytest.mark.engine

FILLER = " ".join(f"Filler sentence {i} says nothing in particular." for i in range(80))
LONG = FILLER + " The hidden fact: Quorvath harbour has a floating library."


@pytest.fixture(autouse=True)
def _close_indexes():
    yield
    close_live_indexes()


def upsert(index, docs, **kw):
    p = tr.Pipeline("feed", engines={"embedder": EMBEDDER})
    p.source(docs).apply("semantic_state", index=index, engine="embedder", **kw).sink(out := [])
    tr.run(p)
    return out


def ask(index, question, k=1):
    p = tr.Pipeline("ask", engines={"embedder": EMBEDDER})
    (p.source([{"q": question}]).apply("embed", engine="embedder", input="q", output="v")
     .apply("retrieve", index=f"live:{index}", query="v", k=k).sink(out := []))
    tr.run(p)
    return out[0]["passages"]


def test_a_long_document_is_chunked_and_its_deep_passage_found(tmp_path):
    index = str(tmp_path / "live")
    upsert(index, [{"id": "doc", "title": "Notes", "text": LONG}], chunk_tokens=64,
           chunk_overlap=8)
    live = open_live_index(index)
    n = len(live)
    assert n > 5 and "doc" not in live and "doc#0" in live
    [hit] = ask(index, "Where is the floating library?")
    assert hit["doc_id"] == "doc" and "floating library" in hit["text"]
    assert LONG[hit["start"]:hit["end"]] == hit["text"] and hit["title"] == "Notes"
    # a shorter version replaces it: no stale chunks are left
    upsert(index, [{"id": "doc", "text": "Short now."}], chunk_tokens=64, chunk_overlap=8)
    assert len(live) == 1 and live.get("doc#0")["text"] == "Short now."
    upsert(index, [{"id": "doc", "deleted": True}], chunk_tokens=64, chunk_overlap=8)
    assert len(live) == 0


def test_without_chunk_tokens_the_document_is_one_entry_cut_by_the_embedder(tmp_path):
    index = str(tmp_path / "live")
    upsert(index, [{"id": "doc", "text": LONG}])
    assert len(open_live_index(index)) == 1
    [hit] = ask(index, "Where is the floating library?")
    assert hit["id"] == "doc"


def test_a_followed_feed_of_long_documents_is_chunked(tmp_path):
    feed, index = tmp_path / "feed.jsonl", str(tmp_path / "live")
    feed.write_text(json.dumps({"id": "a", "text": LONG}) + "\n")
    p = tr.Pipeline("feed", engines={"embedder": EMBEDDER})
    (p.source([{"ping": 1}]).apply("semantic_state", index=index, engine="embedder",
                                   follow=str(feed), chunk_tokens=64, chunk_overlap=8)
     .sink(out := []))
    tr.run(p)
    assert out == [{"ping": 1}]
    assert len(open_live_index(index)) > 5
    [hit] = ask(index, "Where is the floating library?")
    assert hit["doc_id"] == "a"


@pytest.mark.parametrize("kw, match", [
    ({"vector": "v", "chunk_tokens": 64}, "'chunk_tokens' chunks the text field"),
    ({"engine": "embedder", "chunk_tokens": 64}, r"'chunk_overlap' \(32\) must be below half"),
])
def test_chunk_settings_are_checked_at_compile_time(kw, match):
    p = tr.Pipeline("bad", engines={"embedder": EMBEDDER})
    p.source([]).apply("semantic_state", index="x", **kw).sink()
    with pytest.raises(tr.PlanError, match=match):
        tr.compile_pipeline(p)
