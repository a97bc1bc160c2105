"""A submitted request seen from its HTTP client: the client may leave, and a streamed
answer's pieces wait for it within a bound.

``unless_gone`` awaits a submission and, when the client disconnects first, sets the
request's cancel (the engine stops at the next token) and raises ``ClientGone`` (the app
answers 499). ``Relay`` carries a streamed request's pieces on a bounded queue, which
``sse_response`` turns into a ``text/event-stream`` ending ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..request import Request as Envelope
from .errors import ServiceError
from .openai_wire import SSE_DONE
from .service import Cancel, PipelineService

END = object()  # end of a request's token stream
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


#: how long an answer may take before a watcher looks for the client leaving: a task
#: reading the connection costs ~20 us per request, more than the rest of a one-`map`
#: pipeline's path (bench/serve_load.py --vs-bare); a client that leaves is noticed
#: at most this much later (its engine work stops then, at the next token)
WATCH_AFTER_S = 0.02


async def unless_gone(request: Request, call: Any, cancel: Cancel) -> Any:
    """Await ``call`` in this task; if the client disconnects first, set ``cancel``, stop
    the call and raise ``ClientGone``. The call runs inline (no task, no
    ``asyncio.wait``); a watcher task reads the connection only once the call has taken
    ``WATCH_AFTER_S``."""
    task = asyncio.current_task()
    assert task is not None
    gone: list[bool] = []
    watcher: list[asyncio.Future] = []

    def left(w: asyncio.Future) -> None:
        if not w.cancelled() and w.exception() is None:
            gone.append(True)
            cancel.set()
            task.cancel()  # the call stops where it waits

    def watch() -> None:
        w = asyncio.ensure_future(_wait_disconnect(request))
        w.add_done_callback(left)
        watcher.append(w)

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
    try:
        return await call
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientGone from None
    finally:
        timer.cancel()
        for w in watcher:
            w.remove_done_callback(left)
            w.cancel()


def _quiet(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


class Relay:
    """One submitted request whose text pieces arrive on a queue, then ``END``. The queue
    holds at most ``budget`` pieces (a conforming pipeline sends fewer in all): a piece
    past it stops the generation and the stream ends with an error event."""

    def __init__(self, service: PipelineService, record: dict, budget: int,
                 env: Envelope | None = None) -> None:
        self.pieces: asyncio.Queue = asyncio.Queue(maxsize=budget + 1)  # +1: END
        self.budget = budget
        self.overflowed = False
        self.cancel = Cancel()
        self.task = asyncio.ensure_future(
            service.submit(record, on_token=self._piece, cancel=self.cancel, request=env))
        self.task.add_done_callback(_quiet)
        self.task.add_done_callback(lambda _: self.pieces.put_nowait(END))

    def _piece(self, piece: str) -> None:
        if self.overflowed:
            return
        if self.pieces.qsize() >= self.budget:
            self.overflowed = True
            self.cancel.set()  # the engine stops this sequence at its next token
            return
        self.pieces.put_nowait(piece)

    def result(self) -> Any:
        """The output record; raises the request's ``ServiceError``, or one saying the
        stream was cut at its bound."""
        out = self.task.result()
        if self.overflowed:
            raise ServiceError(f"more than {self.budget} streamed text pieces waited for "
                               "the client (twice the generate stages' max_tokens: the engine "
                               "wrote past max_tokens); the stream was cut",
                               code="stream_overflow")
        return out

    async def first(self, request: Request) -> Any:
        """The first piece (or ``END``); a failure before any piece raises, so it gets
        its own HTTP status instead of an error inside a 200 stream."""
        try:
            item = await unless_gone(request, self.pieces.get(), self.cancel)
        except ClientGone:
            self.abandon()
            raise
        if item is END and self.task.exception() is not None:
            raise self.task.exception()  # type: ignore[misc]
        return item

    async def texts(self, first: Any) -> AsyncIterator[str]:
        """Pieces as they come, joined when several are already waiting."""
        item = first
        while item is not END:
            parts = [item]
            item = None
            while not self.pieces.empty():
                nxt = self.pieces.get_nowait()
                if nxt is END:
                    item = END
                    break
                parts.append(nxt)
            yield "".join(parts)
            if item is None:
                item = await self.pieces.get()

    def abandon(self) -> None:
        if not self.task.done():
            self.cancel.set()
            self.task.cancel()


async def sse_response(request: Request, service: PipelineService, record: dict,
                       budget: int, events: Callable[[Relay, Any], AsyncIterator[bytes]],
                       env: Envelope | None = None) -> Response:
    """Submit ``record`` and stream ``events(relay, first piece)`` as server-sent events,
    then ``[DONE]``. A failure before the first piece gets its own HTTP status; a client
    that goes away stops the generation for it. ``budget``: most pieces that may wait
    for the client (``piece_budget``); ``env``: the record's request."""
    relay = Relay(service, record, budget, env)
    first = await relay.first(request)  # ClientGone: the app answers 499

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for event in events(relay, first):
                yield event
            yield SSE_DONE
        finally:
            relay.abandon()  # a no-op once the request has ended

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=_SSE_HEADERS)
