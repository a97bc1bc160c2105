"""The bundled corpus and evaluation data, and answer scoring."""

import pytest

from tailrace.errors import StoreError
from tailrace.stores.corpus import answer_correct, normalize_answer, read_fanoutqa, read_wiki


def test_wiki_corpus_has_10033_documents():
    docs = read_wiki()
    assert len(docs) == 10033
    assert set(docs[0]) == {"id", "title", "text"}
    assert docs == sorted(docs, key=lambda d: d["title"])


def test_558_fanoutqa_questions_have_evidence_in_the_corpus():
    titles = {d["title"] for d in read_wiki()}
    qs = read_fanoutqa(titles)
    assert len(qs) == 558
    assert all(q.evidence in titles and q.answers for q in qs)


def test_jsonl_corpus_and_errors(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"title": "B", "text": " two  words "}\n{"title": "A", "text": "x"}\n')
    assert read_wiki(f) == [{"id": "B", "title": "B", "text": "two words"},
                            {"id": "A", "title": "A", "text": "x"}]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(StoreError, match=r"bad\.json: cannot read corpus"):
        read_wiki(bad)


@pytest.mark.parametrize("generated,gold,ok", [
    ("The answer is Stanley Kubrick.", ("Stanley Kubrick",), True),
    ("stanley kubrick", ("Stanley Kubrick",), True),
    ("Kubrick", ("Stanley Kubrick",), False),
    ("Left-handed, the Left", ("Left",), True),
    ("Paris and Rome", ("Paris", "Rome"), True),
    ("Paris", ("Paris", "Rome"), False),
    ("", ("x",), False),
])
def test_answer_correct(generated, gold, ok):
    assert answer_correct(generated, gold) is ok


def test_normalize_answer():
    assert normalize_answer("The  Beatles!") == "beatles"
