"""One replica of one stage inside a ``StageHost`` actor: its input queue and its loop.

Pushes wait for room in the replica's bounded input queue (the stage's ``queue``, in
records); one loop runs the fused operators on each micro-batch with a ``StageWorker``
(the same call as locally; one per call in flight, ``Execution.in_flight``), tracing
lineage (``lineage.Trace``), and hands the results on through credit-bounded ``Link``s.
A push returns only when its results are acknowledged downstream; a fan-out stage then
also commits it to the driver's ledger (``ledger.py``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

from ...api.records import ErrorRecord
from ...observability import Histogram, StageMeter
from ...operators import BuildContext, OpRuntime
from ..lineage import Trace, ids
from ..stage import StageWorker
from ..stats import sum_counters
from .credits import Link, gather_acks, send_all
from .messages import BatchKey, InstallSpec, Lineage, MeterReport


class Stream:
    """The order in which one producer link's pushes enter a replica's queue.

    Ray may deliver an async actor's calls in any order, so each push names ``prev``, the
    link's newest earlier push that was unacknowledged when it was sent, and enters only
    after it. Seqs are not contiguous here: a replica rebuilt after its actor restarted
    gets only the pushes its producer still holds, and pushes in between may have been
    acknowledged before the crash (e.g. a filter dropped all their records, so nothing
    downstream had to acknowledge them) and never come again. Every seq below a push's
    ``low`` is done as well. Memory: the seqs entered out of order above ``low``.

    low: the first push's ``low`` (seqs below it entered before this replica existed).
    """

    __slots__ = ("low", "above", "waiting")

    def __init__(self, low: int) -> None:
        self.low = low  # every seq below it has entered (or never will)
        self.above: set[int] = set()  # seqs >= low that entered
        self.waiting: dict[int, list[asyncio.Future]] = {}  # seq -> pushes waiting for it

    def entered(self, seq: int) -> bool:
        """Has push ``seq`` entered the queue, or will it never come (-1: no push)?"""
        return seq < self.low or seq in self.above

    async def turn(self, prev: int) -> None:
        """Wait until push ``prev`` has entered (or is known done)."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(prev, []).append(fut)
        await fut

    def enter(self, seq: int) -> None:
        """Push ``seq`` has entered the queue: wake the pushes that wait for it."""
        if seq == self.low and not self.above:  # in order: the common case
            self.low = seq + 1
        elif seq >= self.low:
            self.above.add(seq)
            self._collapse()
        self._wake(seq)

    def forget_below(self, low: int) -> None:
        """The producer says every push below ``low`` is acknowledged: none of them
        will come, wake whoever waits for one."""
        if low <= self.low:
            return
        self.low = low
        if self.above:
            self.above = {s for s in self.above if s >= low}
            self._collapse()
        for s in [s for s in self.waiting if s < low]:
            self._wake(s)

    def _collapse(self) -> None:
        above = self.above
        while self.low in above:
            above.discard(self.low)
            self.low += 1

    def _wake(self, seq: int) -> None:
        if not self.waiting:
            return
        for fut in self.waiting.pop(seq, ()):
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        """The run ends: cancel the pushes still waiting for their turn."""
        for futs in self.waiting.values():
            for fut in futs:
                fut.cancel()
        self.waiting.clear()


