"""The memory stores' stored responses (``POST /v1/responses``), each test on SQLite and
on a real PostgreSQL server: put, get, replace, delete, tenant isolation, expiry with an
injected clock and purge."""

from __future__ import annotations

import pytest

from tailrace.stores.memory import check_store_spec, open_store
from tests import pg_fixture

memory_spec = pg_fixture.memory_spec  # fixtures: SQLite and PostgreSQL
pg_server = pg_fixture.pg_server

T0 = 1_700_000_000.0  # the injected "now"


@pytest.fixture
def store(memory_spec):
    return open_store(check_store_spec(memory_spec))


def test_put_get_replace_delete(store):
    store.put_response("acme", "resp_1", '{"a": 1}', T0, T0 + 60)
    assert store.get_response("acme", "resp_1", T0) == '{"a": 1}'
    store.put_response("acme", "resp_1", '{"a": 2}', T0 + 1, None)  # the same id replaces
    assert store.get_response("acme", "resp_1", T0 + 1e9) == '{"a": 2}'  # never expires
    assert store.get_response("acme", "resp_2", T0) is None
    assert store.delete_response("acme", "resp_1", T0) is True
    assert store.get_response("acme", "resp_1", T0) is None
    assert store.delete_response("acme", "resp_1", T0) is False


def test_a_tenant_never_reads_or_deletes_another_ones(store):
    store.put_response("acme", "resp_1", "mine", T0, None)
    assert store.get_response("globex", "resp_1", T0) is None
    assert store.delete_response("globex", "resp_1", T0) is False
    assert store.get_response("acme", "resp_1", T0) == "mine"
    store.put_response("globex", "resp_1", "theirs", T0, None)  # the same id: its own row
    assert store.get_response("acme", "resp_1", T0) == "mine"
    assert store.get_response("globex", "resp_1", T0) == "theirs"


def test_expired_responses_are_gone_and_purged(store):
    store.put_response("acme", "old", "x", T0, T0 + 10)
    store.put_response("acme", "new", "y", T0, T0 + 100)
    assert store.get_response("acme", "old", T0 + 9.9) == "x"
    assert store.get_response("acme", "old", T0 + 10) is None  # expired: unreadable at once
    assert store.delete_response("acme", "old", T0 + 10) is False  # and not there to delete
    assert store.purge(T0 + 10) == 1
    assert store.purge(T0 + 10) == 0
    assert store.get_response("acme", "new", T0 + 10) == "y"
    assert store.purge(T0 + 100) == 1
    assert store.get_response("acme", "new", T0) is None  # purged: gone even at an earlier now
