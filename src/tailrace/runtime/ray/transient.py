"""A served record's live fields across actors: ``_cancel`` and ``_stream``.

A served record carries a caller's cancel flag (``_cancel``) and token callback
(``_stream``); neither means anything in another process. The driver keeps them by the
record's request key (``_rid``) and ships marks instead (``detach``); each host gives a
record it receives a flag and a stream proxy of its own (``HostSide.attach``). The flag
is set when the driver says the caller cancelled (``StageHost.cancel``); the proxy
queues each piece in the run's outbox, and the driver's drain hands the pieces to the
caller's callback in order. Leaving a host, the host's objects turn back into marks
when pickled; outputs and error records reaching the driver get the caller's own
objects back (``reattach``).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

#: What ``_cancel`` / ``_stream`` hold while a record crosses actors.
CANCEL_MARK = "tailrace:cancel"
STREAM_MARK = "tailrace:stream"
#: Cancelled request keys a host remembers for records that arrive after the cancel.
REMEMBERED = 4096


def _cancel_mark() -> str:
    return CANCEL_MARK


def _stream_mark(sent: int = 0) -> str:
    return f"{STREAM_MARK}#{sent}" if sent else STREAM_MARK


def pieces_of(mark: str) -> int:
    """How many pieces a record's stream mark says were streamed for it so far."""
    _, sep, n = mark.partition("#")
    return int(n) if sep and n.isdigit() else 0


def detach(records: list, key: str, held: dict) -> list:
    """``records`` with marks for live ``_cancel``/``_stream`` (copies of the records
    that have them); the live objects go to ``held[record[key]]``."""
    out = records
    for j, r in enumerate(records):
        if type(r) is not dict:
            continue
        c = r.get("_cancel")
        s = r.get("_stream")
        if c is None and s is None:
            continue
        if out is records:
            out = list(records)
        held[r.get(key)] = (c, s)
        r = dict(r)
        if c is not None:
            r["_cancel"] = CANCEL_MARK
        if s is not None:
            r["_stream"] = STREAM_MARK
        out[j] = r
    return out


def reattach(records: list, key: str, held: dict) -> dict:
    """Give records back from the actors (changed in place) their caller's own
    ``_cancel``/``_stream`` in place of the marks (dropped if the caller is gone), and
    without the class admission gave them for the engines (``_urgent``: nobody wrote it);
    returns, by request key, how many pieces the hosts streamed for each record that
    streamed any (its output must not overtake them)."""
    streamed: dict = {}
    for r in records:
        if type(r) is not dict:
            continue
        r.pop("_urgent", None)
        for j, field, mark in ((0, "_cancel", CANCEL_MARK), (1, "_stream", STREAM_MARK)):
            v = r.get(field)
            if type(v) is str and v.startswith(mark):
                if j == 1 and (n := pieces_of(v)):
                    streamed[r.get(key)] = n
                live = held.get(r.get(key))
                if live is not None and live[j] is not None:
                    r[field] = live[j]
                else:
                    del r[field]
    return streamed


class HostCancel:
    """A record's cancel flag inside a host; pickles back into the mark."""

    __slots__ = ("_set", "__weakref__")

    def __init__(self, is_set: bool = False) -> None:
        self._set = is_set

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def __reduce__(self) -> tuple:
        return _cancel_mark, ()


class HostStream:
    """A record's ``_stream`` inside a host: queues each piece (from any thread) in the
    run's outbox for the driver; pickles back into the mark, which carries how many
    pieces the record streamed so far (here and on earlier hosts): the driver holds the
    record's output until that many have reached the caller (they ride another host's
    drains, which may come later)."""

    __slots__ = ("rid", "put", "loop", "sent")

    def __init__(self, rid: Any, put: Callable[[Any, str, int], None],
                 loop: asyncio.AbstractEventLoop, sent: int = 0) -> None:
        self.rid, self.put, self.loop, self.sent = rid, put, loop, sent

    def __call__(self, piece: str) -> None:
        self.sent += 1
        self.loop.call_soon_threadsafe(self.put, self.rid, piece, self.sent)

    def __reduce__(self) -> tuple:
        return _stream_mark, (self.sent,)


class HostSide:
    """One run's live fields on one host: a flag per request key (shared by that
    request's records here, forgotten with them) and the keys cancelled so far.

    key: the field every served record keeps (the request id).
    put: ``put(rid, piece, position)`` queues a streamed piece for the driver (on the
         loop).
    """

    def __init__(self, key: str, put: Callable[[Any, str, int], None]) -> None:
        self.key = key
        self.put = put
        self.flags: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.cancelled: OrderedDict = OrderedDict()

    def attach(self, records: list) -> None:
        """Give each marked record (freshly unpickled: changed in place) live objects."""
        loop: asyncio.AbstractEventLoop | None = None
        for r in records:
            if type(r) is not dict:
                continue
            c = r.get("_cancel")
            s = r.get("_stream")
            if type(c) is str and c == CANCEL_MARK:
                rid = r.get(self.key)
                flag = self.flags.get(rid)
                if flag is None:
                    flag = self.flags[rid] = HostCancel(rid in self.cancelled)
                r["_cancel"] = flag
            if type(s) is str and s.startswith(STREAM_MARK):
                loop = loop or asyncio.get_running_loop()
                r["_stream"] = HostStream(r.get(self.key), self.put, loop, pieces_of(s))

    def cancel(self, rids: list) -> None:
        """The callers of ``rids`` gave up: set their flags (now and on arrival)."""
        for rid in rids:
            self.cancelled[rid] = None
            flag = self.flags.get(rid)
            if flag is not None:
                flag.set()
        while len(self.cancelled) > REMEMBERED:
            self.cancelled.popitem(last=False)
