"""memory_read and memory_write in pipelines, each test on SQLite and on PostgreSQL."""

from __future__ import annotations

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.engines.tokens import approx_tokens
from tailrace.errors import PlanError
from tailrace.operators.memory import pack_memory
from tailrace.stores.memory import FactHit, check_store_spec, open_store
from tests import pg_fixture
from tests.rag_fixtures import EMBEDDER

memory_spec = pg_fixture.memory_spec  # fixtures: SQLite and PostgreSQL
pg_server = pg_fixture.pg_server

T0 = 1_700_000_000.0


def echo(r):
    return {**r, "answer": "A:" + r["question"]}


def chat(spec, *, clock=None, read=None, write=None, engines=None):
    """memory_read -> answer (echo) -> memory_write, records keyed by uid/sid."""
    p = tr.Pipeline("chat", engines=engines or {})
    s = p.source(fields=["uid", "sid", "question"])
    s = s.apply("memory_read", id="recall", store=spec, user="uid", session="sid",
                clock=clock, **(read or {}))
    s = s.map(echo, id="answer")
    s.apply("memory_write", id="remember", store=spec, user="uid", session="sid", clock=clock,
            **(write or {})).sink()
    return p


def turn(uid, sid, q, **kw):
    return {"uid": uid, "sid": sid, "question": q, **kw}


def test_a_later_run_reads_the_earlier_turns(memory_spec):
    p = chat(memory_spec, read={"detail": "seen"})
    tr.run(p, input=[turn("ada", "s1", "hello"), turn("bob", "s1", "bob here")])
    [rec] = tr.run(p, input=[turn("ada", "s1", "again")]).outputs
    assert rec["memory"] == "Conversation so far:\nuser: hello\nassistant: A:hello"
    assert rec["seen"] == {"turns": [{"role": "user", "text": "hello"},
                                     {"role": "assistant", "text": "A:hello"}], "facts": []}


def test_ordered_reads_see_earlier_turns_of_the_same_run(memory_spec, run):
    # a long wait_ms: a slow Ray actor start only delays the run, never fails it
    p = chat(memory_spec, read={"ordered": True, "turns": 10, "wait_ms": 120_000})
    inp = [turn("ada", "s1", "q1"), turn("bob", "s1", "b1"), turn("ada", "s1", "q2"),
           turn("bob", "s1", "b2"), turn("ada", "s1", "q3")]
    result = run(p, input=inp)
    assert not result.errors
    mem = {r["question"]: r["memory"] for r in result.outputs}
    assert mem["q1"] == mem["b1"] == ""
    assert mem["q3"] == ("Conversation so far:\nuser: q1\nassistant: A:q1\n"
                         "user: q2\nassistant: A:q2")
    assert mem["b2"] == "Conversation so far:\nuser: b1\nassistant: A:b1"


def test_another_user_with_the_same_session_id_sees_nothing(memory_spec):
    p = chat(memory_spec)
    tr.run(p, input=[turn("ada", "s1", "my pin is 1234")])
    [rec] = tr.run(p, input=[turn("eve", "s1", "what was the pin?")]).outputs
    assert rec["memory"] == ""


def test_turn_ttl_with_an_injected_clock(memory_spec):
    now = [T0]
    p = chat(memory_spec, clock=lambda: now[0], write={"turn_ttl_s": 60})
    tr.run(p, input=[turn("ada", "s1", "short-lived")])
    now[0] = T0 + 59
    assert tr.run(p, input=[turn("ada", "s2", "x")]).outputs[0]["memory"] == ""
    assert "short-lived" in tr.run(p, input=[turn("ada", "s1", "y")]).outputs[0]["memory"]
    now[0] = T0 + 61  # the first turn expired; the turns written at T0 + 59 have not
    mem = tr.run(p, input=[turn("ada", "s1", "z")]).outputs[0]["memory"]
    assert "short-lived" not in mem and "user: y" in mem


