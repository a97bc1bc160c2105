"""One replica of one stage inside a ``StageHost`` actor: its input queue and its loop.

Pushes from producers wait for room in the replica's bounded input queue (the stage's
``queue`` bound, in records), one loop takes them in order and runs the fused operators
on each micro-batch with the local runtime's batch functions and meters (the fused chain,
timeouts and retries through ``call_careful``, ``batch`` contracts in groups), tracking
which input each output and error came from (``lineage.py``), then hands the results to
the consumer stages through credit-bounded ``Link``s. A push returns only when its
results are acknowledged downstream: that is the acknowledgement its producer waits for
before forgetting the batch. A fan-out stage (a ``flat_map``) then also commits the push
to the driver, whose ledger delivers one complete execution per input (``ledger.py``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...observability import Histogram, StageMeter
from ...operators import OpRuntime
from ..local.stage import ABANDON_CAP, Replica
from .credits import Link, gather_acks
from .lineage import ids, is_fan_out, run_careful, run_chain, run_collect
from .messages import BatchKey, InstallSpec, Lineage, MeterReport


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
    node:    the Ray node id of the host (reported with the meters).
    """

    def __init__(self, spec: InstallSpec, replica: int, outbox: Any,
                 node: str) -> None:
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
        self.fans = tuple(is_fan_out(o.op.name) for o in ops)
        self.fan = any(self.fans)
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
        if s.mode == "thread":  # as locally: one dedicated thread, plus, under a timeout,
            # spare ones for up to ABANDON_CAP abandoned calls (never the host's threads)
            n = 1 + (ABANDON_CAP if first.contract.timeout_ms is not None else 0)
            pool = self.own_pool = ThreadPoolExecutor(
                n, thread_name_prefix=f"tailrace-{s.id}-{replica}")
            self.run_blocking = partial(asyncio.get_running_loop().run_in_executor, pool)
        self.links: dict[str | None, list[Link]] = {
            port: [Link(r, spec.run_id, outbox.deliver if r.sink else None, self._unsendable)
                   for r in routes]
            for port, routes in spec.routes.items()}
        self.bound = s.queue
        self.depth = 0
        self.max_depth = 0
        self.dirty = True
        self._q: deque = deque()  # (enqueued, born, key, records, lineage, done future)
        self._room: deque = deque()  # pushes waiting for room in the queue, FIFO
        self._streams: dict[int, list] = {}  # link -> [next seq, {seq: waiting turn}]
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._work())

    # -- input ----------------------------------------------------------------------------
    async def push(self, key: BatchKey, records: list, lin: Lineage, born: float,
                   order: tuple[int, int, int]) -> None:
        """Queue one micro-batch (waiting for room); returns once it is acked end to end
        (and, on a fan-out stage, committed).

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
        item = (n, born, key, records, lin, done)
        if self._room or (self.depth + n > self.bound and self.depth > 0):
            self._room.append(item)
        else:
            self._enqueue(item)
        if seq >= stream[0]:  # our turn is taken: let the next seq of this link in
            stream[0] = seq + 1
            nxt = stream[1].pop(seq + 1, None)
            if nxt is not None and not nxt.done():
                nxt.set_result(None)
        acks, commit = await done
        await gather_acks(acks)
        if commit is not None:
            await self.outbox.commit(*commit)

    def _enqueue(self, item: tuple) -> None:
        n, born, key, records, lin, done = item
        self.depth += n
        if self.depth > self.max_depth:
            self.max_depth = self.depth
        self._q.append((perf_counter(), born, key, records, lin, done))
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
            enq, born, key, records, lin, done = q.popleft()
            self.depth -= len(records)
            self._admit()
            if done.done():  # the pushing call was cancelled (run aborted)
                continue
            try:
                result = await self._run(enq, born, key, records, lin)
            except Exception as e:  # noqa: BLE001 - a runtime fault: fail this push
                done.set_exception(e)
            else:
                done.set_result(result)
            self.dirty = True

    async def _run(self, enq: float, born: float, key: BatchKey, records: list,
                   lin: Lineage) -> tuple[list, tuple | None]:
        """Run one micro-batch in parts of at most ``max_n`` records (a batch contract's
        size, an engine's batch), handing each part's results on as soon as it is done.
        Returns the acks to wait for and, if the push fanned out, its commit."""
        now = perf_counter()
        n = len(records)
        self.meters[0].queue_wait.record((now - enq) * 1e6, n)
        if self.first:
            self.scheduling.record((time.time() - born) * 1e6, n)
        step = self.max_n or n or 1
        acks: list = []
        token: int | None = None
        fanned_ids: list = []
        fan_key = key
        for i in range(0, n, step):
            part = records if step >= n else records[i:i + step]
            part_ids = lin if step >= n else lin[i:i + step]
            errors: list[ErrorRecord] = []
            esrc: list[int] = []
            ports, fanned = await self._process(part, errors, esrc)
            fan = self.fan or fanned
            out_key = key
            if fan:  # outputs are (parent, ordinal), delivered once this push commits
                if token is None:
                    token = random.getrandbits(62)
                    fan_key = key + ((self.index, token),)
                out_key = fan_key
                fanned_ids.extend(part_ids)
            if errors:
                acks.append(self.outbox.fail(self.index, out_key, errors,
                                             ids(part_ids, esrc, fan, errors=True)))
            counts: dict[int, int] = {}  # ordinals per input, across ports
            for port, (recs, src) in ports.items():
                if recs:
                    links = self.links.get(port)
                    if links:
                        out_ids = ids(part_ids, src, fan, counts=counts)
                        if len(links) == 1:
                            await links[0].send(out_key, recs, out_ids, born, acks)
                            continue
                        for link in links:  # each consumer gets a copy: a hop of its own
                            await link.send(out_key + (link.route.target,), recs, out_ids,
                                            born, acks)
        if token is None:
            return acks, None
        return acks, (self.index, key, token, fanned_ids)

    async def _process(self, batch: list, errors: list,
                       esrc: list) -> tuple[dict[str | None, tuple[list, Any]], bool]:
        if self.collect:
            return await run_collect(self.op, self.rt, self.meters[0], batch,
                                     self.run_blocking, errors, esrc)
        if self.careful:
            return await run_careful(self.op, self.rt, self.meters[0], batch,
                                     self.run_blocking, errors, esrc)
        if self.run_blocking is not None:
            return await self.run_blocking(self._chain, batch, errors, esrc)
        return run_chain(self.rep, self.fans, batch, errors, esrc)

    def _chain(self, batch: list, errors: list,
               esrc: list) -> tuple[dict[str | None, tuple[list, Any]], bool]:
        return run_chain(self.rep, self.fans, batch, errors, esrc)

    def _unsendable(self, key: BatchKey, records: list, lin: Lineage,
                    exc: BaseException) -> asyncio.Future:
        """Records that cannot be serialised for the next stage become error records here."""
        sid = self.rep.ops[len(self.meters) - 1].id
        errs = [ErrorRecord.from_exception(sid, x, TypeError(
            f"record cannot be sent to the next Ray actor: {exc}")) for x in records]
        return self.outbox.fail(self.index, key, errs, lin)

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
            if not item[-1].done():
                item[-1].cancel()
        for stream in self._streams.values():
            for turn in stream[1].values():
                turn.cancel()
        if self.own_pool is not None:
            self.own_pool.shutdown(wait=False)
