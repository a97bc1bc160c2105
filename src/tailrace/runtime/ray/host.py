"""``StageHost``: the Ray actor that runs stage replicas, and its outbox to the driver.

A host is an asyncio actor running stage replicas (``HostedWorker``s) of one run or
several, reused across runs (a few calls instead of an actor start, ~1 s, per stage).
What the driver's sinks and ledger need goes to the run's ``Outbox``, drained by the
driver's long-polling ``drain`` calls, which also acknowledge it. A restarted actor
knows no replicas and answers ``NEED_INSTALL``: producers reinstall and replay. A served
run's requests get live parts of this host (``served.py``).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time
from collections import deque
from dataclasses import replace
from functools import cache
from typing import Any

from .credits import encode, picklable
from .instance import HostedWorker
from .messages import (
    NEED_INSTALL,
    PUSH_OK,
    RUN_CLOSED,
    BatchKey,
    Commit,
    Delivery,
    Drained,
    Failures,
    Installed,
    InstallSpec,
    InstanceKey,
    Lineage,
    Pieces,
    Unsendable,
)
from .served import HostRequests

#: Seconds between meter snapshots sent to the driver (what survives an actor crash).
FLUSH_S = 0.2
#: Concurrent calls one host accepts (pushes wait inside it for room in their queue).
MAX_CONCURRENCY = 10_000


class Entries:
    """A run's outbox to the driver as its stage replicas see it: each call makes one
    entry (``put``) and returns the driver's acknowledgement of it."""

    #: elastic consumer stage -> (hosts, specs, active) of its replicas (``reroute``)
    reroutes: dict[int, tuple]

    def put(self, entry: Any) -> asyncio.Future:
        raise NotImplementedError

    def deliver(self, target: int, key: BatchKey, records: list, lin: Lineage,
                born: float) -> asyncio.Future:
        """Records for the sink of stage ``target``."""
        return self.put(Delivery(target, key, records, lin, born, time.time()))

    def fail(self, stage: int, key: BatchKey, errors: list, lin: Lineage) -> asyncio.Future:
        """Error records of stage ``stage`` on route ``key``."""
        return self.put(Failures(stage, key, errors, lin))

    def commit(self, stage: int, key: BatchKey, token: int, parents: Lineage) -> asyncio.Future:
        """A fan-out stage's execution of a push is complete."""
        return self.put(Commit(stage, key, token, parents))