def test_the_memory_fits_the_token_budget_newest_turns_first(memory_spec):
    p = chat(memory_spec, read={"turns": 50, "max_tokens": 40})
    tr.run(p, input=[turn("ada", "s1", f"question number {i} " + "word " * 5)
                     for i in range(10)])
    mem = tr.run(p, input=[turn("ada", "s1", "last")]).outputs[0]["memory"]
    assert approx_tokens(mem) <= 40
    lines = mem.splitlines()
    assert lines[0] == "Conversation so far:" and len(lines) > 2
    assert lines[-1].startswith("assistant: A:question number 9")


def test_bad_record_fields_become_error_records(memory_spec):
    p = chat(memory_spec)
    result = tr.run(p, input=[turn("ada", "", "empty session"), turn(None, "s1", "no user"),
                              turn(7, 8, "integer ids are fine"), {"uid": "ada", "sid": "s"}])
    assert [r["question"] for r in result.outputs] == ["integer ids are fine"]
    errs = sorted((e.stage, e.message) for e in result.errors)
    assert errs == [("answer", "'question'"),  # memory_read passed it on, echo failed
                    ("recall", "field 'sid' must be a non-empty id (text or integer), got ''"),
                    ("recall", "field 'uid' must be a non-empty id (text or integer), got None")]
    [rec] = tr.run(p, input=[turn(7, 8, "again")]).outputs
    assert "integer ids are fine" in rec["memory"]


def test_memory_write_refuses_non_text_turns(memory_spec):
    p = tr.Pipeline("w")
    (p.source().apply("memory_write", id="w", store=memory_spec, user="u", session="s",
                      turns={"user": "q"}).sink())
    result = tr.run(p, input=[{"u": "a", "s": "b", "q": ["not", "text"]}])
    [err] = result.errors
    assert (err.stage, err.message) == ("w", "field 'q' (user turn) must be text, got list")


@pytest.mark.engine
def test_facts_are_ranked_by_relevance_and_scoped_to_their_user(memory_spec):
    engines = {"embedder": EMBEDDER}
    p = chat(memory_spec, engines=engines,
             read={"query": "question", "embedder": "embedder", "k": 1, "turns": 0,
                   "detail": "seen"},
             write={"facts": "remember", "metadata": "meta", "embedder": "embedder",
                    "ttl_s": 3600})
    tr.run(p, input=[
        turn("ada", "s1", "hi", remember=["Ada is allergic to peanuts.",
                                          "Ada plays the cello in an orchestra."],
             meta={"source": "intro"}),
        turn("bob", "s9", "hi", remember="Bob is allergic to cats.")])
    [rec] = tr.run(p, input=[turn("ada", "s2", "Which musical instrument do I play?")]).outputs
    assert rec["memory"] == "Known facts about the user:\n- Ada plays the cello in an orchestra."
    [fact] = rec["seen"]["facts"]
    assert fact["metadata"] == {"source": "intro"} and 0.2 < fact["score"] <= 1.0
    [rec] = tr.run(p, input=[turn("eve", "s1", "What am I allergic to?")]).outputs
    assert rec["memory"] == ""


@pytest.mark.engine
def test_min_score_drops_unrelated_facts(memory_spec):
    engines = {"embedder": EMBEDDER}
    p = chat(memory_spec, engines=engines,
             read={"query": "question", "embedder": "embedder", "min_score": 0.5},
             write={"facts": "remember", "embedder": "embedder"})
    tr.run(p, input=[turn("ada", "s1", "hi", remember="Ada's favourite colour is green.")])
    out = tr.run(p, input=[turn("ada", "s2", "What is my favourite colour?"),
                           turn("ada", "s3", "How do volcanoes erupt?")]).outputs
    mem = {r["question"]: r["memory"] for r in out}
    assert "green" in mem["What is my favourite colour?"]
    assert mem["How do volcanoes erupt?"] == ""


