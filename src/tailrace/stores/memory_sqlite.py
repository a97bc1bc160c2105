"""The SQLite memory store: one file in WAL mode, the default.

Facts keep their unit-norm float32 embedding as a BLOB; a fact query reads the user's
unexpired facts of the query's embedding model and ranks them exactly with one numpy
matrix product (per-user memories are small; see ``bench/memory.py``). One connection
serves every thread of the process behind a lock; other processes may open the same
file (WAL lets readers proceed while one process writes).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import StoreError
from .memory import Fact, FactHit, MemoryStore, Turn, expiry, text_hash, turn_rows, unit_vector

SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id TEXT NOT NULL, session_id TEXT NOT NULL, role TEXT NOT NULL, text TEXT NOT NULL,
    created REAL NOT NULL, expires REAL);
CREATE INDEX IF NOT EXISTS turns_by_session ON turns (user_id, session_id, id);
CREATE TABLE IF NOT EXISTS facts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id TEXT NOT NULL, model TEXT NOT NULL, text_hash TEXT NOT NULL, text TEXT NOT NULL,
    embedding BLOB NOT NULL, metadata TEXT NOT NULL, created REAL NOT NULL, expires REAL,
    UNIQUE (user_id, model, text_hash));
CREATE TABLE IF NOT EXISTS pending (
    user_id TEXT NOT NULL, session_id TEXT NOT NULL, since REAL NOT NULL,
    PRIMARY KEY (user_id, session_id));
CREATE TABLE IF NOT EXISTS responses (
    user_id TEXT NOT NULL, id TEXT NOT NULL, payload TEXT NOT NULL,
    created REAL NOT NULL, expires REAL, PRIMARY KEY (user_id, id));
CREATE INDEX IF NOT EXISTS responses_by_expiry ON responses (expires);
"""

_ADD_TURN = ("INSERT INTO turns (user_id, session_id, role, text, created, expires) "
             "VALUES (?, ?, ?, ?, ?, ?)")
_ADD_FACT = ("INSERT INTO facts (user_id, model, text_hash, text, embedding, metadata, created,"
             " expires) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
             "ON CONFLICT (user_id, model, text_hash) DO UPDATE SET text = excluded.text, "
             "embedding = excluded.embedding, metadata = excluded.metadata, "
             "created = excluded.created, expires = excluded.expires")
_CLAIM = ("INSERT INTO pending (user_id, session_id, since) VALUES (?, ?, ?) "
          "ON CONFLICT (user_id, session_id) DO UPDATE SET since = excluded.since "
          "WHERE pending.since < ?")
_RELEASE = "DELETE FROM pending WHERE user_id = ? AND session_id = ?"
_LAST_TURNS = ("SELECT role, text FROM turns WHERE user_id = ? AND session_id = ? "
               "AND (expires IS NULL OR expires > ?) ORDER BY id DESC LIMIT ?")
_USER_FACTS = ("SELECT text, embedding, metadata, created FROM facts WHERE user_id = ? "
               "AND model = ? AND (expires IS NULL OR expires > ?)")

_PUT_RESPONSE = ("INSERT INTO responses (user_id, id, payload, created, expires) "
                 "VALUES (?, ?, ?, ?, ?) ON CONFLICT (user_id, id) DO UPDATE SET "
                 "payload = excluded.payload, created = excluded.created, "
                 "expires = excluded.expires")
_GET_RESPONSE = ("SELECT payload FROM responses WHERE user_id = ? AND id = ? "
                 "AND (expires IS NULL OR expires > ?)")
_DELETE_RESPONSE = ("DELETE FROM responses WHERE user_id = ? AND id = ? "
                    "AND (expires IS NULL OR expires > ?)")


OPEN_WAIT_S = 30.0


