"""The PostgreSQL memory store: psycopg 3 and a pgvector ``vector`` column.

Tables ``tailrace_memory_turns`` and ``tailrace_memory_facts`` are created on first
open (under an advisory lock, so concurrent first opens do not race); the ``vector``
extension is created if missing, which needs a role allowed to (else the error says
so). A fact query filters on the user, the embedding model and the dimension, and
orders by pgvector's cosine distance ``<=>``: an exact scan of that user's facts. One
connection serves the process behind a lock; a broken connection is reopened once and
the call retried (a turn write whose commit was cut off may then be stored twice).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import StoreError
from .memory import (
    Fact,
    FactHit,
    MemoryStore,
    Turn,
    expiry,
    psycopg,
    text_hash,
    turn_rows,
    unit_vector,
)

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS tailrace_memory_turns ("
    " id BIGSERIAL PRIMARY KEY, user_id TEXT NOT NULL, session_id TEXT NOT NULL,"
    " role TEXT NOT NULL, text TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,"
    " expires DOUBLE PRECISION)",
    "CREATE INDEX IF NOT EXISTS tailrace_memory_turns_by_session"
    " ON tailrace_memory_turns (user_id, session_id, id)",
    "CREATE TABLE IF NOT EXISTS tailrace_memory_facts ("
    " id BIGSERIAL PRIMARY KEY, user_id TEXT NOT NULL, model TEXT NOT NULL,"
    " text_hash TEXT NOT NULL, text TEXT NOT NULL, embedding vector NOT NULL,"
    " metadata JSONB NOT NULL, created DOUBLE PRECISION NOT NULL, expires DOUBLE PRECISION,"
    " UNIQUE (user_id, model, text_hash))",
    "CREATE TABLE IF NOT EXISTS tailrace_memory_pending ("
    " user_id TEXT NOT NULL, session_id TEXT NOT NULL, since DOUBLE PRECISION NOT NULL,"
    " PRIMARY KEY (user_id, session_id))",
    "CREATE TABLE IF NOT EXISTS tailrace_memory_responses ("
    " user_id TEXT NOT NULL, id TEXT NOT NULL, payload TEXT NOT NULL,"
    " created DOUBLE PRECISION NOT NULL, expires DOUBLE PRECISION, PRIMARY KEY (user_id, id))",
    "CREATE INDEX IF NOT EXISTS tailrace_memory_responses_by_expiry"
    " ON tailrace_memory_responses (expires)",
)
_ADD_TURN = ("INSERT INTO tailrace_memory_turns (user_id, session_id, role, text, created, "
             "expires) VALUES (%s, %s, %s, %s, %s, %s)")
_ADD_FACT = ("INSERT INTO tailrace_memory_facts (user_id, model, text_hash, text, embedding, "
             "metadata, created, expires) VALUES (%s, %s, %s, %s, %s::vector, %s, %s, %s) "
             "ON CONFLICT (user_id, model, text_hash) DO UPDATE SET text = EXCLUDED.text, "
             "embedding = EXCLUDED.embedding, metadata = EXCLUDED.metadata, "
             "created = EXCLUDED.created, expires = EXCLUDED.expires")
_CLAIM = ("INSERT INTO tailrace_memory_pending (user_id, session_id, since) VALUES (%s, %s, %s) "
          "ON CONFLICT (user_id, session_id) DO UPDATE SET since = EXCLUDED.since "
          "WHERE tailrace_memory_pending.since < %s")
_RELEASE = "DELETE FROM tailrace_memory_pending WHERE user_id = %s AND session_id = %s"
_LAST_TURNS = ("SELECT role, text FROM tailrace_memory_turns WHERE user_id = %s AND "
               "session_id = %s AND (expires IS NULL OR expires > %s) ORDER BY id DESC LIMIT %s")
_TOP_FACTS = ("SELECT text, 1 - (embedding <=> %(q)s::vector), metadata, created "
              "FROM tailrace_memory_facts WHERE user_id = %(user)s AND model = %(model)s "
              "AND vector_dims(embedding) = %(dim)s "
              "AND (expires IS NULL OR expires > %(now)s) "
              "ORDER BY embedding <=> %(q)s::vector LIMIT %(k)s")
_PUT_RESPONSE = ("INSERT INTO tailrace_memory_responses (user_id, id, payload, created, "
                 "expires) VALUES (%s, %s, %s, %s, %s) ON CONFLICT (user_id, id) DO UPDATE "
                 "SET payload = EXCLUDED.payload, created = EXCLUDED.created, "
                 "expires = EXCLUDED.expires")
_GET_RESPONSE = ("SELECT payload FROM tailrace_memory_responses WHERE user_id = %s AND "
                 "id = %s AND (expires IS NULL OR expires > %s)")
_DELETE_RESPONSE = ("DELETE FROM tailrace_memory_responses WHERE user_id = %s AND id = %s "
                    "AND (expires IS NULL OR expires > %s)")


def vector_literal(vector: Any) -> str:
    """A unit vector in pgvector's text form ``[x,y,...]`` (9 digits: float32 exact)."""
    return "[" + ",".join(f"{x:.9g}" for x in unit_vector(vector).tolist()) + "]"


