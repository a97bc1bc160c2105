"""A served run's requests across actors: the driver's live ones, the hosts' proxies.

A served record points at its ``Request`` (``tailrace/request.py``), whose cancel signal
and token sink belong to the caller in the driver's process; a request pickles as its
data and the live parts stay home (``ServedRequests``, by id). Each host gives a request
it receives live parts of its own (``HostRequests.bind``): a cancel flag set when the
driver reports the caller gave up, and a sink that queues each piece for the driver,
counting it on ``Request.streamed``. Records reaching the driver get the live request
back, with the reply filled on the host; an output waits until every piece its request
streamed has reached the caller (pieces ride another host's drains), at most
``PIECES_WAIT_S``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

from ...engines.call import Streamed
from ...request import REQUEST, Cancel, Request, request_of

#: Cancelled request ids a host remembers for records that arrive after the cancel.
REMEMBERED = 4096
#: longest a served output waits for its streamed pieces (they ride another host's
#: drains); past it the output goes anyway (pieces lost with a dead host never come)
PIECES_WAIT_S = 2.0


class HostRequests:
    """One served run's requests on one host: a cancel flag per request id (shared by
    that request's records here, forgotten with them) and the ids cancelled so far.

    put: ``put(rid, piece, position)`` queues a streamed piece for the driver (on the
         loop).
    """

    def __init__(self, put: Callable[[Any, str, int], None]) -> None:
        self.put = put
        self.flags: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.cancelled: OrderedDict = OrderedDict()

    def bind(self, records: list) -> None:
        """Give each freshly unpickled request of ``records`` this host's live parts."""
        loop: asyncio.AbstractEventLoop | None = None
        for r in records:
            req = request_of(r)
            if req is None:
                continue
            flag = self.flags.get(req.rid)
            if flag is None:
                flag = self.flags[req.rid] = Cancel()
                if req.cancel.is_set() or req.rid in self.cancelled:
                    flag.set()
            sink = None
            if req.sink is not None:
                loop = loop or asyncio.get_running_loop()
                sink = partial(self._piece, req, loop)
            req.bind(flag, sink)

    def _piece(self, req: Request, loop: asyncio.AbstractEventLoop, piece: str) -> None:
        """A request's token sink here (called from any thread): counts the piece on the
        request and queues it in the run's outbox for the driver."""
        req.streamed += 1
        loop.call_soon_threadsafe(self.put, req.rid, piece, req.streamed)

    def cancel(self, rids: list) -> None:
        """The callers of ``rids`` gave up: set their flags (now and on arrival)."""
        for rid in rids:
            self.cancelled[rid] = None
            flag = self.flags.get(rid)
            if flag is not None:
                flag.set()
        while len(self.cancelled) > REMEMBERED:
            self.cancelled.popitem(last=False)


class _Entry:
    """The driver's state of one served request."""

    __slots__ = ("req", "answered", "cancel_sent", "delivered", "parked")

    def __init__(self, req: Request) -> None:
        self.req = req  # the live request (the caller's cancel and sink)
        self.answered = False  # an output or error record came back
        self.cancel_sent = False  # the hosts were told its caller gave up
        self.delivered = Streamed()  # the pieces its caller's sink has had
        # (pieces its output waits for, [(sink, record, born, sent)]) or None
        self.parked: tuple[int, list] | None = None


class ServedRequests:
    """The driver's live requests of a served run, by id (see the module docstring).

    deliver: ``deliver(target, records, born, sent)`` hands records to a sink (an
             output whose pieces are all in).
    """

    def __init__(self, deliver: Callable[[int, list, float, float], None]) -> None:
        self.deliver = deliver
        self.entries: dict[int, _Entry] = {}

    def hold(self, records: list) -> None:
        """``records`` leave for the hosts: remember their live requests."""
        for r in records:
            req = request_of(r)
            if req is not None and req.rid not in self.entries:
                self.entries[req.rid] = _Entry(req)

    def arrived(self, records: list) -> dict[int, int]:
        """Records back from the hosts (changed in place): their live requests back,
        with the reply filled there, marked answered; returns, by request id, how many
        pieces the hosts streamed for each that streamed any."""
        streamed: dict[int, int] = {}
        for r in records:
            q, e = self._entry(r)
            if q is None or e is None:  # no request, or its caller is gone: nobody's
                continue
            e.answered = True
            live = e.req
            if q is not live:
                live.reply = q.reply
                live.streamed = max(live.streamed, q.streamed)
                r[REQUEST] = live
            if q.streamed:
                streamed[q.rid] = q.streamed
        return streamed

    def _entry(self, r: Any) -> tuple[Request | None, _Entry | None]:
        """Record ``r``'s request and the driver's entry for it (None, None: neither)."""
        q = request_of(r)
        return q, (self.entries.get(q.rid) if q is not None else None)

    def unanswered(self, records: list) -> list:
        """The records of ``records`` no output or error record answered."""
        return [r for r in records
                if (e := self._entry(r)[1]) is not None and not e.answered]

    def forget(self, records: list) -> None:
        """``records``' source batch is settled: forget their requests (one whose
        output waits for its pieces lives until it is delivered)."""
        for r in records:
            q, e = self._entry(r)
            if q is not None and e is not None:
                if e.parked is None:
                    del self.entries[q.rid]
                else:
                    e.answered = e.cancel_sent = False

    def pieces(self, pieces: dict) -> None:
        """Streamed pieces from a host: to each caller's sink, in order, each position
        once (a record replayed after an actor died streams its first pieces again);
        an output that waited for them goes on once they are all in."""
        for rid, (first, got) in pieces.items():
            e = self.entries.get(rid)
            sink = e.req.sink if e is not None else None
            if e is None or sink is None:
                continue
            for piece in e.delivered.fresh_at(first - 1, got):
                sink(piece)
            if e.parked is not None and e.delivered.given >= e.parked[0]:
                self.unpark(rid)

    def ready(self, target: int, records: list, expected: dict, born: float,
              sent: float) -> list:
        """The records whose streamed pieces are all in; the others wait for them
        (``pieces``), at most ``PIECES_WAIT_S``."""
        out = []
        for r in records:
            q, e = self._entry(r)
            n = expected.get(q.rid, 0) if q is not None else 0
            if q is None or e is None or n <= e.delivered.given:
                out.append(r)
                continue
            if e.parked is None:
                e.parked = (n, [])
            e.parked[1].append((target, r, born, sent))
            asyncio.get_running_loop().call_later(PIECES_WAIT_S, self.unpark, q.rid)
        return out

    def unpark(self, rid: int) -> None:
        e = self.entries.get(rid)
        if e is None or e.parked is None:
            return
        waiting, e.parked = e.parked[1], None
        for target, r, born, sent in waiting:
            self.deliver(target, [r], born, sent)
        if not e.answered:  # settled meanwhile: forget it now
            del self.entries[rid]

    def unpark_all(self) -> None:
        """The run ends: outputs still waiting for pieces go now."""
        for rid in [rid for rid, e in self.entries.items() if e.parked is not None]:
            self.unpark(rid)

    def newly_cancelled(self) -> list[int]:
        """Ids of requests whose callers gave up since the last call."""
        out = []
        for rid, e in list(self.entries.items()):
            if not e.cancel_sent and e.req.cancel.is_set():
                e.cancel_sent = True
                out.append(rid)
        return out
