"""Structured memory: conversation turns per session and long-term facts per user (and
the stored responses of ``POST /v1/responses``: ``put_response``).

Two stores implement ``MemoryStore``: SQLite (``memory_sqlite.py``, the default) and
PostgreSQL with pgvector (``memory_pg.py``); docs/memory.md. Every query filters on the
user, the tenant, so one user never reads another's memory, even with a guessed session
id; all SQL is parameterised; time is passed in (``now``), so TTLs are tested without
sleeping. ``open_store`` shares one store (one connection) per configuration in the
process. Ordered reads (``claim_session``) keep a mark per session in the store itself,
so they work across processes: a read marks the session, the write of its turn
(``add(..., release=...)``) removes it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engines.models import home
from ..errors import StoreError
from ..registry import Registry

BACKENDS = ("sqlite", "postgres")
_KEYS = {"sqlite": ("backend", "path"), "postgres": ("backend", "dsn", "dsn_env")}


@dataclass(frozen=True)
class Turn:
    """One conversation turn to store."""

    user: str  # the tenant the turn belongs to
    session: str  # the conversation, scoped to its user
    role: str  # who spoke (``user``, ``assistant``, ...)
    text: str  # what was said
    ttl_s: float | None = None  # seconds until it expires (None: never)


@dataclass(frozen=True)
class Fact:
    """One long-term fact about a user; the same text again replaces the old one."""

    user: str  # the tenant the fact belongs to
    text: str
    vector: Any  # its embedding (any float sequence; stored unit-normalised)
    model: str  # the embedding model (facts are only compared with queries of that model)
    metadata: dict[str, Any] = field(default_factory=dict)  # a JSON object kept with it
    ttl_s: float | None = None  # seconds until it expires (None: never)


@dataclass(frozen=True)
class FactHit:
    """A fact found for a query: text, cosine similarity, metadata, when it was stored."""

    text: str
    score: float
    metadata: dict[str, Any]
    created: float


@dataclass(frozen=True)
class MemoryStats:
    """Counters of one store since it was opened (``MemoryStore.statistics()``)."""

    backend: str
    turns_written: int
    facts_written: int
    turn_reads: int
    fact_reads: int
    purged: int
    claims_waited: int
    claims_timed_out: int


class MemoryStore:
    """What memory_read and memory_write need from a store (thread-safe). The backends
    subclass it; the counters, the add wrappers and session claims are shared here."""

    backend = ""

    def __init__(self) -> None:
        self._n = {"turns_written": 0, "facts_written": 0, "turn_reads": 0, "fact_reads": 0,
                   "purged": 0, "claims_waited": 0, "claims_timed_out": 0}

    def statistics(self) -> MemoryStats:
        """Counters since the store was opened."""
        return MemoryStats(self.backend, **self._n)

    def add(self, turns: Sequence[Turn], facts: Sequence[Fact], now: float,
            release: Sequence[tuple[str, str]] = ()) -> None:
        """Append turns (in order), insert facts (the same user, model and text again
        replaces the old fact) and release session claims, all in one transaction."""
        raise NotImplementedError

    def add_turns(self, turns: Sequence[Turn], now: float) -> None:
        """``add(turns, (), now)``."""
        self.add(turns, (), now)

    def add_facts(self, facts: Sequence[Fact], now: float) -> None:
        """``add((), facts, now)``."""
        self.add((), facts, now)

    def last_turns(self, user: str, session: str, n: int, now: float) -> list[tuple[str, str]]:
        """The last ``n`` unexpired ``(role, text)`` of a session, oldest first."""
        raise NotImplementedError

    def top_facts(self, user: str, model: str, vector: Any, k: int, now: float) -> list[FactHit]:
        """The ``k`` unexpired facts of ``user`` most similar to ``vector``, best first."""
        raise NotImplementedError

    def purge(self, now: float) -> int:
        """Delete expired turns, facts and responses; returns how many rows went."""
        raise NotImplementedError

    # -- stored responses (``POST /v1/responses``; serving/responses_store.py) -----------
    def put_response(self, user: str, rid: str, payload: str, now: float,
                     expires: float | None) -> None:
        """Keep response ``rid`` of ``user`` (the tenant): its JSON text ``payload``, until
        ``expires`` (None: never); the same id again replaces it."""
        raise NotImplementedError

    def get_response(self, user: str, rid: str, now: float) -> str | None:
        """The payload of ``user``'s unexpired response ``rid``, or None (none, expired,
        or another user's)."""
        raise NotImplementedError

    def delete_response(self, user: str, rid: str, now: float) -> bool:
        """Delete ``user``'s response ``rid``; True when an unexpired one was there."""
        raise NotImplementedError

    def close(self) -> None:
        """Close the connection."""
        raise NotImplementedError

    def _try_claim(self, user: str, session: str, now: float, stale_before: float) -> bool:
        """Mark the session unless a mark newer than ``stale_before`` exists."""
        raise NotImplementedError

    def claim_session(self, user: str, session: str, timeout_s: float, *,
                      clock: Callable[[], float] = time.time,
                      sleep: Callable[[float], None] = time.sleep) -> bool:
        """Wait until no other turn of ``(user, session)`` is in flight (read but not yet
        written back), then mark this one in flight; False when the wait timed out.

        timeout_s:    the longest wait; a mark older than this is taken over (its turn
                      failed or its run died), and so is any mark once the wait ends.
        clock, sleep: wall-clock time and sleeping (tests inject both).
        Polls every 2 ms, backing off to 50 ms.
        """
        start = clock()
        pause, waited = 0.002, False
        while True:
            now = clock()
            if self._try_claim(user, session, now, now - timeout_s):
                self._n["claims_waited"] += waited
                return True
            if now - start >= timeout_s:
                self._try_claim(user, session, now, float("inf"))
                self._n["claims_timed_out"] += 1
                return False
            sleep(min(pause, timeout_s - (now - start)))
            pause, waited = min(pause * 2, 0.05), True


