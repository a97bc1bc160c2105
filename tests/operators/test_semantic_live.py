"""semantic_state with the real MiniLM embedder: documents appended to a followed JSONL file
while a query pipeline runs become retrievable within the stated bound (one feeder poll),
and a process killed without a goodbye loses no document on restart."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import tailrace as tr
from tailrace.operators.follow import feeder_for
from tailrace.stores.live_index import close_live_indexes, open_live_index
from tests.rag_fixtures import EMBEDDER

pytestmark = pytest.mark.engine
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (document text, a question only that document answers)
FACTS = [
    ("The city of Quorvath opened a floating library on its harbour on Monday.",
     "Where did Quorvath open a floating library?"),
    ("Engineers in Talmere finished a bridge made entirely of recycled glass.",
     "What is the new bridge in Talmere made of?"),
    ("A comet named Brisk-7 will pass close to Earth next spring.",
     "Which comet will pass close to Earth next spring?"),
    ("The Ostrava chess club elected a twelve-year-old as its president.",
     "Who became president of the Ostrava chess club?"),
]


@pytest.fixture(autouse=True)
def _close_indexes():
    yield
    close_live_indexes()


def append(path, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def start_feeder(index: str, path, poll_ms: float = 20):
    """A pipeline whose semantic_state stage follows ``path``; returns its feeder."""
    p = tr.Pipeline("feed", engines={"embedder": EMBEDDER})
    (p.source([{"ping": 1}])
     .apply("semantic_state", index=index, engine="embedder", follow=str(path),
            poll_ms=poll_ms)
     .sink(out := []))
    tr.run(p)
    assert out == [{"ping": 1}]  # records pass through once the feeder has caught up
    return feeder_for(open_live_index(index), str(path))


def test_appended_documents_are_retrievable_within_one_poll(tmp_path):
    news, index = tmp_path / "news.jsonl", str(tmp_path / "live")
    append(news, {"id": "old", "text": "An old story about the weather."})
    feeder = start_feeder(index, news)
    assert len(open_live_index(index)) == 1  # what the file held is in before any record
    lags_ms: list[float] = []

    async def questions():
        """Append one document, wait out the bound (two poll cycles begun after the
        append, so one complete poll), then ask about it."""
        for i, (text, question) in enumerate(FACTS):
            polls = feeder.polls
            t0 = time.perf_counter()
            append(news, {"id": f"n{i}", "title": f"story {i}", "text": text})
            while feeder.polls < polls + 2:
                await asyncio.sleep(0.002)
            lags_ms.append((time.perf_counter() - t0) * 1000)
            yield {"i": i, "question": question}

    p = tr.Pipeline("ask", engines={"embedder": EMBEDDER})
    (p.source(questions())
     .apply("embed", engine="embedder", input="question", output="qv")
     .apply("retrieve", index=f"live:{index}", query="qv", k=1).sink(out := []))
    result = tr.run(p)
    assert not result.errors
    assert [r["passages"][0]["id"] for r in out] == [f"n{r['i']}" for r in out]
    assert len(out) == len(FACTS)
    stats = feeder.statistics()
    assert stats.lines == 1 + len(FACTS) and stats.failure is None
    print(f"\nfreshness: append -> bound passed in {max(lags_ms):.1f} ms max "
          f"(poll 20 ms, slowest batch {stats.max_batch_ms:.1f} ms)")


def test_deletes_and_bad_lines_in_the_followed_file(tmp_path):
    news, index = tmp_path / "news.jsonl", str(tmp_path / "live")
    append(news, {"id": "a", "text": FACTS[0][0]})
    append(news, {"id": "b", "text": FACTS[1][0]})
    with open(news, "a") as f:
        f.write("this is not json\n")
    append(news, {"id": "a", "deleted": True})
    append(news, {"text": "a document without an id"})
    feeder = start_feeder(index, news)
    live = open_live_index(index)
    assert sorted(live._keys) == ["b"]
    stats = feeder.statistics()
    assert (stats.lines, stats.bad_lines, stats.errors) == (4, 1, 1)


KILLED = textwrap.dedent("""
    import json, os, signal, sys, time
    sys.path.insert(0, {root!r})
    import tailrace as tr
    from tailrace.stores.live_index import open_live_index
    from tests.operators.test_semantic_live import start_feeder
    start_feeder({index!r}, {news!r}, poll_ms=10)
    live = open_live_index({index!r})
    assert len(live) == 6, len(live)
    os.kill(os.getpid(), signal.SIGKILL)  # no snapshot, no atexit: only the log survives
""")


def test_a_killed_process_loses_no_document_and_resumes_the_file(tmp_path):
    news, index = tmp_path / "news.jsonl", str(tmp_path / "live")
    for i in range(6):
        append(news, {"id": f"d{i}", "text": f"document number {i} " + FACTS[i % 4][0]})
    proc = subprocess.run([sys.executable, "-c", KILLED.format(root=ROOT, index=index,
                                                               news=str(news))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (tmp_path / "live" / "snapshot").exists()
    for i in range(6, 9):  # written while nobody was following
        append(news, {"id": f"d{i}", "text": f"later document {i}"})
    live = open_live_index(index)
    assert sorted(live._keys) == [f"d{i}" for i in range(6)]  # restored from the log
    feeder = start_feeder(index, news)
    assert sorted(live._keys) == [f"d{i}" for i in range(9)]
    assert feeder.statistics().lines == 3  # resumed at the saved offset: nothing re-read
    close_live_indexes()  # a clean stop writes a snapshot
    again = open_live_index(index)
    assert len(again) == 9 and (tmp_path / "live" / "snapshot" / "meta.json").is_file()
