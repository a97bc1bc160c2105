"""The memory stores, each test on SQLite and on a real PostgreSQL + pgvector server:
turns and facts, TTL with an injected clock, tenant isolation, injection, restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tailrace.errors import StoreError
from tailrace.stores.memory import Fact, Turn, check_store_spec, open_store
from tests import pg_fixture

memory_spec = pg_fixture.memory_spec  # fixtures: SQLite and PostgreSQL
pg_server = pg_fixture.pg_server

np = pytest.importorskip("numpy")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = 1_700_000_000.0  # the injected "now"


def store_of(spec):
    return open_store(check_store_spec(spec))


def vec(*xs):
    return np.array(xs, dtype=np.float32)


def test_last_turns_oldest_first_per_session(memory_spec):
    s = store_of(memory_spec)
    s.add_turns([Turn("ada", "s1", "user", f"q{i}") for i in range(5)], T0)
    s.add_turns([Turn("ada", "s2", "user", "other session")], T0)
    assert s.last_turns("ada", "s1", 3, T0) == [("user", "q2"), ("user", "q3"), ("user", "q4")]
    assert s.last_turns("ada", "s2", 10, T0) == [("user", "other session")]
    assert s.last_turns("ada", "s1", 0, T0) == []
    assert s.last_turns("ada", "nope", 5, T0) == []


def test_top_facts_rank_by_cosine_within_user_and_model(memory_spec):
    s = store_of(memory_spec)
    s.add_facts([Fact("ada", "east", vec(1, 0, 0), "m1", {"n": 1}),
                 Fact("ada", "north-east", vec(1, 1, 0), "m1"),
                 Fact("ada", "north", vec(0, 1, 0), "m1"),
                 Fact("ada", "other model", vec(1, 0, 0), "m2"),
                 Fact("ada", "other dim", vec(1, 0, 0, 0), "m1")], T0)
    hits = s.top_facts("ada", "m1", vec(2, 0, 0), 2, T0)
    assert [h.text for h in hits] == ["east", "north-east"]
    assert hits[0].score == pytest.approx(1.0, abs=1e-5)
    assert hits[1].score == pytest.approx(2 ** -0.5, abs=1e-5)
    assert hits[0].metadata == {"n": 1} and hits[0].created == T0
    assert [h.text for h in s.top_facts("ada", "m2", vec(0, 1, 0), 5, T0)] == ["other model"]
    assert s.top_facts("ada", "m1", vec(1, 0, 0), 0, T0) == []


def test_same_fact_again_replaces_it(memory_spec):
    s = store_of(memory_spec)
    s.add_facts([Fact("ada", "likes tea", vec(1, 0), "m", {"v": 1})], T0)
    s.add_facts([Fact("ada", "likes tea", vec(1, 0), "m", {"v": 2})], T0 + 5)
    [hit] = s.top_facts("ada", "m", vec(1, 0), 5, T0 + 5)
    assert (hit.metadata, hit.created) == ({"v": 2}, T0 + 5)


def test_ttl_expiry_with_an_injected_clock(memory_spec):
    s = store_of(memory_spec)
    s.add_turns([Turn("ada", "s1", "user", "short", ttl_s=60), Turn("ada", "s1", "user", "kept")],
                T0)
    s.add_facts([Fact("ada", "fleeting", vec(1, 0), "m", ttl_s=60),
                 Fact("ada", "lasting", vec(0.9, 0.1), "m")], T0)
    assert [t for _, t in s.last_turns("ada", "s1", 5, T0 + 59.9)] == ["short", "kept"]
    assert [h.text for h in s.top_facts("ada", "m", vec(1, 0), 5, T0 + 59.9)] == \
        ["fleeting", "lasting"]
    assert [t for _, t in s.last_turns("ada", "s1", 5, T0 + 60)] == ["kept"]
    assert [h.text for h in s.top_facts("ada", "m", vec(1, 0), 5, T0 + 60)] == ["lasting"]
    assert s.purge(T0 + 59) == 0
    assert s.purge(T0 + 61) == 2
    assert s.statistics().purged == 2


def test_one_tenant_never_reads_another(memory_spec):
    s = store_of(memory_spec)
    s.add_turns([Turn("ada", "shared-id", "user", "ada's secret")], T0)
    s.add_facts([Fact("ada", "ada's fact", vec(1, 0), "m")], T0)
    assert s.last_turns("eve", "shared-id", 10, T0) == []  # a guessed session id
    assert s.top_facts("eve", "m", vec(1, 0), 10, T0) == []
    assert s.last_turns("ada", "shared-id", 10, T0) == [("user", "ada's secret")]


INJECTIONS = ["x'); DROP TABLE turns; --", "x'); DROP TABLE tailrace_memory_turns; --",
              "' OR '1'='1", "\" OR 1=1 --", "%s %(user)s ?", "ü\u2603 \\ \n\t"]


def test_injection_attempts_are_stored_verbatim(memory_spec):
    s = store_of(memory_spec)
    s.add_turns([Turn("bob", "safe", "user", "bob's turn")], T0)
    for i, evil in enumerate(INJECTIONS):
        s.add_turns([Turn(evil, evil, evil, evil)], T0 + i)
        s.add_facts([Fact(evil, evil, vec(1, i), "m", {"k": evil})], T0 + i)
    for evil in INJECTIONS:
        assert s.last_turns(evil, evil, 5, T0 + 10) == [(evil, evil)]
        [hit] = s.top_facts(evil, "m", vec(1, 0), 5, T0 + 10)
        assert (hit.text, hit.metadata) == (evil, {"k": evil})
    # nothing leaked across tenants, nothing was dropped
    assert s.last_turns("bob", "safe", 5, T0 + 10) == [("user", "bob's turn")]
    assert s.last_turns("' OR '1'='1", "safe", 5, T0 + 10) == []
    assert s.statistics().turns_written == len(INJECTIONS) + 1


_WRITE = """
import json, sys
from tailrace.stores.memory import Fact, Turn, check_store_spec, open_store
s = open_store(check_store_spec(json.loads(sys.argv[1])))
s.add_turns([Turn("ada", "s1", "user", "hello"), Turn("ada", "s1", "assistant", "hi Ada")], 1.0)
s.add_facts([Fact("ada", "Ada studies rivers", [0.6, 0.8], "m", {"src": "chat"})], 1.0)
s.close()
"""
_READ = """
import json, sys
from tailrace.stores.memory import check_store_spec, open_store
s = open_store(check_store_spec(json.loads(sys.argv[1])))
hits = s.top_facts("ada", "m", [0.6, 0.8], 3, 2.0)
print(json.dumps({"turns": s.last_turns("ada", "s1", 5, 2.0),
                  "facts": [[h.text, round(h.score, 4), h.metadata] for h in hits]}))
