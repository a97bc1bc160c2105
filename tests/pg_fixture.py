"""A real PostgreSQL 16 server with pgvector for the test session, and memory-store specs.

``pgserver`` (PyPI) bundles PostgreSQL 16 and pgvector's ``vector.so``. The server is
started once per test process, in a temporary directory, listening on a Unix-domain
socket only (no TCP port at all), and stopped (its data deleted) when the last fixture
using it is torn down. Run as root, pgserver runs ``initdb``/``pg_ctl`` as a system
user ``pgserver`` that it creates with ``useradd`` on first use (PostgreSQL refuses to
run as root); nothing else is needed.

Bind the fixtures in a test module: ``memory_spec = pg_fixture.memory_spec`` and
``pg_server = pg_fixture.pg_server``. ``memory_spec`` is parametrized: each test runs
on SQLite (a fresh file) and on PostgreSQL (a fresh database).
"""

from __future__ import annotations

import threading
import uuid

import pytest

_LOCK = threading.Lock()
_STATE: dict = {"server": None, "users": 0}


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    """The session's pgserver handle (``.get_uri(database=...)``); started on first use."""
    pgserver = pytest.importorskip("pgserver")
    psycopg = pytest.importorskip("psycopg")
    with _LOCK:
        if _STATE["server"] is None:
            root = tmp_path_factory.getbasetemp() / "pg"
            root.mkdir(exist_ok=True)
            server = pgserver.get_server(root / "data", cleanup_mode="delete")
            with psycopg.connect(server.get_uri(), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            _STATE["server"] = server
        _STATE["users"] += 1
        server = _STATE["server"]
    yield server
    with _LOCK:
        _STATE["users"] -= 1
        if _STATE["users"] == 0:
            _STATE["server"] = None
            server.cleanup()  # stops the server and deletes its data directory


def new_database(server) -> str:
    """A fresh database on ``server`` with the vector extension; returns its URI."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")  # a generated identifier, not user input
    uri = server.get_uri(database=name)
    with psycopg.connect(uri, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
    return uri


def drop_database(server, uri: str) -> None:
    import psycopg

    name = uri.rsplit("/", 1)[1].split("?", 1)[0]
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgres"])
def memory_spec(request, tmp_path):
    """A store config on a fresh SQLite file or a fresh PostgreSQL database."""
    from tailrace.stores.memory import close_stores

    if request.param == "sqlite":
        yield {"backend": "sqlite", "path": str(tmp_path / "memory.sqlite")}
        close_stores()
        return
    server = request.getfixturevalue("pg_server")
    uri = new_database(server)
    yield {"backend": "postgres", "dsn": uri}
    close_stores()
    drop_database(server, uri)
