"""One replica of one stage inside a ``StageHost`` actor: its input queue and its loop.

Pushes from producers wait for room in the replica's bounded input queue (the stage's
``queue`` bound, in records), one loop takes them in order and runs the fused operators
on each micro-batch exactly as the local runtime does (``Replica.run_chain``, timeouts and
retries through ``call_with_policy``, ``batch`` contracts in groups), then hands the
results to the consumer stages through credit-bounded ``Link``s. A push returns only
when its results are acknowledged downstream: that is the acknowledgement its producer
waits for before forgetting the batch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...observability import Histogram, StageMeter
from ...operators import OpRuntime
from ..local.stage import Replica, call_careful, call_collect
from .credits import Link, gather_acks
from .messages import PORT_CODE, BatchKey, InstallSpec, MeterReport


def snapshot(m: StageMeter) -> StageMeter:
    """A copy of a meter that its replica keeps updating."""
    c = StageMeter(m.stage, m.op, replicas=m.replicas, queue_bound=m.queue_bound,
                   fused_into=m.fused_into)
    for name in ("records_in", "records_out", "errors", "retries", "timeouts",
                 "max_queue_depth"):
        setattr(c, name, getattr(m, name))
    c.queue_wait.merge(m.queue_wait)
    c.service.merge(m.service)
    c.batch_size.merge(m.batch_size)
    return c


class StageInstance:
    """A stage replica on a host: bounded input queue, operator loop, output links.

    spec:    the stage, its routes and the run (see ``InstallSpec``).
    replica: which replica of the stage this is.
    outbox:  the host's outbox for this run (``deliver``/``fail`` for the driver).
    timeout_pool: the host's shared thread pool for calls under a ``timeout_ms``.
    node:    the Ray node id of the host (reported with the meters).
    """

    def __init__(self, spec: InstallSpec, replica: int, outbox: Any,
                 timeout_pool: Executor, node: str) -> None:
        s = spec.stage
        self.index = spec.index
        self.replica = replica
        self.incarnation = uuid.uuid4().hex[:12]
        self.node = node
        self.first = spec.first
        self.outbox = outbox
        ops = [o for o in s.ops if o.op.kind != "sink"]
        rts: list[OpRuntime] = [o.op.build(o.params, o.contract) for o in ops]
        self.rep = Replica(s, rts)
        self.meters: list[StageMeter] = self.rep.meters[:len(rts)]
        self.scheduling = Histogram()
        first, rt = s.ops[0], rts[0]
        self.op, self.rt = first, rt
        batch_spec = first.contract.batch
        self.collect = rt.kind == "collect" or batch_spec is not None
        max_n: int | None = rt.max_batch
        if self.collect:
            max_n = batch_spec.max_size if batch_spec else first.params["max_size"]
            if rt.max_batch is not None and batch_spec is None:
                max_n = min(max_n, rt.max_batch)
        self.max_n = max_n
        self.careful = (rt.is_async or first.contract.retries > 0
                        or first.contract.timeout_ms is not None)
        self.own_pool: ThreadPoolExecutor | None = None
        self.run_blocking: Callable | None = None
        if s.mode == "thread":
            pool: Executor = timeout_pool
            if first.contract.timeout_ms is None:  # one dedicated thread, as locally
                pool = self.own_pool = ThreadPoolExecutor(
                    1, thread_name_prefix=f"tailrace-{s.id}-{replica}")
            self.run_blocking = partial(asyncio.get_running_loop().run_in_executor, pool)
        self.links: dict[str | None, list[Link]] = {
            port: [Link(r, spec.run_id, outbox.deliver if r.sink else None, self._unsendable)
                   for r in routes]
            for port, routes in spec.routes.items()}
        self.bound = s.queue
        self.depth = 0
        self.max_depth = 0
        self.dirty = True
        self._q: deque = deque()  # (enqueued, born, key, records, done future)
        self._room: deque = deque()  # pushes waiting for room in the queue, FIFO
        self._streams: dict[int, list] = {}  # link -> [next seq, {seq: waiting turn}]
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._work())

    # -- input ----------------------------------------------------------------------------
    async def push(self, key: BatchKey, records: list, born: float,
                   order: tuple[int, int, int]) -> None:
        """Queue one micro-batch (waiting for room); returns once it is acked end to end.

        order: ``(link, seq, low)``: pushes of one producer link enter the queue in ``seq``
               order whatever order Ray delivers them in; ``low`` is the link's oldest
               unacknowledged seq (where a rebuilt replica starts).
        """
        link, seq, low = order
        stream = self._streams.get(link)
        if stream is None:
            stream = self._streams[link] = [low, {}]
        if seq > stream[0]:  # an earlier push of this link has not arrived yet
            turn = asyncio.get_running_loop().create_future()
            stream[1][seq] = turn
            await turn
        n = len(records)
        done = asyncio.get_running_loop().create_future()
        item = (n, born, key, records, done)
        if self._room or (self.depth + n > self.bound and self.depth > 0):
            self._room.append(item)
        else:
            self._enqueue(item)
        if seq >= stream[0]:  # our turn is taken: let the next seq of this link in
            stream[0] = seq + 1
            nxt = stream[1].pop(seq + 1, None)
            if nxt is not None and not nxt.done():
                nxt.set_result(None)
        await gather_acks(await done)

    def _enqueue(self, item: tuple) -> None:
        n, born, key, records, done = item
        self.depth += n
        if self.depth > self.max_depth:
            self.max_depth = self.depth
        self._q.append((perf_counter(), born, key, records, done))
        self._wake.set()

    def _admit(self) -> None:
        room = self._room
        while room and (self.depth + room[0][0] <= self.bound or self.depth == 0):
            self._enqueue(room.popleft())

    # -- the loop -------------------------------------------------------------------------
    async def _work(self) -> None:
        q = self._q
        while True:
            if not q:
                self._wake.clear()
                await self._wake.wait()
                continue
            enq, born, key, records, done = q.popleft()
            self.depth -= len(records)
            self._admit()
            if done.done():  # the pushing call was cancelled (run aborted)
                continue
            try:
                acks = await self._run(enq, born, key, records)
            except Exception as e:  # noqa: BLE001 - a runtime fault: fail this push
                done.set_exception(e)
            else:
                done.set_result(acks)
            self.dirty = True

    async def _run(self, enq: float, born: float, key: BatchKey, records: list) -> list:
        """Run one micro-batch in parts of at most ``max_n`` records (a batch contract's
        size, an engine's batch), handing each part's results on as soon as it is done."""
        now = perf_counter()
        n = len(records)
        self.meters[0].queue_wait.record((now - enq) * 1e6, n)
        if self.first:
            self.scheduling.record((time.time() - born) * 1e6, n)
        step = self.max_n or n or 1
        acks: list = []
        for part_no, i in enumerate(range(0, n, step)):
            errors: list[ErrorRecord] = []
            ports = await self._process(records[i:i + step], errors)
            if errors:
                acks.append(self.outbox.fail(self.index, key + (part_no,), errors))
            for port, recs in ports.items():
                if recs:
                    links = self.links.get(port)
                    if links:
                        out_key = key + (self.index, PORT_CODE[port] + 3 * part_no)
                        for link in links:
                            await link.send(out_key, recs, born, acks)
        return acks

    async def _process(self, batch: list, errors: list) -> dict[str | None, list]:
        if self.collect:
            return {None: await call_collect(self.op, self.rt, self.meters[0], batch,
                                             self.run_blocking, errors)}
        if self.careful:
            return await call_careful(self.op, self.rt, self.meters[0], batch,
                                      self.run_blocking, errors)
        return await self._chain(batch, errors)

    async def _chain(self, batch: list, errors: list) -> dict[str | None, list]:
        if self.run_blocking is not None:
            return await self.run_blocking(self.rep.run_chain, batch, errors)
        return self.rep.run_chain(batch, errors)

    def _unsendable(self, key: BatchKey, records: list, exc: BaseException) -> asyncio.Future:
        """Records that cannot be serialised for the next stage become error records here."""
        sid = self.rep.ops[len(self.meters) - 1].id
        errs = [ErrorRecord.from_exception(sid, x, TypeError(
            f"record cannot be sent to the next Ray actor: {exc}")) for x in records]
        return self.outbox.fail(self.index, key, errs)

    # -- reporting and shutdown -----------------------------------------------------------
    def report(self) -> MeterReport:
        """A snapshot of this replica's meters (copied: the loop keeps counting)."""
        meters = [snapshot(m) for m in self.meters]
        meters[0].max_queue_depth = self.max_depth
        sink_depth = {link.route.target: link.window.max_used
                      for links in self.links.values() for link in links if link.route.sink}
        sched = Histogram()
        sched.merge(self.scheduling)
        return MeterReport(self.index, self.replica, self.incarnation, self.node, meters,
                           self.max_depth, sched, sink_depth)

    def close(self) -> None:
        """Stop the loop, fail waiting pushes, release the replica's thread."""
        self._task.cancel()
        for item in list(self._room) + list(self._q):
            if not item[4].done():
                item[4].cancel()
        for stream in self._streams.values():
            for turn in stream[1].values():
                turn.cancel()
        if self.own_pool is not None:
            self.own_pool.shutdown(wait=False)
