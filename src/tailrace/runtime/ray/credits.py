"""Credit-based flow control on one edge, and at-least-once delivery across actors.

A producer (the driver's source or a stage replica) holds one ``Link`` per consumer
stage. The link's ``CreditWindow`` is the edge's bound in records: a push takes credits
for its records and gives them back only when the consumer acknowledges the batch *end
to end* (processed, and everything it produced acknowledged downstream, up to the
driver's sinks). A slow stage therefore stops its producers, theirs, and finally the
source: nothing piles up in the object store. Until that acknowledgement the producer
keeps the batch, so when the consumer's actor dies it pushes it again to the restarted
actor (reinstalling the stage there first); the driver drops the duplicates by lineage
(the records' lineage ids travel with them, chunked alike).
"""

from __future__ import annotations

import asyncio
import pickle
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ...errors import TailraceError
from .messages import NEED_INSTALL, BatchKey, Lineage, Route

#: How long a producer keeps retrying a consumer whose actor died before giving up.
RESTART_TIMEOUT_S = 120.0


class StageLost(TailraceError):
    """A stage replica's actor died and did not come back within ``RESTART_TIMEOUT_S``
    (the peer broke: e.g. its node left the cluster)."""


class CreditWindow:
    """Records a producer may have in flight on one edge (``size``, the edge's bound,
    >= 1); ``take`` waits when it is full, waiters served FIFO."""

    __slots__ = ("size", "used", "max_used", "_waiters")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"credit window must be >= 1 record, got {size}")
        self.size = size
        self.used = 0
        self.max_used = 0  # most records ever in flight at once (the edge's peak depth)
        self._waiters: deque = deque()

    @property
    def waiting(self) -> bool:
        """Someone waits for credits (the consumer is behind)."""
        return bool(self._waiters)

    def take_nowait(self, n: int) -> bool:
        """Take ``n`` credits if they are free and nobody waits before us."""
        if self._waiters or self.used + n > self.size:
            return False
        self.used += n
        if self.used > self.max_used:
            self.max_used = self.used
        return True

    async def take(self, n: int) -> None:
        """Take ``n`` credits (``n`` <= size), waiting for acknowledgements to free them."""
        if self.take_nowait(n):
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.give(n)  # granted while we were cancelled: hand it on
            else:
                self._waiters.remove((n, fut))
            raise

    def give(self, n: int) -> None:
        """Return ``n`` credits (a batch was acknowledged) and wake waiters that fit."""
        self.used -= n
        w = self._waiters
        while w and self.used + w[0][0] <= self.size:
            m, fut = w.popleft()
            if not fut.done():
                self.used += m
                self.max_used = max(self.max_used, self.used)
                fut.set_result(None)


def ray_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the actor is gone or restarting": retry after a pause."""
    import ray.exceptions as rex

    return (rex.RayActorError,)


def cause(e: BaseException) -> BaseException:
    """The original exception inside (nested) ``RayTaskError``s (``e`` itself otherwise)."""
    while True:
        inner = getattr(e, "cause", None)
        if not isinstance(inner, BaseException) or inner is e:
            return e
        e = inner