def check_store_spec(spec: Any) -> dict[str, Any]:
    """A validated store config with defaults filled; StoreError says what to fix. ``spec``:
    None (SQLite at ``$TAILRACE_HOME/memory.sqlite``), ``{backend: sqlite, path: ...}`` or
    ``{backend: postgres, dsn: ...}``."""
    if spec is None:
        spec = {"backend": "sqlite"}
    if not isinstance(spec, dict):
        raise StoreError(f"'store' must be a mapping like {{backend: sqlite, path: "
                         f"memory.sqlite}}, got {spec!r}")
    backend = spec.get("backend", "sqlite")
    if backend not in BACKENDS:
        raise StoreError(f"unknown memory store backend {backend!r}; known: "
                         f"{', '.join(BACKENDS)}")
    stray = sorted(k for k in spec if k not in _KEYS[backend])
    if stray:
        raise StoreError(f"unknown key '{stray[0]}' in a {backend} store (its keys: "
                         f"{', '.join(_KEYS[backend])})")
    if backend == "sqlite":
        return {"backend": "sqlite", "path": _sqlite_path(spec.get("path"))}
    return {"backend": "postgres", **_pg_dsn(spec)}


def _sqlite_path(path: Any) -> str:
    if path is None:
        return str(home() / "memory.sqlite")
    if not isinstance(path, str) or not path:
        raise StoreError(f"sqlite store 'path' must be a file path, got {path!r}")
    if path == ":memory:":
        return path
    full = Path(path).expanduser().absolute()
    if not full.parent.is_dir():
        raise StoreError(f"sqlite store path {path!r}: directory {str(full.parent)!r} does "
                         "not exist; create it or choose another path")
    return str(full)


def _pg_dsn(spec: dict[str, Any]) -> dict[str, Any]:
    dsn, env = spec.get("dsn"), spec.get("dsn_env")
    if (dsn is None) == (env is None):
        raise StoreError("a postgres store needs exactly one of 'dsn' (like "
                         "postgresql://user@127.0.0.1:5432/db) or 'dsn_env' (an environment "
                         "variable holding it)")
    if env is not None:
        if not isinstance(env, str) or not os.environ.get(env):
            raise StoreError(f"postgres store 'dsn_env': environment variable {env!r} is not "
                             "set; export it with the connection string")
        check_dsn(os.environ[env])
        return {"dsn_env": env}
    if not isinstance(dsn, str) or not dsn.strip():
        raise StoreError(f"postgres store 'dsn' must be a connection string, got {dsn!r}")
    check_dsn(dsn)
    return {"dsn": dsn}


def psycopg() -> Any:
    """The psycopg module; StoreError with the install command if missing."""
    try:
        import psycopg
    except ImportError:
        raise StoreError("the postgres store needs psycopg 3; install it with: "
                         "pip install 'psycopg[binary]'") from None
    return psycopg


def check_dsn(dsn: str) -> None:
    """Parse a PostgreSQL connection string without connecting; StoreError if malformed."""
    psycopg()  # StoreError if it is missing
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(dsn)
    except Exception as e:  # noqa: BLE001 - psycopg.ProgrammingError and friends
        raise StoreError(f"postgres store 'dsn' is malformed ({e}); use a URI like "
                         "postgresql://user@127.0.0.1:5432/db or 'host=... dbname=...'") \
            from None


_STORES: Registry[MemoryStore] = Registry("memory stores")


def open_store(spec: dict[str, Any]) -> MemoryStore:
    """The process's store for a config from ``check_store_spec`` (opened on first use)."""
    key = (("sqlite", spec["path"]) if spec["backend"] == "sqlite"
           else ("postgres", spec.get("dsn") or os.environ.get(spec["dsn_env"], "")))

    def make() -> MemoryStore:
        if key[0] == "sqlite":
            from .memory_sqlite import SqliteMemory

            return SqliteMemory(key[1])
        from .memory_pg import PostgresMemory

        return PostgresMemory(key[1])

    return _STORES.get(key, make)


def close_stores() -> None:
    """Close every store ``open_store`` opened (tests; a process about to exit)."""
    _STORES.close_all()


def unit_vector(vector: Any) -> Any:
    """``vector`` as a float32 unit vector; StoreError for empty, zero or non-finite ones."""
    import numpy as np

    v = np.asarray(vector, dtype=np.float32).ravel()
    norm = float(np.linalg.norm(v)) if v.size else 0.0
    if not v.size or not np.isfinite(norm) or norm == 0.0:
        raise StoreError(f"a memory vector must be non-empty, finite and non-zero "
                         f"(got {v.size} values, norm {norm})")
    return v / norm


def text_hash(text: str) -> str:
    """The key that makes a repeated fact (same user, model, text) replace the stored one."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def expiry(now: float, ttl_s: float | None) -> float | None:
    """The expiry time of a row written at ``now`` with a TTL (None: never)."""
    return None if ttl_s is None else now + float(ttl_s)


def turn_rows(turns: Sequence[Turn], now: float) -> list[tuple]:
    """``(user, session, role, text, created, expires)`` per turn, as both backends store it."""
    return [(t.user, t.session, t.role, t.text, now, expiry(now, t.ttl_s)) for t in turns]