def _open(path: str) -> sqlite3.Connection:
    """Connect, switch to WAL and create the schema, retrying while another opener holds it.

    Several processes (Ray stage hosts) may open one new file at the same moment. SQLite
    answers the loser of the journal-mode switch or of a lock upgrade with "database is
    locked" at once, without waiting for its busy timeout, so the whole sequence is
    retried with backoff up to ``OPEN_WAIT_S``; any other error is reported at once.
    """
    deadline = time.monotonic() + OPEN_WAIT_S
    pause = 0.01
    while True:
        conn = None
        try:
            conn = sqlite3.connect(path, check_same_thread=False, timeout=10.0)
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(SCHEMA)
            return conn
        except sqlite3.OperationalError as e:
            if conn is not None:
                conn.close()
            busy = "locked" in str(e) or "busy" in str(e)
            if not busy or time.monotonic() + pause > deadline:
                raise StoreError(f"cannot open the sqlite memory store {path!r}: {e}") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            raise StoreError(f"cannot open the sqlite memory store {path!r}: {e}") from None


class SqliteMemory(MemoryStore):
    """Turns and facts in one SQLite file (``:memory:`` for a private in-process one)."""

    backend = "sqlite"

    def __init__(self, path: str) -> None:
        """Open (creating if needed) the store at ``path``, and its directory."""
        super().__init__()
        self.path = path
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = _open(path)
        self._lock = threading.Lock()

    def add(self, turns: Sequence[Turn], facts: Sequence[Fact], now: float,
            release: Sequence[tuple[str, str]] = ()) -> None:
        turns_ = turn_rows(turns, now)
        fact_rows = [(f.user, f.model, text_hash(f.text), f.text,
                      unit_vector(f.vector).tobytes(), json.dumps(f.metadata), now,
                      expiry(now, f.ttl_s)) for f in facts]
        with self._lock, self._conn:
            for sql, rows in ((_ADD_TURN, turns_), (_ADD_FACT, fact_rows), (_RELEASE, release)):
                if rows:
                    self._conn.executemany(sql, rows)
            self._n["turns_written"] += len(turns_)
            self._n["facts_written"] += len(fact_rows)

    def last_turns(self, user: str, session: str, n: int, now: float) -> list[tuple[str, str]]:
        if n <= 0:
            return []
        with self._lock:
            rows = self._conn.execute(_LAST_TURNS, (user, session, now, n)).fetchall()
            self._n["turn_reads"] += 1
        return [(r[0], r[1]) for r in reversed(rows)]

    def top_facts(self, user: str, model: str, vector: Any, k: int, now: float) -> list[FactHit]:
        import numpy as np

        if k <= 0:
            return []
        q = unit_vector(vector)
        with self._lock:
            rows = self._conn.execute(_USER_FACTS, (user, model, now)).fetchall()
            self._n["fact_reads"] += 1
        rows = [r for r in rows if len(r[1]) == 4 * q.size]  # another dim: not comparable
        if not rows:
            return []
        m = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32)
        scores = m.reshape(len(rows), q.size) @ q
        top = np.argsort(-scores, kind="stable")[:k]
        return [FactHit(rows[i][0], float(scores[i]), json.loads(rows[i][2]), rows[i][3])
                for i in top]

    def _try_claim(self, user: str, session: str, now: float, stale_before: float) -> bool:
        with self._lock, self._conn:
            return self._conn.execute(_CLAIM, (user, session, now, stale_before)).rowcount > 0

    def purge(self, now: float) -> int:
        with self._lock, self._conn:
            n = self._conn.execute("DELETE FROM turns WHERE expires <= ?", (now,)).rowcount
            n += self._conn.execute("DELETE FROM facts WHERE expires <= ?", (now,)).rowcount
            n += self._conn.execute("DELETE FROM responses WHERE expires <= ?",
                                    (now,)).rowcount
            self._n["purged"] += n
        return n

    def put_response(self, user: str, rid: str, payload: str, now: float,
                     expires: float | None) -> None:
        with self._lock, self._conn:
            self._conn.execute(_PUT_RESPONSE, (user, rid, payload, now, expires))

    def get_response(self, user: str, rid: str, now: float) -> str | None:
        with self._lock:
            row = self._conn.execute(_GET_RESPONSE, (user, rid, now)).fetchone()
        return None if row is None else str(row[0])

    def delete_response(self, user: str, rid: str, now: float) -> bool:
        with self._lock, self._conn:
            return self._conn.execute(_DELETE_RESPONSE, (user, rid, now)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __repr__(self) -> str:
        return f"SqliteMemory({self.path!r})"
