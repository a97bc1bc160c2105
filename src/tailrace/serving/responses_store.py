"""Where ``/v1/responses`` keeps responses: per tenant, in a memory store, for a while.

``Retention`` says where (a memory store config, ``stores/memory.py``: SQLite at
``$TAILRACE_HOME/memory.sqlite`` by default, or PostgreSQL) and how long (``ttl_s``); a
``ServingHub`` carries one (``responses=``). ``ResponseLog`` is an app's handle: it opens
the store on first use (an app that never stores a response opens nothing), runs every
store call in a thread (the store is synchronous) and purges expired rows now and then.
A response is kept under its tenant (``tenant_key``), so a tenant can never read or
delete another's: the store filters every query on it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..stores.memory import MemoryStore, check_store_spec, open_store
from .errors import ServiceError
from .tenants import Tenant

#: how long a stored response is kept by default (OpenAI keeps them 30 days)
DEFAULT_TTL_S = 30 * 24 * 3600.0
#: at most this often a write also purges expired rows
PURGE_EVERY_S = 3600.0


@dataclass(frozen=True)
class Retention:
    """Where and how long ``/v1/responses`` keeps responses.

    ttl_s:  seconds a stored response stays readable (and usable as a
            ``previous_response_id``).
    store:  a memory store config (``stores.memory.check_store_spec``): None is SQLite at
            ``$TAILRACE_HOME/memory.sqlite``; ``{backend: postgres, dsn: ...}`` shares the
            responses between servers.
    clock:  the time in Unix seconds (tests inject one).
    """

    ttl_s: float = DEFAULT_TTL_S
    store: dict[str, Any] | None = None
    clock: Callable[[], float] = field(default=time.time, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float)) \
                or not math.isfinite(self.ttl_s) or self.ttl_s <= 0:
            raise ValueError(f"the responses' retention (ttl_s) must be a positive number of "
                             f"seconds, got {self.ttl_s!r}")
        check_store_spec(self.store)  # StoreError naming what to fix, before serving


def tenant_key(tenant: Tenant | None) -> str:
    """The store's user for a caller: its tenant's name; "" (which no tenant can be
    named) for the operator's key, or when the server takes no keys."""
    return tenant.name if tenant is not None else ""


class ResponseLog:
    """One app's stored responses (``Retention``'s store and TTL)."""

    def __init__(self, retention: Retention | None = None) -> None:
        self.retention = retention if retention is not None else Retention()
        self._spec = check_store_spec(self.retention.store)
        self._next_purge = 0.0

    def _store(self) -> MemoryStore:
        return open_store(self._spec)  # the process's one store for the spec

    def _put(self, user: str, rid: str, payload: str) -> None:
        now = self.retention.clock()
        store = self._store()
        store.put_response(user, rid, payload, now, now + self.retention.ttl_s)
        if now >= self._next_purge:
            self._next_purge = now + PURGE_EVERY_S
            store.purge(now)

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` in a thread; a store failure is a 503 naming it."""
        try:
            return await asyncio.to_thread(fn)
        except Exception as e:  # noqa: BLE001 - StoreError, sqlite3/psycopg errors
            raise ServiceError(f"the responses store could not {what}: {type(e).__name__}: "
                               f"{e}", status=503, code="response_store_unavailable",
                               retry_after=1.0) from None

    async def put(self, user: str, rid: str, stored: dict[str, Any]) -> None:
        """Keep ``stored`` (a JSON object) as response ``rid`` of ``user``."""
        payload = json.dumps(stored, ensure_ascii=False, separators=(",", ":"))
        await self._call("keep a response", lambda: self._put(user, rid, payload))

    async def get(self, user: str, rid: str) -> dict[str, Any] | None:
        """``user``'s unexpired response ``rid`` as ``put`` kept it, or None."""
        payload = await self._call("read a response", lambda: self._store().get_response(
            user, rid, self.retention.clock()))
        return None if payload is None else dict(json.loads(payload))

    async def delete(self, user: str, rid: str) -> bool:
        """Delete ``user``'s response ``rid``; False when there was none to delete."""
        return bool(await self._call("delete a response", lambda: self._store()
                                     .delete_response(user, rid, self.retention.clock())))