# -- packing, no store ------------------------------------------------------------
def test_pack_memory_alternates_turns_and_facts_within_the_budget():
    turns = [("user", "t1 " * 10), ("assistant", "t2"), ("user", "t3")]
    facts = [FactHit("f1", 0.9, {}, 0.0), FactHit("f2 " * 30, 0.8, {}, 0.0),
             FactHit("f3", 0.7, {}, 0.0)]
    text, kept_t, kept_f = pack_memory(turns, facts, 30, approx_tokens)
    assert [t for _, t in kept_t] == ["t2", "t3"]  # t1 did not fit: the history stops
    assert [f.text for f in kept_f] == ["f1", "f3"]  # f2 did not fit: skipped
    assert text == ("Known facts about the user:\n- f1\n- f3\n"
                    "Conversation so far:\nassistant: t2\nuser: t3")
    assert pack_memory(turns, facts, 3, approx_tokens) == ("", [], [])


# -- compile-time errors name the stage ----------------------------------------------
YAML = """version: 1
pipeline: m
source: {{fields: [uid, sid, question]}}
engines:
  embedder: {{backend: onnx, model: minilm-l6-int8}}
stages:
  - {{id: recall, op: memory_read, user: uid, session: sid, {read}}}
"""


@pytest.mark.parametrize("read, message", [
    ("store: {backend: redis}", r"stage 'recall': unknown memory store backend 'redis'"),
    ("store: {backend: sqlite, path: /no/such/dir/m.sqlite}",
     r"stage 'recall': sqlite store path .* directory '/no/such/dir' does not exist"),
    ("store: {backend: postgres, dsn: 'host=localhost port'}",
     r"stage 'recall': postgres store 'dsn' is malformed"),
    ("query: question", r"stage 'recall': 'query' needs 'embedder'"),
    ("query: question, embedder: nope", r"stage 'recall': unknown engine 'nope'"),
    ("k: 3", r"stage 'recall': 'k' facts need 'query'"),
    ("embedder: embedder", r"stage 'recall': 'embedder' is unused without 'query'"),
    ("turns: -1", r"stage 'recall': 'turns' must be a number of turns >= 0, got -1"),
    ("ordered: yes please", r"'ordered' must be true or false, got 'yes please'"),
    ("user: 3", r"'user' must be the field holding the user \(tenant\) id, got 3"),
    ("query: missing, embedder: embedder", r"reads unknown field 'missing'"),
])
def test_bad_memory_read_stages_fail_at_compile_time(read, message):
    text = YAML.format(read=read).replace("user: uid, session: sid, user: 3", "user: 3, "
                                                                              "session: sid")
    p = loads_pipeline(text, "m.yaml")
    with pytest.raises(PlanError, match=message):
        tr.compile_pipeline(p)


@pytest.mark.parametrize("write, message", [
    ("turns: 3", r"'turns' must be a mapping of role -> text field"),
    ("turns: {user: ''}", r"'turns' must be a mapping of role -> text field, like \{user: "
                          r"question, assistant: answer\}, got \{'user': ''\}"),
    ("turns: {}", r"memory_write stores nothing"),
    ("metadata: meta", r"'metadata' belongs to facts"),
    ("ttl_s: 60", r"'ttl_s' is the facts' TTL"),
    ("turn_ttl_s: 0", r"'turn_ttl_s' must be a positive number of seconds, got 0"),
    ("facts: remember", r"'facts' needs 'embedder'"),
])
def test_bad_memory_write_stages_fail_at_compile_time(write, message):
    text = YAML.replace("memory_read", "memory_write").replace("question]", "question, answer]")
    text = text.format(read=write)
    with pytest.raises(PlanError, match=r"m\.yaml:7: stage 'recall': " + message):
        tr.compile_pipeline(loads_pipeline(text, "m.yaml"))


def test_stages_naming_one_store_share_it(tmp_path):
    spec = {"backend": "sqlite", "path": str(tmp_path / "m.sqlite")}
    assert open_store(check_store_spec(spec)) is open_store(check_store_spec(dict(spec)))
