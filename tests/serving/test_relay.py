"""``unless_gone`` and ``read_json`` against ASGI messages: when the connection is read
and what a body that arrives in pieces (or not at all) becomes."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect, Request

from tailrace.serving import relay
from tailrace.serving.handlers import read_json
from tailrace.serving.openai_wire import WireError
from tailrace.serving.relay import ClientGone, unless_gone
from tailrace.serving.service import Cancel


def request(messages: list[dict], reads: list[int] | None = None,
            gone: asyncio.Event | None = None) -> Request:
    """A request whose ``receive`` hands out ``messages``, then waits for ``gone``
    (an ``http.disconnect``); each call is counted in ``reads``."""
    pending = list(messages)

    async def receive() -> dict:
        if reads is not None:
            reads.append(1)
        if pending:
            return pending.pop(0)
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": [],
                    "query_string": b""}, receive)


def test_a_quick_answer_never_reads_the_connection():
    async def main() -> tuple[str, list[int]]:
        reads: list[int] = []

        async def quick() -> str:
            await asyncio.sleep(0)  # it waits, but less than WATCH_AFTER_S
            return "answer"

        out = await unless_gone(request([], reads), quick(), Cancel())
        await asyncio.sleep(relay.WATCH_AFTER_S * 2)  # the watcher's timer is gone too
        return out, reads

    assert asyncio.run(main()) == ("answer", [])


def test_a_client_that_leaves_a_long_call_cancels_it():
    async def main() -> tuple[bool, bool]:
        gone, cancel = asyncio.Event(), Cancel()
        stopped = asyncio.Event()

        async def long() -> str:
            try:
                await asyncio.sleep(30)
            finally:
                stopped.set()
            return "never"

        gone.set()  # left at once: noticed once the watcher looks
        with pytest.raises(ClientGone):
            await unless_gone(request([], gone=gone), long(), cancel)
        return cancel.is_set(), stopped.is_set()

    assert asyncio.run(main()) == (True, True)


def test_a_long_call_whose_client_stays_is_answered():
    async def main() -> tuple[str, list[int]]:
        reads: list[int] = []

        async def slow() -> str:
            await asyncio.sleep(relay.WATCH_AFTER_S * 3)
            return "answer"

        return await unless_gone(request([], reads), slow(), Cancel()), reads

    out, reads = asyncio.run(main())
    assert out == "answer" and reads == [1]  # one watcher, waiting, then stopped


def body(*parts: bytes) -> list[dict]:
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
            for i, p in enumerate(parts)]


def test_a_body_in_pieces_is_put_together():
    got = asyncio.run(read_json(request(body(b'{"a": ', b'"b", ', b'"c": 1}')), 100))
    assert got == {"a": "b", "c": 1}


def test_a_body_over_the_limit_in_pieces_is_a_413():
    with pytest.raises(WireError, match="exceeds the limit of 10 bytes") as e:
        asyncio.run(read_json(request(body(b'{"a": ', b'"bbbbbbbb"}')), 10))
    assert e.value.status == 413


def test_a_client_that_leaves_mid_body_is_a_disconnect():
    gone = asyncio.Event()
    gone.set()
    with pytest.raises(ClientDisconnect):
        asyncio.run(read_json(request([{"type": "http.request", "body": b'{"a"',
                                        "more_body": True}], gone=gone), 100))


@pytest.mark.parametrize("parts, why", [((b"",), "request body is empty"),
                                        ((b"[1]",), "must be a JSON object, got list"),
                                        ((b"{x",), "not valid JSON")])
def test_bad_bodies_are_refused(parts, why):
    with pytest.raises(WireError, match=why):
        asyncio.run(read_json(request(body(*parts)), 100))