class HostedWorker:
    """A stage replica on a host: bounded input queue, operator loop, output links.

    ``spec`` names the stage, its routes and the run; ``outbox`` is the host's for the run
    (the driver's for a stage in the driver); ``node`` is reported with the meters.
    """

    def __init__(self, spec: InstallSpec, replica: int, outbox: Any, node: str,
                 open_engine: Callable[[dict], Any]) -> None:
        s = spec.stage
        self.index = spec.index
        self.replica = replica
        self.incarnation = uuid.uuid4().hex[:12]
        self.node = node
        self.first = spec.first
        self.outbox = outbox
        ops = [o for o in s.ops if o.op.kind != "sink"]  # the driver runs sinks
        # a worker per call in flight (``Execution.in_flight``), own threads and meters
        self.workers: list[StageWorker] = []
        for j in range(s.execution.in_flight):  # type: ignore[union-attr]
            rts: list[OpRuntime] = [o.op.build(o.params, BuildContext(o.contract, open_engine))
                                    for o in ops]
            w = StageWorker(s, rts)
            w.start(f"{s.id}-{replica}-{j}")  # its own threads, never the host's
            self.workers.append(w)
        self.n_meters = len(rts)
        self.fan = any(w.fans)
        self.scheduling = Histogram()
        self.max_n = w.execution.max_batch
        self._free: asyncio.Queue = asyncio.Queue()  # the workers free to take a part
        for w in self.workers:
            self._free.put_nowait(w)
        self._running: set[asyncio.Future] = set()  # pushes being run, when several may be
        self.links: dict[str | None, list[Link]] = {
            port: [Link(r, spec.run_id, outbox.deliver if r.sink else None, self._unsendable)
                   for r in routes]
            for port, routes in spec.routes.items()}
        for target, (hosts, specs, active) in outbox.reroutes.items():
            self.reroute(target, hosts, specs, active)
        self.bound = s.queue
        self.depth = 0
        self.max_depth = 0
        self.dirty = True
        self.busy = 0  # pushes in the operators now
        self._q: deque = deque()  # (enqueued, born, key, records, lineage, done future)
        self._room: deque = deque()  # pushes waiting for room in the queue, FIFO
        self._streams: dict[int, Stream] = {}  # producer link -> its pushes' order
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._work())

    # -- input ----------------------------------------------------------------------------
    async def push(self, key: BatchKey, records: list, lin: Lineage, born: float,
                   order: tuple[int, int, int, int]) -> None:
        """Queue one micro-batch (waiting for room); returns once it is acked end to end
        (and, on a fan-out stage, committed). ``order``: ``(link, seq, prev, low)`` of the
        producer's link: this push enters after push ``prev`` (-1: none); every seq below
        ``low`` is done (``Stream``)."""
        link, seq, prev, low = order
        stream = self._streams.get(link)
        if stream is None:
            stream = self._streams[link] = Stream(low)
        else:
            stream.forget_below(low)
        if not stream.entered(prev):  # an earlier push of this link has not arrived yet
            await stream.turn(prev)
        n = len(records)
        done = asyncio.get_running_loop().create_future()
        item = (n, born, key, records, lin, done)
        if self._room or (self.depth + n > self.bound and self.depth > 0):
            self._room.append(item)
        else:
            self._enqueue(item)
        stream.enter(seq)  # our turn is taken: let the push that waits for us in
        acks, commit = await done
        await gather_acks(acks)
        if commit is not None:
            await self.outbox.commit(*commit)

    def _enqueue(self, item: tuple) -> None:
        n, born, key, records, lin, done = item
        self.depth += n
        self.dirty = True
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
            worker = await self._free.get()  # a push leaves the queue when a worker is free
            enq, born, key, records, lin, done = q.popleft()
            self.depth -= len(records)
            self._admit()
            if done.done():  # the pushing call was cancelled (run aborted)
                self._free.put_nowait(worker)
                continue
            if len(self.workers) == 1:
                await self._finish(enq, born, key, records, lin, done, worker)
            else:  # several workers: the next push may start while this one runs
                task = asyncio.ensure_future(
                    self._finish(enq, born, key, records, lin, done, worker))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _finish(self, enq: float, born: float, key: BatchKey, records: list,
                      lin: Lineage, done: asyncio.Future, worker: StageWorker) -> None:
        self.busy += 1
        self.dirty = True
        try:
            result = await self._run(enq, born, key, records, lin, worker)
        except Exception as e:  # noqa: BLE001 - a runtime fault: fail this push
            if not done.done():
                done.set_exception(e)
        else:
            if not done.done():
                done.set_result(result)
        finally:
            self.busy -= 1
            self.dirty = True

    async def _run(self, enq: float, born: float, key: BatchKey, records: list,
                   lin: Lineage, worker: StageWorker) -> tuple[list, tuple | None]:
        """Run one micro-batch in parts of at most ``max_n`` records (a batch contract's
        size, an engine's batch), handing each part's results on as soon as it is done;
        ``worker``: the worker taken for it, given back here. With several workers its parts
        run at once, each in a free one. Returns the acks to wait for and, if the push
        fanned out, its commit."""
        now = perf_counter()
        n = len(records)
        worker.meters[0].queue_wait.record((now - enq) * 1e6, n)
        if self.first:
            self.scheduling.record((time.time() - born) * 1e6, n)
        step = self.max_n or n or 1
        acks: list = []
        fanned: list = [None, key, []]  # [token, key of the outputs, fanned input ids]
        parts = [(records[i:i + step], lin[i:i + step]) for i in range(0, n, step)] \
            if step < n else [(records, lin)] if n else []

        async def run_in(w: StageWorker, recs: list, part_ids: Lineage) -> None:
            try:
                await self._part(w, recs, part_ids, key, born, acks, fanned)
            finally:
                self._free.put_nowait(w)

        if len(self.workers) == 1 or len(parts) <= 1:
            try:
                for recs, part_ids in parts:
                    await self._part(worker, recs, part_ids, key, born, acks, fanned)
            finally:
                self._free.put_nowait(worker)
        else:
            tasks = []
            for j, (recs, part_ids) in enumerate(parts):
                w = worker if j == 0 else await self._free.get()
                tasks.append(asyncio.ensure_future(run_in(w, recs, part_ids)))
            await asyncio.gather(*tasks)
        token, _, fanned_ids = fanned
        if token is None:
            return acks, None
        return acks, (self.index, key, token, fanned_ids)

    async def _part(self, w: StageWorker, part: list, part_ids: Lineage, key: BatchKey,
                    born: float, acks: list, fanned: list) -> None:
        """One part of a push through ``w``: its error records to the driver, its outputs
        to the consumer stages (their acks into ``acks``). ``fanned``: the push's fan-out
        token, output key and fanned input ids, shared by its parts."""
        errors: list[ErrorRecord] = []
        trace = Trace()
        ports = await w.process(part, errors, trace)
        fan = self.fan or trace.fanned
        out_key = key
        if fan:  # outputs are (parent, ordinal), delivered once this push commits
            if fanned[0] is None:
                fanned[0] = random.getrandbits(62)
                fanned[1] = key + ((self.index, fanned[0]),)
            out_key = fanned[1]
            fanned[2].extend(part_ids)
        if errors:
            acks.append(self.outbox.fail(self.index, out_key, errors,
                                         ids(part_ids, trace.esrc, fan, errors=True)))
        counts: dict[int, int] = {}  # ordinals per input, across ports
        for port, recs in ports.items():
            links = self.links.get(port)
            if recs and links:
                await send_all(links, out_key, recs,
                               ids(part_ids, trace.src.get(port), fan, counts=counts),
                               born, acks)

    def reroute(self, target: int, hosts: tuple, specs: tuple,
                active: tuple[bool, ...]) -> None:
        """Elastic stage ``target`` scaled: update this replica's links to it."""
        for links in self.links.values():
            for link in links:
                if link.route.target == target and not link.route.sink:
                    link.reroute(hosts, specs, active)

    def _unsendable(self, key: BatchKey, records: list, lin: Lineage,
                    exc: BaseException) -> asyncio.Future:
        """Records that cannot be serialised for the next stage become error records here."""
        sid = self.workers[0].ops[self.n_meters - 1].id
        errs = [ErrorRecord.from_exception(sid, x, TypeError(
            f"record cannot be sent to the next Ray actor: {exc}")) for x in records]
        return self.outbox.fail(self.index, key, errs, lin)

    # -- reporting and shutdown -----------------------------------------------------------
    def report(self) -> MeterReport:
        """A snapshot of this replica's meters (copied: the loop keeps counting)."""
        meters = [StageMeter.combined([w.meters[j] for w in self.workers])
                  for j in range(self.n_meters)]
        meters[0].max_queue_depth = self.max_depth
        sink_depth = {link.route.target: link.window.max_used
                      for links in self.links.values() for link in links if link.route.sink}
        sched = Histogram()
        sched.merge(self.scheduling)
        counters = tuple(sum_counters([c() for w in self.workers
                                       if (c := w.rts[j].counters) is not None])
                         for j in range(self.n_meters))
        return MeterReport(self.index, self.replica, self.incarnation, self.node, meters,
                           self.max_depth, sched, sink_depth,
                           self.depth + sum(item[0] for item in self._room), self.busy > 0,
                           any(link.window.waiting for links in self.links.values()
                               for link in links), counters)

    def close(self) -> None:
        """Stop the loop, fail waiting pushes, release the replica's thread."""
        self._task.cancel()
        for task in list(self._running):
            task.cancel()
        for item in list(self._room) + list(self._q):
            if not item[-1].done():
                item[-1].cancel()
        for stream in self._streams.values():
            stream.close()
        for w in self.workers:
            w.stop(wait=False)