class Link:
    """One producer's edge to a consumer stage: chunks, credits, replica choice, replay.

    route:       the edge (consumer, its replicas' hosts and specs, window, chunk size).
    run_id:      the run, to address the consumer's replicas.
    deliver:     for a sink edge, ``deliver(target, key, records, lineage, born)`` hands
                 records to the driver (an outbox entry on a host); returns the ack.
    unsendable:  ``unsendable(key, records, lineage, exc)``: records that cannot be
                 serialised; returns a future to wait for, or None.
    """

    def __init__(self, route: Route, run_id: str,
                 deliver: Callable[[int, BatchKey, list, Lineage, float],
                                   asyncio.Future] | None,
                 unsendable: Callable[[BatchKey, list, Lineage, BaseException],
                                      asyncio.Future | None]) -> None:
        self.route = route
        self.run_id = run_id
        self.window = CreditWindow(route.window)
        self.chunk = route.chunk
        self.hosts = list(route.hosts)  # grows when an elastic consumer scales out
        self.specs = list(route.specs)
        self.keys = [(run_id, route.target, r) for r in range(len(route.hosts))]
        self.outstanding = [0] * len(route.hosts)
        self.link_id = random.getrandbits(62)
        self.seqs = [0] * len(route.hosts)  # next push seq, per consumer replica
        self.unacked: list[dict[int, None]] = [{} for _ in route.hosts]  # in seq order
        self.active: list[bool] | None = None  # None: every replica takes new pushes
        self._next = 0
        self._deliver = deliver
        self._unsendable = unsendable
        self._retry = ray_errors() if not route.sink else ()

    async def send(self, key: BatchKey, records: list, lin: Lineage, born: float,
                   acks: list) -> None:
        """Push ``records`` (lineage ids ``lin``) on route ``key`` in chunks, waiting for
        credits; each push is submitted at once (in order) and its acknowledgement
        appended to ``acks``."""
        chunk = self.chunk
        window = self.window
        whole = len(records) <= chunk
        for i in range(0, len(records), chunk):
            part = records if whole else records[i:i + chunk]
            ids = lin if whole else lin[i:i + chunk]
            n = len(part)
            if not window.take_nowait(n):
                await window.take(n)
            if self.route.sink:
                assert self._deliver is not None
                fut = self._deliver(self.route.target, key, part, ids, born)
                fut.add_done_callback(lambda _done, n=n: window.give(n))  # type: ignore[misc]
                acks.append(fut)
                continue
            r = self._pick()
            seq = self.seqs[r]
            unacked = self.unacked[r]
            order = ((self.link_id, seq, next(reversed(unacked)), next(iter(unacked)))
                     if unacked else (self.link_id, seq, -1, seq))
            local = self.route.local
            if local is not None:  # a stage in this process: a call, the records as they are
                ref = local.push(key, part, ids, born, order)  # awaited by ``_acked``
            else:
                try:
                    msg = encode((self.keys[r], key, part, ids, born, order))
                except Exception as e:  # noqa: BLE001 - some record cannot be serialised
                    part, ids = self._drop_unsendable(key, part, ids, e, acks)
                    if not part:
                        window.give(n)
                        continue
                    msg = encode((self.keys[r], key, part, ids, born, order))
                ref = self.hosts[r].push.remote(msg)
            self.seqs[r] = seq + 1
            unacked[seq] = None
            self.outstanding[r] += n
            acks.append(asyncio.ensure_future(
                self._acked(r, seq, n, key, part, ids, born, ref)))

    def _drop_unsendable(self, key: BatchKey, part: list, lin: Lineage,
                         exc: BaseException, acks: list) -> tuple[list, list]:
        """Report the records of ``part`` that cannot be pickled; returns the others and
        their lineage ids."""
        ok = [picklable(x) for x in part]
        if all(ok):  # the batch as a whole fails (e.g. too deep): report all of it
            ok = [False] * len(part)
        fut = self._unsendable(key, [x for x, g in zip(part, ok, strict=True) if not g],
                               [x for x, g in zip(lin, ok, strict=True) if not g], exc)
        if fut is not None:
            acks.append(fut)
        return ([x for x, g in zip(part, ok, strict=True) if g],
                [x for x, g in zip(lin, ok, strict=True) if g])

    def _replay_order(self, r: int, seq: int) -> tuple[int, int, int, int]:
        """``(link, seq, prev, low)`` for pushing ``seq`` again to replica ``r``: ``prev``
        is the newest push before it that is still unacknowledged (-1: none), ``low`` the
        oldest. Pushes acknowledged in between (a filter dropped all their records, so they
        were acknowledged at once) are never pushed again: a restarted replica must not
        wait for them."""
        unacked = self.unacked[r]
        prev = -1
        for s in unacked:  # in seq order
            if s >= seq:
                break
            prev = s
        return self.link_id, seq, prev, next(iter(unacked), seq)

    def reroute(self, hosts: tuple, specs: tuple, active: tuple[bool, ...]) -> None:
        """The consumer stage scaled: ``hosts``/``specs`` of all its replicas so far (new
        ones are appended; a replica is never removed, pushes to it may be unacked) and
        which of them take new pushes (a retired replica finishes what it holds)."""
        for r in range(len(self.hosts), len(hosts)):
            self.hosts.append(hosts[r])
            self.specs.append(specs[r])
            self.keys.append((self.run_id, self.route.target, r))
            self.outstanding.append(0)
            self.seqs.append(0)
            self.unacked.append({})
        self.active = None if all(active) else list(active)

    def _pick(self) -> int:
        """The consumer replica with the fewest of our records in flight (round robin
        ties), among those that take new pushes."""
        out = self.outstanding
        k = len(out)
        act = self.active
        best = -1
        for i in range(k):
            r = (self._next + i) % k
            if (act is None or act[r]) and (best < 0 or out[r] < out[best]):
                best = r
        self._next = best + 1
        return best

    async def _acked(self, r: int, seq: int, n: int, key: BatchKey, part: list,
                     lin: Lineage, born: float, ref: Any) -> None:
        """Wait for the push's end-to-end ack; reinstall and push again after a restart."""
        host = self.hosts[r]
        first_failure: float | None = None
        delay = 0.02
        try:
            while True:
                try:
                    if await ref != NEED_INSTALL:
                        return
                    await host.install.remote(self.specs[r], r)
                except self._retry:
                    now = time.monotonic()
                    if first_failure is None:
                        first_failure = now
                    elif now - first_failure > RESTART_TIMEOUT_S:
                        raise StageLost(
                            f"stage '{self.route.label}': the Ray actor running its replica "
                            f"{r} died and did not come back within {RESTART_TIMEOUT_S:g}s; "
                            "check `ray status` for lost nodes") from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
                ref = host.push.remote(encode((self.keys[r], key, part, lin, born,
                                               self._replay_order(r, seq))))
        finally:
            self.outstanding[r] -= n
            del self.unacked[r][seq]
            self.window.give(n)


def encode(msg: Any) -> bytes:
    """Pickle a message for another actor (plain pickle; cloudpickle for e.g. lambdas)."""
    try:
        return pickle.dumps(msg, protocol=5)
    except Exception:  # noqa: BLE001 - fall back to the slower, more capable pickler
        from ray import cloudpickle

        return cloudpickle.dumps(msg, protocol=5)


def picklable(x: Any) -> bool:
    """Can ``x`` (a record about to cross to another actor) be serialised?"""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(x)
    except Exception:  # noqa: BLE001 - any pickling failure means no
        return False
    return True


async def send_all(links: list[Link], key: BatchKey, records: list, lin: Lineage,
                   born: float, acks: list) -> None:
    """Send one batch on every link of a port; with several consumers each gets a copy,
    a hop of its own on the route."""
    if len(links) == 1:
        await links[0].send(key, records, lin, born, acks)
        return
    for link in links:
        await link.send(key + (link.route.target,), records, lin, born, acks)


async def gather_acks(acks: list[Any]) -> None:
    """Wait for every ack (futures or tasks: pushes' and outbox entries'); raises the
    first failure."""
    if len(acks) == 1:
        await acks[0]
    elif acks:
        await asyncio.gather(*acks)