class Outbox(Entries):
    """One run's entries for the driver on one host, acknowledged by sequence number."""

    def __init__(self) -> None:
        self.entries: list = []
        self.seq = 0
        self.pending: deque = deque()  # (seq, future) awaiting the driver's ack
        self.wake = asyncio.Event()
        self.closed = False
        self.instances: dict[tuple[int, int], HostedWorker] = {}
        self.requests: HostRequests | None = None  # a served run's (first install)
        # streamed pieces not yet drained: request key -> (first's position, pieces)
        self.pieces: dict[Any, tuple[int, list[str]]] = {}
        self.reroutes = {}
        self.flusher = asyncio.ensure_future(self._flush())

    def put(self, entry: Any) -> asyncio.Future:
        self.seq += 1
        self.entries.append(entry)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((self.seq, fut))
        self.wake.set()
        return fut

    def piece(self, rid: Any, piece: str, at: int = 1) -> None:
        """A streamed text piece of request ``rid`` for the driver (on the loop); ``at``:
        its position in the record's stream."""
        got = self.pieces.get(rid)
        if got is None:
            self.pieces[rid] = (at, [piece])
        else:
            got[1].append(piece)
        self.wake.set()

    def ack(self, upto: int) -> None:
        p = self.pending
        while p and p[0][0] <= upto:
            _, fut = p.popleft()
            if not fut.done():
                fut.set_result(None)

    async def take(self) -> list:
        while not self.entries and not self.pieces and not self.closed:
            self.wake.clear()
            await self.wake.wait()
        out, self.entries = self.entries, []
        if self.pieces:  # before the entries: a record's pieces precede its output
            out.insert(0, Pieces(self.pieces))
            self.pieces = {}
        return out

    async def _flush(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            self.report()

    def report(self) -> None:
        """Queue a meter snapshot of every replica that did something since the last one."""
        for inst in self.instances.values():
            if inst.dirty:
                inst.dirty = False
                self.seq += 1
                self.entries.append(inst.report())
        if self.entries:
            self.wake.set()

    def close(self) -> list:
        """Stop every replica of the run here; returns their final meter snapshots."""
        self.flusher.cancel()
        reports = [inst.report() for inst in self.instances.values()]
        for inst in self.instances.values():
            inst.close()
        self.instances.clear()
        for _, fut in self.pending:
            if not fut.done():
                fut.cancel()
        self.closed = True
        self.wake.set()
        return reports


def open_shared_engine(spec: dict) -> Any:
    """A host's engine opener (``BuildContext.open_engine``): stages share the cluster's
    engine actors, a handle on the one named by the linked spec (``engines.py``)."""
    from .engines import open_cluster_engine

    return open_cluster_engine(spec.get("_name") or "engine", spec)


class StageHost:
    """A Ray actor hosting stage replicas of any number of runs (see the module doc)."""

    def __init__(self) -> None:
        import uuid

        import ray

        self.incarnation = uuid.uuid4().hex[:12]
        self.node = ray.get_runtime_context().get_node_id()
        self.runs: dict[str, Outbox] = {}
        self.finished: deque = deque(maxlen=4096)

    def _outbox(self, run_id: str) -> Outbox | None:
        box = self.runs.get(run_id)
        if box is None and run_id not in self.finished:
            box = self.runs[run_id] = Outbox()
        return box

    async def install(self, holder: list, replica: int) -> Installed:
        """Build replica ``replica`` of the stage in ``holder[0]`` (idempotent)."""
        spec: InstallSpec = holder[0]
        if not isinstance(spec, InstallSpec):
            spec = await holder[0]  # an ObjectRef (reinstall by a producer)
        box = self._outbox(spec.run_id)
        if box is not None and (spec.index, replica) not in box.instances:
            if spec.served and box.requests is None:
                box.requests = HostRequests(box.piece)
            os.environ.update(spec.env)
            for p in spec.sys_path:
                if p not in sys.path:
                    sys.path.append(p)
            box.instances[(spec.index, replica)] = HostedWorker(
                spec, replica, box, self.node, open_shared_engine)
        inst = box.instances.get((spec.index, replica)) if box is not None else None
        return Installed(self.incarnation, self.node, os.getpid(),
                         inst.incarnation if inst is not None else "")

    async def push(self, msg: bytes) -> int:
        """One micro-batch for a stage replica; returns once acknowledged end to end.

        msg: pickled ``(instance key, route, records, lineage ids, born, order)``;
             ``order`` is ``(link, seq, prev, low)`` of the producer's link (see
             ``HostedWorker.push``).
        """
        key: InstanceKey
        batch_key: BatchKey
        key, batch_key, records, lin, born, order = pickle.loads(msg)
        box = self.runs.get(key[0])
        if box is None:
            return RUN_CLOSED if key[0] in self.finished else NEED_INSTALL
        inst = box.instances.get((key[1], key[2]))
        if inst is None:
            return NEED_INSTALL
        if box.requests is not None:
            box.requests.bind(records)
        await inst.push(batch_key, records, lin, born, order)
        return PUSH_OK

    async def drain(self, run_id: str, ack: int, incarnation: str) -> bytes:
        """Acknowledge entries up to ``ack`` (if ``incarnation`` is ours: a restarted host
        has new sequence numbers); wait for new ones or the run's end; a pickled
        ``Drained``."""
        box = self._outbox(run_id)
        if box is None:
            return pack(Drained(self.incarnation, 0, [], True))
        if incarnation == self.incarnation:
            box.ack(ack)
        entries = await box.take()
        return pack(Drained(self.incarnation, box.seq, entries, box.closed))

    async def cancel(self, run_id: str, rids: list) -> None:
        """The callers of requests ``rids`` of a served run gave up: set their records'
        requests' cancel flags here (a generation stops at its next token)."""
        box = self.runs.get(run_id)
        if box is not None and box.requests is not None:
            box.requests.cancel(rids)

    async def reroute(self, run_id: str, target: int, hosts: tuple, specs: tuple,
                      active: tuple[bool, ...]) -> None:
        """Elastic stage ``target`` of the run scaled: the links to it of every replica
        here (and of replicas installed later, e.g. after this actor restarted) use
        ``hosts``/``specs`` and push only to the ``active`` ones (``Link.reroute``)."""
        box = self._outbox(run_id)
        if box is None:
            return
        box.reroutes[target] = (hosts, specs, active)
        for inst in box.instances.values():
            inst.reroute(target, hosts, specs, active)

    async def finish(self, run_id: str) -> list:
        """End the run here: stop its replicas, return their final meter snapshots."""
        self.finished.append(run_id)
        box = self.runs.pop(run_id, None)
        return box.close() if box is not None else []


def pack(d: Drained) -> bytes:
    """Pickle a drain answer; records that cannot be pickled become ``Unsendable`` (sink
    records) or their ``repr`` (inputs of error records), never a failed drain."""
    try:
        return encode(d)
    except Exception:  # noqa: BLE001 - find the records that cannot be sent
        pass
    entries: list = []
    for e in d.entries:
        if type(e) is Delivery:
            ok = [picklable(x) for x in e.records]
            good = [j for j, g in enumerate(ok) if g]
            bad = [j for j, g in enumerate(ok) if not g]
            if good:
                entries.append(e._replace(records=[e.records[j] for j in good],
                                          lineage=[e.lineage[j] for j in good]))
            if bad:
                entries.append(Unsendable(e.target, e.key, [repr(e.records[j]) for j in bad],
                                          [e.lineage[j] for j in bad],
                                          "record cannot be sent back to the driver"))
        elif type(e) is Failures:
            entries.append(e._replace(errors=[
                err if picklable(err) else replace(err, input=repr(err.input))
                for err in e.errors]))
        else:
            entries.append(e)
    return encode(d._replace(entries=entries))


@cache
def actor_class() -> Any:
    """``StageHost`` as a Ray actor class (Ray is imported only when this is called)."""
    import ray

    return ray.remote(StageHost)