class PostgresMemory(MemoryStore):
    """Turns and facts in a PostgreSQL database with the pgvector extension."""

    backend = "postgres"

    def __init__(self, dsn: str) -> None:
        """Connect to ``dsn`` (libpq string or URI) and create the tables if needed."""
        super().__init__()
        self._psycopg = psycopg()
        self._dsn = dsn
        self._lock = threading.Lock()
        self._conn = self._connect()
        self._setup()

    def _connect(self) -> Any:
        from psycopg.conninfo import conninfo_to_dict

        extra = {} if "connect_timeout" in conninfo_to_dict(self._dsn) else {"connect_timeout": 10}
        try:
            return self._psycopg.connect(self._dsn, autocommit=True, **extra)
        except self._psycopg.Error as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreError(f"cannot connect to the postgres memory store: {first}; check "
                             "the dsn and that the server is running") from None

    def _setup(self) -> None:
        conn = self._conn
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('tailrace_memory'))")
                if conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'vector'") \
                        .fetchone() is None:
                    conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
                for stmt in SCHEMA:
                    conn.execute(stmt)
        except self._psycopg.Error as e:
            raise StoreError(f"cannot set up the postgres memory store: {e}; the database "
                             "needs the pgvector extension (CREATE EXTENSION vector, run "
                             "once by a role allowed to) and a role that can create "
                             "tables") from None

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(connection)`` under the lock; reconnects once if the connection broke."""
        psycopg = self._psycopg
        with self._lock:
            for attempt in (1, 2):
                try:
                    return fn(self._conn)
                except psycopg.OperationalError as e:
                    if attempt == 2 or not (self._conn.closed or self._conn.broken):
                        raise StoreError(f"postgres memory store: {e}") from None
                    self._conn = self._connect()
                except psycopg.Error as e:
                    raise StoreError(f"postgres memory store: {e}") from None

    def _read(self, conn: Any, counter: str, sql: str, args: Any) -> list:
        rows = conn.execute(sql, args).fetchall()
        self._n[counter] += 1
        return rows

    def add(self, turns: Sequence[Turn], facts: Sequence[Fact], now: float,
            release: Sequence[tuple[str, str]] = ()) -> None:
        from psycopg.types.json import Jsonb

        turns_ = turn_rows(turns, now)
        fact_rows = [(f.user, f.model, text_hash(f.text), f.text, vector_literal(f.vector),
                      Jsonb(f.metadata), now, expiry(now, f.ttl_s)) for f in facts]

        def write(conn: Any) -> None:
            with conn.transaction(), conn.cursor() as cur:
                for sql, rows in ((_ADD_TURN, turns_), (_ADD_FACT, fact_rows),
                                  (_RELEASE, list(release))):
                    if rows:
                        cur.executemany(sql, rows)
            self._n["turns_written"] += len(turns_)
            self._n["facts_written"] += len(fact_rows)

        self._run(write)

    def last_turns(self, user: str, session: str, n: int, now: float) -> list[tuple[str, str]]:
        if n <= 0:
            return []
        rows = self._run(lambda c: self._read(c, "turn_reads", _LAST_TURNS,
                                              (user, session, now, n)))
        return [(r[0], r[1]) for r in reversed(rows)]

    def top_facts(self, user: str, model: str, vector: Any, k: int, now: float) -> list[FactHit]:
        if k <= 0:
            return []
        q = unit_vector(vector)
        args = {"q": vector_literal(q), "user": user, "model": model, "dim": int(q.size),
                "now": now, "k": k}
        rows = self._run(lambda c: self._read(c, "fact_reads", _TOP_FACTS, args))
        return [FactHit(r[0], float(r[1]), r[2], r[3]) for r in rows]

    def _try_claim(self, user: str, session: str, now: float, stale_before: float) -> bool:
        args = (user, session, now, stale_before)
        return bool(self._run(lambda c: c.execute(_CLAIM, args).rowcount > 0))

    def purge(self, now: float) -> int:
        def delete(conn: Any) -> int:
            with conn.transaction():
                n = conn.execute("DELETE FROM tailrace_memory_turns WHERE expires <= %s",
                                 (now,)).rowcount
                n += conn.execute("DELETE FROM tailrace_memory_facts WHERE expires <= %s",
                                  (now,)).rowcount
                n += conn.execute("DELETE FROM tailrace_memory_responses WHERE expires <= %s",
                                  (now,)).rowcount
            self._n["purged"] += n
            return int(n)

        return int(self._run(delete))

    def put_response(self, user: str, rid: str, payload: str, now: float,
                     expires: float | None) -> None:
        args = (user, rid, payload, now, expires)
        self._run(lambda c: c.execute(_PUT_RESPONSE, args))

    def get_response(self, user: str, rid: str, now: float) -> str | None:
        row = self._run(lambda c: c.execute(_GET_RESPONSE, (user, rid, now)).fetchone())
        return None if row is None else str(row[0])

    def delete_response(self, user: str, rid: str, now: float) -> bool:
        return bool(self._run(lambda c: c.execute(_DELETE_RESPONSE,
                                                  (user, rid, now)).rowcount > 0))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __repr__(self) -> str:
        return "PostgresMemory(...)"  # the dsn may hold a password
