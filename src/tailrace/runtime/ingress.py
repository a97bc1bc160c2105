"""Reading a run's input: bounded chunks, admission at the source, failed inputs.

Every runtime reads its sources here (the local runtime, the Ray driver and, through
the local runtime, a served pipeline's feed). Without admission a source is read in
chunks of at most the first stage's micro-batch; with admission each record waits for
the gate in a task of its own (open loop: a queued record does not delay the next
arrival), at most ``window`` records at once, and the source reads on only while fewer
wait, so memory stays flat whatever the input size. A source that fails ends its stream
with one error record (``<after record N>``); what it read before is kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from itertools import islice
from time import perf_counter
from typing import Any

from ..api.records import ErrorRecord
from ..observability import StageMeter


class Feed:
    """An async input that can also hand over what has already arrived as one list (a
    served pipeline's request feed): read without admission, a burst of requests then
    crosses the plan as one micro-batch instead of one batch per record. Subclasses
    define ``__aiter__`` (one record at a time, for admission) and ``batches``.

    ``push(records, alone=False) -> bool``, set while the feed is read without admission
    into one channel, hands records straight to the first stage when it has room; the
    owner calls it, on the run's loop, only while the source is idle (order kept).
    ``alone``: nothing else in flight, so an idle inline first stage may run them at once
    on the caller's stack (``LocalRun``).
    """

    push: Callable[..., bool] | None = None

    def __aiter__(self) -> AsyncIterator[Any]:
        raise NotImplementedError

    def batches(self, n: int) -> AsyncIterator[list]:
        """Lists of at most ``n`` records: each what had arrived when it was taken."""
        raise NotImplementedError


async def chunks(data: Any, n: int) -> AsyncIterator[list]:
    """``data`` (an iterable, a ``Feed``, or an async iterable: one record at a time) in
    lists of at most ``n`` records; an exception of the input is raised after what it gave
    before."""
    if isinstance(data, Feed):
        async for batch in data.batches(n):
            yield batch
        return
    if hasattr(data, "__aiter__"):
        async for x in data:
            yield [x]
        return
    it = iter(data)
    while True:
        chunk: list = []
        try:
            chunk.extend(islice(it, n))  # keeps what was read before a failure
        except Exception:
            if chunk:
                yield chunk
            raise
        if not chunk:
            return
        yield chunk


def input_failed(op_id: str, meter: StageMeter, e: BaseException) -> ErrorRecord:
    """The error record that ends a source whose input raised ``e``."""
    meter.errors += 1
    return ErrorRecord.from_exception(op_id, f"<after record {meter.records_out}>", e)


async def read(data: Any, n: int, meter: StageMeter,
               send: Callable[[list], Awaitable[None]],
               offer: Callable[[list, bool], bool] | None = None) -> None:
    """Send the input in chunks of at most ``n`` records (counted on ``meter``).

    offer: ``offer(records, alone) -> bool`` puts records downstream without waiting
           (``alone``: or runs them there, see ``Feed``), False if there is no room:
           given, a ``Feed`` may push straight through it.
    """
    if isinstance(data, Feed) and offer is not None:
        def push(records: list, alone: bool = False) -> bool:
            meter.records_out += len(records)  # read before the stage may run them
            if offer(records, alone):
                return True
            meter.records_out -= len(records)
            return False

        data.push = push
    try:
        async for chunk in chunks(data, n):
            meter.records_out += len(chunk)
            await send(chunk)
    finally:
        if isinstance(data, Feed):
            data.push = None


async def read_admitted(data: Any, gate: Any, pipeline: str, window: int, meter: StageMeter,
                        send: Callable[[Any, Any, float], Awaitable[Awaitable[None] | None]],
                        refuse: Callable[[Any, BaseException], None],
                        check: Callable[[Any], BaseException | None] | None = None) -> None:
    """Admit the input record by record, at most ``window`` waiting at once.

    send:   ``send(record, ticket, arrived)`` hands an admitted record on (``arrived``:
            ``perf_counter()`` when it was read) and owns its ticket from then on; it may
            return an awaitable to finish after the record's window slot is freed.
    refuse: ``refuse(record, exc)`` for a record not admitted (rejected, or by ``check``).
    A failing input raises its exception once every record read before it is settled.
    """
    slots = asyncio.Semaphore(window)

    async def admit(x: Any, arrived: float) -> None:
        after = None
        try:
            problem = check(x) if check is not None else None
            if problem is not None:
                refuse(x, problem)
                return
            try:
                ticket = await gate.admit(pipeline, x)
            except Exception as e:  # noqa: BLE001 - AdmissionRejected (or a gate failure)
                refuse(x, e)
                return
            after = await send(x, ticket, arrived)
        finally:
            slots.release()
        if after is not None:
            await after

    failure: BaseException | None = None
    async with asyncio.TaskGroup() as tg:
        aio = hasattr(data, "__aiter__")
        it = data.__aiter__() if aio else iter(data)
        while True:
            await slots.acquire()  # read on only while fewer than ``window`` records wait
            try:
                x = await it.__anext__() if aio else next(it)
            except (StopIteration, StopAsyncIteration):
                slots.release()
                break
            except Exception as e:  # noqa: BLE001 - the input failed: finish the others
                slots.release()
                failure = e
                break
            meter.records_out += 1
            tg.create_task(admit(x, perf_counter()))
    if failure is not None:
        raise failure
