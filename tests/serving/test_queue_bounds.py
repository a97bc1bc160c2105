"""Every queue on a served record's path has a bound, and each bound holds when the
consumer stalls: the streamed pieces of a request (``relay.Relay``) and the engine
pool's event queue (``engines/pool/pool.py``). The service's feed: ``test_service.py``."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

import tailrace as tr
from tailrace.engines import GenerationRequest
from tailrace.engines.pool import EnginePool
from tailrace.serving import ServiceError
from tailrace.serving.binding import piece_budget
from tailrace.serving.relay import END, Relay
from tests.serving import fakes


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.005)


class Chatty:
    """A service whose one request streams up to ``n`` pieces (stopping when cancelled)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = 0

    async def submit(self, record: dict, on_token, cancel: threading.Event, *,
                     request=None) -> dict:
        for i in range(self.n):
            if cancel.is_set():
                break
            on_token(f"w{i} ")
            self.sent += 1
        return {"answer": "..."}


def test_streamed_pieces_wait_within_their_bound_for_a_stalled_client():
    service = Chatty(1000)

    async def main():
        relay = Relay(service, {}, budget=20)  # type: ignore[arg-type]
        await relay.task
        await asyncio.sleep(0)  # the END callback
        return relay

    relay = asyncio.run(main())
    assert relay.pieces.qsize() == 21  # 20 pieces and END: nobody read any
    assert relay.overflowed and relay.cancel.is_set()
    assert service.sent == 21  # the piece past the bound stopped the generation
    items = [relay.pieces.get_nowait() for _ in range(21)]
    assert items[:20] == [f"w{i} " for i in range(20)] and items[20] is END
    with pytest.raises(ServiceError, match="more than 20 streamed text pieces waited") as ei:
        relay.result()
    assert ei.value.code == "stream_overflow"


def test_a_conforming_stream_never_reaches_its_bound():
    service = Chatty(50)

    async def main():
        relay = Relay(service, {}, budget=50)  # type: ignore[arg-type]
        await relay.task
        return relay

    relay = asyncio.run(main())
    assert not relay.overflowed and relay.result() == {"answer": "..."}
    assert service.sent == 50


def test_piece_budget_counts_every_generate_attempt(monkeypatch):
    fakes.register_echo(monkeypatch)
    p = tr.Pipeline("two", engines={"llm": fakes.echo_spec()})
    (p.source(fields=["q"])
     .apply("generate", engine="llm", input="q", output="a", max_tokens=10, id="g1")
     .apply("generate", engine="llm", input="a", output="b", max_tokens=5, id="g2",
            retries=2)
     .sink())
    assert piece_budget(tr.compile_pipeline(p)) == 2 * (10 + 5 * 3) + 16


class Stallable:
    """The pool's event queue with a switch that stalls its consumer (the loop's wait
    for the next event; the loop's non-blocking drain is left alone)."""

    def __init__(self) -> None:
        self.inner: queue.SimpleQueue = queue.SimpleQueue()
        self.open = threading.Event()
        self.open.set()
        self.stalled = threading.Event()  # the loop waits at the switch

    def put(self, item) -> None:
        self.inner.put(item)

    def get(self, block: bool = True, timeout: float | None = None):
        if timeout is not None and not self.open.is_set():
            self.stalled.set()
            self.open.wait()
        return self.inner.get(block, timeout)

    def empty(self) -> bool:
        return self.inner.empty()

    def qsize(self) -> int:
        return self.inner.qsize()


def test_pool_events_hold_one_entry_per_blocked_caller(monkeypatch):
    """With the pool's loop stalled, callers add one entry each (they block until the
    loop finishes their call) and token pieces bypass the queue entirely."""
    fakes.register_echo(monkeypatch)
    pool = EnginePool("bound", fakes.echo_spec(), replicas=1, isolation="thread",
                      max_in_flight=1, max_batch_size=1, max_wait_ms=0)
    events = pool._events = Stallable()
    pool.start()
    go, first, stop = threading.Event(), threading.Event(), threading.Event()
    pieces: list[str] = []
    k = 5
    started, finished, errors = [0] * k, [0] * k, []

    def on_token(i: int, piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 1:
            first.set()
            go.wait(10)

    words = " ".join(f"w{i}" for i in range(40))
    out: dict = {}
    streamer = threading.Thread(target=lambda: out.update(a=pool.generate(
        [GenerationRequest(prompt=words, max_tokens=40)], on_token)))

    def caller(i: int) -> None:
        try:
            while not stop.is_set():
                started[i] += 1
                [g] = pool.generate([GenerationRequest(prompt=f"c{i}", max_tokens=4)])
                assert g.text == f"c{i}"
                finished[i] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(k)]
    try:
        streamer.start()
        wait_until(first.is_set)  # its batch is on the replica, paused at piece 1
        events.open.clear()
        wait_until(events.stalled.is_set)  # the loop takes nothing in now
        for t in callers:
            t.start()
        wait_until(lambda: events.qsize() == k)
        go.set()
        wait_until(lambda: len(pieces) == 40)  # streamed while the loop is stalled
        wait_until(lambda: events.qsize() == k + 1)  # the batch's result
        assert started == [1] * k and finished == [0] * k  # none got a second call in
        assert events.qsize() == k + 1
        stop.set()
        events.open.set()
        for t in [streamer, *callers]:
            t.join(30)
        assert not errors and out["a"][0].text == words
        assert all(n >= 1 for n in finished)
    finally:
        go.set()
        stop.set()
        events.open.set()
        pool.stop()
