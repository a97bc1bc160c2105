"""One process-wide registry: objects shared by key, created once, closed together.

Engines, engine pools, memory stores, live indexes, route ledgers and feeders are each
shared by every pipeline of a process. Each kind keeps a ``Registry``: ``get`` creates
the object on first use under the registry's lock (so two stages asking at once share
one), ``close_all`` takes every object out and closes it outside the lock. A registry made
with ``at_exit=True`` (engine pools, live indexes) closes what it holds at interpreter
exit too; it registers that when it makes its first object, never at import.

>>> opened = Registry("demo", close=lambda s: s.clear())
>>> a = opened.get("k", lambda: {"n": 1})
>>> opened.get("k", lambda: {"n": 2}) is a
True
>>> opened.close_all()
>>> a, len(opened)
({}, 0)
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Registry(Generic[V]):
    """Objects by key. ``close``: how to close one (default: its ``close()``);
    ``at_exit``: ``close_all`` at interpreter exit, registered with the first object."""

    def __init__(self, name: str, close: Callable[[V], object] | None = None,
                 at_exit: bool = False) -> None:
        self.name = name
        self._close = close
        self._at_exit = at_exit
        self._items: dict[Hashable, V] = {}
        self.lock = threading.RLock()

    def get(self, key: Hashable, make: Callable[[], V],
            reuse: Callable[[V], bool] | None = None) -> V:
        """The object under ``key``, made by ``make()`` if there is none yet (or if
        ``reuse`` says the one there can no longer serve, e.g. a stopped pool)."""
        with self.lock:
            item = self._items.get(key)
            if item is None or (reuse is not None and not reuse(item)):
                item = make()
                self._items[key] = item
                if self._at_exit:  # once, at the first object made
                    self._at_exit = False
                    atexit.register(self.close_all)
            return item

    def peek(self, key: Hashable) -> V | None:
        """The object under ``key`` or None; creates nothing."""
        with self.lock:
            return self._items.get(key)

    def pop(self, key: Hashable) -> V | None:
        """Take the object under ``key`` out (the caller closes it); None if absent."""
        with self.lock:
            return self._items.pop(key, None)

    def items(self) -> list[tuple[Hashable, V]]:
        """A snapshot of (key, object) pairs."""
        with self.lock:
            return list(self._items.items())

    def __len__(self) -> int:
        return len(self._items)

    def close_all(self) -> None:
        """Take every object out, then close each (the first error is raised after all
        were closed)."""
        with self.lock:
            items = list(self._items.values())
            self._items.clear()
        first: BaseException | None = None
        for item in items:
            try:
                if self._close is not None:
                    self._close(item)
                else:
                    item.close()  # type: ignore[attr-defined]
            except Exception as e:  # noqa: BLE001 - close the rest, then report
                first = first or e
        if first is not None:
            raise first