"""


def test_memory_survives_a_process_restart(memory_spec):
    arg = json.dumps(memory_spec)
    subprocess.run([sys.executable, "-c", _WRITE, arg], cwd=ROOT, check=True)
    out = subprocess.run([sys.executable, "-c", _READ, arg], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert json.loads(out) == {"turns": [["user", "hello"], ["assistant", "hi Ada"]],
                               "facts": [["Ada studies rivers", 1.0, {"src": "chat"}]]}


def test_statistics_count_reads_and_writes(memory_spec):
    s = store_of(memory_spec)
    s.add_turns([Turn("a", "s", "user", "x"), Turn("a", "s", "assistant", "y")], T0)
    s.add_facts([Fact("a", "f", vec(1, 0), "m")], T0)
    s.last_turns("a", "s", 2, T0)
    s.top_facts("a", "m", vec(1, 0), 1, T0)
    st = s.statistics()
    assert (st.backend, st.turns_written, st.facts_written, st.turn_reads, st.fact_reads) == \
        (memory_spec["backend"], 2, 1, 1, 1)


def test_a_zero_vector_is_refused(memory_spec):
    s = store_of(memory_spec)
    with pytest.raises(StoreError, match="must be non-empty, finite and non-zero"):
        s.add_facts([Fact("a", "f", vec(0, 0), "m")], T0)


class FakeTime:
    """A clock whose ``sleep`` advances it: waits cost no real time."""

    def __init__(self):
        self.now, self.slept, self.on_sleep = 1000.0, 0.0, None

    def sleep(self, s):
        self.now += s
        self.slept += s
        if self.on_sleep is not None:
            self.on_sleep()


def test_a_session_claim_waits_until_its_turn_is_written(memory_spec):
    s, t = store_of(memory_spec), FakeTime()
    claim = lambda sid, timeout: s.claim_session("ada", sid, timeout, clock=lambda: t.now,  # noqa: E731
                                                 sleep=t.sleep)
    assert claim("s1", 5.0) and t.slept == 0
    assert claim("s2", 5.0) and t.slept == 0  # other sessions are independent
    assert not claim("s1", 5.0)  # s1's turn is in flight: the wait times out ...
    assert t.slept == pytest.approx(5.0)  # ... after 5 (virtual) seconds, and takes it over
    s.add([Turn("ada", "s1", "user", "q")], (), T0, release=[("ada", "s1")])
    assert claim("s1", 5.0) and t.slept == pytest.approx(5.0)  # released: no wait
    t.now += 10.0  # a claim older than the timeout (its run died) is taken over at once
    assert claim("s1", 5.0) and t.slept == pytest.approx(5.0)
    t.on_sleep = lambda: s.add((), (), T0, release=[("ada", "s1")])  # written while waiting
    assert claim("s1", 5.0) and 5.0 < t.slept < 5.1
    st = s.statistics()
    assert (st.claims_timed_out, st.claims_waited) == (1, 1)


def test_a_claim_is_seen_by_another_connection(memory_spec):
    from tailrace.stores.memory import close_stores

    first = store_of(memory_spec)
    assert first.claim_session("ada", "s1", 5.0)
    close_stores()  # a new process would open its own connection
    t = FakeTime()
    other = store_of(memory_spec)
    assert other is not first
    assert not other.claim_session("ada", "s1", 0.5, clock=lambda: t.now, sleep=t.sleep)


# -- configuration (compile-time checks) ---------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ({"backend": "redis"}, r"unknown memory store backend 'redis'; known: sqlite, postgres"),
    ({"backend": "sqlite", "file": "x"}, r"unknown key 'file' in a sqlite store"),
    ({"backend": "sqlite", "path": "/no/such/dir/m.sqlite"},
     r"directory '/no/such/dir' does not exist"),
    ({"backend": "sqlite", "path": 3}, r"'path' must be a file path, got 3"),
    ({"backend": "postgres"}, r"needs exactly one of 'dsn'"),
    ({"backend": "postgres", "dsn": "not a dsn"}, r"'dsn' is malformed \(missing \"=\""),
    ({"backend": "postgres", "dsn_env": "TAILRACE_TEST_UNSET_DSN"},
     r"environment variable 'TAILRACE_TEST_UNSET_DSN' is not set"),
    ("memory.sqlite", r"'store' must be a mapping"),
])
def test_bad_store_configs_are_refused(spec, message):
    with pytest.raises(StoreError, match=message):
        check_store_spec(spec)


def test_default_store_is_sqlite_in_tailrace_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TAILRACE_HOME", str(tmp_path))
    assert check_store_spec(None) == {"backend": "sqlite",
                                      "path": str(tmp_path / "memory.sqlite")}
    monkeypatch.setenv("MY_DSN", "postgresql://u@127.0.0.1:5432/db")
    assert check_store_spec({"backend": "postgres", "dsn_env": "MY_DSN"}) == \
        {"backend": "postgres", "dsn_env": "MY_DSN"}


def _open_at_once(path, barrier, results):
    from tailrace.stores.memory_sqlite import SqliteMemory

    barrier.wait()
    try:
        SqliteMemory(path)
        results.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        results.put(str(e))


def test_many_processes_open_one_new_sqlite_file_at_once(tmp_path):
    # Ray stage hosts open one memory file together: the loser of the WAL switch used to
    # fail with "database is locked" (seen in CI, about 1 trial in 30 with 8 openers)
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for trial in range(3):
        path = str(tmp_path / f"m{trial}.sqlite")
        barrier, results = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(path, barrier, results))
                 for _ in range(6)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert got == ["ok"] * 6


class _Locked:
    """A connection whose first ``fails`` statements answer "database is locked"."""

    def __init__(self, real, fails, message):
        self.real, self.fails, self.message = real, fails, message

    def execute(self, *a):
        if self.fails[0] > 0:
            self.fails[0] -= 1
            raise __import__("sqlite3").OperationalError(self.message)
        return self.real.execute(*a)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        return self.real.__enter__()

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)


@pytest.mark.parametrize("message,opens", [("database is locked", True),
                                           ("disk I/O error", False)])
def test_a_locked_open_is_retried_and_other_errors_are_not(monkeypatch, tmp_path, message,
                                                          opens):
    import sqlite3

    from tailrace.stores import memory_sqlite

    real_connect, fails = sqlite3.connect, [2]
    monkeypatch.setattr(memory_sqlite.sqlite3, "connect",
                        lambda *a, **k: _Locked(real_connect(*a, **k), fails, message))
    path = str(tmp_path / "m.sqlite")
    if opens:
        memory_sqlite.SqliteMemory(path).add_turns([Turn("ada", "s", "user", "hi")], T0)
        assert fails == [0]
    else:
        with pytest.raises(StoreError, match="cannot open the sqlite memory store.*disk I/O"):
            memory_sqlite.SqliteMemory(path)
        assert fails == [1]
