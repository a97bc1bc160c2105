"""Dispatch policies: which replica of an engine pool gets the next batch.

A policy is a small object with ``choose(loads, cost) -> replica id | None``; it reads a
snapshot of each replica's load (``ReplicaLoad``) and never touches the replicas itself,
so it is unit-tested with plain lists. ``None`` means every replica is down or full: the
pool keeps the batch until one frees up.

    >>> loads = [ReplicaLoad(0, outstanding_work=900, in_flight=1, max_concurrency=2),
    ...          ReplicaLoad(1, outstanding_work=100, in_flight=1, max_concurrency=2)]
    >>> make_dispatch("least_work").choose(loads, cost=50)
    1

``prefix_affinity`` also reads the request's ``Affinity`` (``affinity_of``) and its own
memory of the prompts it sent where: still a pure function of what it is given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from operator import itemgetter
from typing import NamedTuple, Protocol, overload

from ..base import GenerationRequest
from ..tokens import approx_tokens

#: characters per block of a raw prompt's text (about 64 tokens: four llama.cpp prefill chunks)
BLOCK_CHARS = 256
#: a shared prefix shorter than this (predicted tokens) is not worth routing for: the
#: prompts shorter than this gain too little from a warm replica to wait for one
MIN_PREFIX_TOKENS = 64
#: sessions remembered (least recently used forgotten first)
MAX_SESSIONS = 65_536


class ReplicaLoad(NamedTuple):
    """What a dispatch policy sees of one replica (a named tuple: the pool builds one per
    replica for every batch it routes, so it must be cheap to make)."""

    id: int  # the replica's id in its pool
    healthy: bool = True  # the replica is up and accepts work
    outstanding_work: int = 0  # predicted tokens (prompt + max_tokens) of the calls it runs
    in_flight: int = 0  # engine calls (batches) sent to it and not yet answered
    max_concurrency: int = 1  # the most engine calls it runs at once

    def can_take(self, cost: int) -> bool:
        """Whether a call may be sent to it now: it is healthy and below its concurrency
        (``cost``, the call's predicted tokens, does not limit it)."""
        return self.healthy and self.in_flight < self.max_concurrency


@dataclass(frozen=True)
class Affinity:
    """What one request may share with earlier ones, as the pool can see it.

    keys:    chained hashes of its prompt's blocks (``keys[i]`` covers blocks 0..i);
    tokens:  predicted prompt tokens up to the end of each block (same length as ``keys``);
    session: the caller's session id (``GenerationRequest.session``), if any.
    """

    keys: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    session: str | None = None


def affinity_of(req: GenerationRequest, block_chars: int = BLOCK_CHARS) -> Affinity:
    """A request's ``Affinity``: chat messages hash one by one (a conversation's turn k
    extends turn k-1's messages), a raw prompt in blocks of ``block_chars`` characters.

    Hashes are Python's ``hash`` of (previous hash, block): stable within the process that
    dispatches, which is all the pool needs (nothing is stored or sent elsewhere).

    >>> a = affinity_of(GenerationRequest(messages=({"role": "user", "content": "hi"},)))
    >>> b = affinity_of(GenerationRequest(messages=({"role": "user", "content": "hi"},
    ...                                             {"role": "assistant", "content": "yo"})))
    >>> a.keys[0] == b.keys[0], len(b.keys)
    (True, 2)
    """
    keys: list[int] = []
    tokens: list[int] = []
    h, total = 0, 0
    if req.messages is not None:
        blocks: list[tuple[str, str]] = [(str(m.get("role", "")), str(m.get("content", "")))
                                         for m in req.messages]
    else:
        text = req.prompt or ""
        blocks = [("", text[i:i + block_chars]) for i in range(0, len(text), block_chars)]
    for role, content in blocks:
        h = hash((h, role, content))
        total += approx_tokens(content)
        keys.append(h)
        tokens.append(total)
    return Affinity(tuple(keys), tuple(tokens), req.session)


class PrefixIndex:
    """The prompts last sent to one replica (their block keys), least recently used first.

    ``capacity`` prompts are remembered: what the replica's engine can keep cached
    (``n_seq_max + cache_sequences`` KV streams for llama.cpp).

    >>> ix = PrefixIndex(capacity=1)
    >>> ix.add((1, 2, 3)); ix.match((1, 2, 9))
    2
    >>> ix.add((7,)); ix.match((1, 2, 9))
    0
    """

    def __init__(self, capacity: int):
        self.capacity = max(int(capacity), 1)
        self._prompts: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._count: dict[int, int] = {}  # key -> remembered prompts holding it

    def __len__(self) -> int:
        return len(self._prompts)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` a remembered prompt shares (chained keys: a key
        present means every key before it is)."""
        return next((n for n in range(len(keys), 0, -1) if keys[n - 1] in self._count), 0)

    def add(self, keys: tuple[int, ...]) -> None:
        """Remember a prompt sent to the replica (most recent); forget the oldest beyond
        ``capacity``."""
        if not keys:
            return
        if keys in self._prompts:
            self._prompts.move_to_end(keys)
            return
        self._prompts[keys] = None
        for k in keys:
            self._count[k] = self._count.get(k, 0) + 1
        while len(self._prompts) > self.capacity:
            old, _ = self._prompts.popitem(last=False)
            for k in old:
                left = self._count[k] - 1
                if left:
                    self._count[k] = left
                else:
                    del self._count[k]


#: (outstanding work, calls in flight, id) of a ``ReplicaLoad``: least work first
_LEAST = itemgetter(2, 3, 0)


class LoadTable(Sequence[ReplicaLoad]):
    """Every replica's load, by id (a read-only sequence, as dispatch policies take), with
    the least-work replica that can take a call kept at hand: ``least()`` costs O(log n)
    where a scan over a thousand replicas costs a millisecond per batch.

    ``set(load)`` replaces replica ``load.id``'s load. The heap holds each replica that can
    take a call under its current key, besides stale entries, which ``least()`` drops as
    they surface and which a rebuild clears once they outnumber the replicas.

    >>> t = LoadTable([ReplicaLoad(0, outstanding_work=9), ReplicaLoad(1)])
    >>> t.least().id
    1
    >>> t.set(ReplicaLoad(1, in_flight=1))   # full (max_concurrency 1)
    >>> t.least().id, t.free
    (0, 1)
    """

    def __init__(self, loads: Sequence[ReplicaLoad] = ()) -> None:
        self._loads = list(loads)
        assert all(x.id == i for i, x in enumerate(self._loads)), "loads must be by id"
        self.free = 0  # replicas that can take a call now
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [_LEAST(x) for x in self._loads
                      if x.healthy and x.in_flight < x.max_concurrency]
        heapify(self._heap)
        self.free = len(self._heap)

    def set(self, load: ReplicaLoad) -> None:
        """Replica ``load.id``'s load is now ``load``."""
        old = self._loads[load.id]
        self._loads[load.id] = load
        took = old.healthy and old.in_flight < old.max_concurrency
        takes = load.healthy and load.in_flight < load.max_concurrency
        self.free += takes - took
        if takes and (not took or _LEAST(load) != _LEAST(old)):  # else its entry stands
            heappush(self._heap, _LEAST(load))
            if len(self._heap) > 2 * len(self._loads) + 64:
                self._rebuild()

    def least(self) -> ReplicaLoad | None:
        """The replica ``LeastOutstandingWork`` would choose by a scan; None if none can
        take a call."""
        heap, loads = self._heap, self._loads
        while heap:
            key = heap[0]
            x = loads[key[2]]
            if x.healthy and x.in_flight < x.max_concurrency and _LEAST(x) == key:
                return x
            heappop(heap)
        return None

    @overload
    def __getitem__(self, i: int) -> ReplicaLoad: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ReplicaLoad]: ...

    def __getitem__(self, i: int | slice) -> ReplicaLoad | Sequence[ReplicaLoad]:
        return self._loads[i]

    def __len__(self) -> int:
        return len(self._loads)

    def __iter__(self) -> Iterator[ReplicaLoad]:
        return iter(self._loads)

    def __eq__(self, other: object) -> bool:
        return self._loads == (other._loads if isinstance(other, LoadTable) else other)

    __hash__ = None  # type: ignore[assignment]


class DispatchPolicy(Protocol):
    """Chooses a replica for a call of ``cost`` predicted tokens, or None if none can take it.

    ``affinity``: the call's request, for policies that route by prefix or session (others
    ignore it). ``forget(rid)``: replica ``rid`` restarted, whatever it cached is gone.
    """

    name: str

    def choose(self, loads: Sequence[ReplicaLoad], cost: int,
               affinity: Affinity | None = None) -> int | None: ...

    def forget(self, rid: int) -> None: ...


class LeastOutstandingWork:
    """The replica with the least predicted outstanding tokens that can take the call.

    Ties go to the replica with fewer calls in flight, then the lower id. Counting tokens
    rather than calls keeps one replica from collecting all the long generations when
    request sizes are skewed.

    >>> LeastOutstandingWork().choose([ReplicaLoad(0, outstanding_work=5),
    ...                                ReplicaLoad(1, healthy=False)], cost=1)
    0
    """

    name = "least_work"

    def forget(self, rid: int) -> None:
        """Nothing to forget."""

    def choose(self, loads: Sequence[ReplicaLoad], cost: int,
               affinity: Affinity | None = None) -> int | None:
        """The id of the least-loaded replica that can take ``cost``; None if none can."""
        if isinstance(loads, LoadTable):  # the pool's own table: no scan
            best = loads.least()
            return None if best is None else best.id
        # ``can_take`` and the key inlined: this runs over every replica for every batch
        best = min((x for x in loads if x.healthy and x.in_flight < x.max_concurrency),
                   key=_LEAST, default=None)
        return None if best is None else best.id


class RoundRobin:
    """Replicas in turn, skipping those that are down or full (for comparison).

    >>> rr = RoundRobin()
    >>> loads = [ReplicaLoad(0), ReplicaLoad(1, healthy=False), ReplicaLoad(2)]
    >>> [rr.choose(loads, 1) for _ in range(3)]
    [0, 2, 0]
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def forget(self, rid: int) -> None:
        """Nothing to forget."""

    def choose(self, loads: Sequence[ReplicaLoad], cost: int,
               affinity: Affinity | None = None) -> int | None:
        """The next replica in turn (``loads`` in a stable order) that can take ``cost``;
        None if none can."""
        n = len(loads)
        for step in range(n):
            load = loads[(self._next + step) % n]
            if load.can_take(cost):
                self._next = (self._next + step + 1) % n
                return load.id
        return None


class PrefixAffinity:
    """The replica that most likely holds the request's longest prompt prefix in its KV
    cache, or its session's replica, unless that one is ``slack`` tokens busier than the
    least-loaded; else least work. A request's work counts in full wherever it goes
    (counting its cached prefix off let one replica queue far more: docs/control.md).

    The pool cannot see an engine's cache, so the policy remembers what it sent where: the
    block keys of each request's prompt (``Affinity``), ``capacity`` prompts per replica
    (``PrefixIndex``), and each session's last replica. A prefix counts once it covers
    ``MIN_PREFIX_TOKENS`` predicted tokens.

    >>> pa = PrefixAffinity(slack=100)
    >>> loads = [ReplicaLoad(0, max_concurrency=4), ReplicaLoad(1, max_concurrency=4)]
    >>> turn = Affinity(keys=(11, 12), tokens=(80, 90))
    >>> pa.choose(loads, 10, turn)     # nothing known: least work, remembered on 0
    0
    >>> pa.choose([ReplicaLoad(0, outstanding_work=90, max_concurrency=4), loads[1]], 10,
    ...           Affinity(keys=(11, 13), tokens=(80, 95)))   # shares block 11 with 0
    0
    """

    name = "prefix_affinity"

    def __init__(self, slack: int = 2048, capacity: int = 8):
        """slack:    the most predicted tokens the preferred replica may have outstanding
                      beyond the least-loaded one (>= 0).
        capacity:  prompts remembered per replica (>= 1)."""
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ValueError(f"affinity_slack must be an integer >= 0 (predicted tokens), "
                             f"got {slack!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"affinity capacity must be an integer >= 1, got {capacity!r}")
        self.slack, self.capacity = slack, capacity
        self._least = LeastOutstandingWork()
        self._index: dict[int, PrefixIndex] = {}
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self.affine = 0  # choices that followed a prefix or session
        self.fallbacks = 0  # choices where the preferred replica was too busy or full

    def forget(self, rid: int) -> None:
        """Replica ``rid`` restarted: its cache is empty (its sessions go elsewhere next)."""
        self._index.pop(rid, None)

    def preferred(self, loads: Sequence[ReplicaLoad], affinity: Affinity) -> list[int]:
        """Replica ids in order of preference: the session's, then by the longest
        remembered prefix (ties: less work); only replicas with a reason to prefer them."""
        out: list[int] = []
        if affinity.session is not None and affinity.session in self._sessions:
            out.append(self._sessions[affinity.session])
        scored = []
        for load in loads:
            ix = self._index.get(load.id)
            n = ix.match(affinity.keys) if ix is not None else 0
            if n and affinity.tokens[n - 1] >= MIN_PREFIX_TOKENS:
                scored.append((-affinity.tokens[n - 1], load.outstanding_work, load.id))
        out += [rid for _, _, rid in sorted(scored) if rid not in out]
        return out

    def choose(self, loads: Sequence[ReplicaLoad], cost: int,
               affinity: Affinity | None = None) -> int | None:
        """The preferred replica within ``slack`` of the least-loaded, else the least
        loaded; the choice is remembered for the request's prefix and session."""
        least = self._least.choose(loads, cost)
        if least is None or affinity is None:
            return least
        by_id = {load.id: load for load in loads}
        floor = by_id[least].outstanding_work
        rid = least
        wanted = self.preferred(loads, affinity)
        for want in wanted:
            load = by_id.get(want)
            if load is not None and load.can_take(cost) \
                    and load.outstanding_work - floor <= self.slack:
                rid = want
                self.affine += 1
                break
        else:
            if wanted:
                self.fallbacks += 1
        self._index.setdefault(rid, PrefixIndex(self.capacity)).add(affinity.keys)
        if affinity.session is not None:
            self._sessions[affinity.session] = rid
            self._sessions.move_to_end(affinity.session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return rid


#: policy name -> class; ``make_dispatch`` creates a fresh instance (policies keep state)
DISPATCH: dict[str, type[DispatchPolicy]] = {
    c.name: c for c in (LeastOutstandingWork, RoundRobin, PrefixAffinity)}


def make_dispatch(name: str, *, affinity_slack: int | None = None,
                  affinity_capacity: int = 8) -> DispatchPolicy:
    """A new dispatch policy by name: one of ``DISPATCH`` (``least_work``,
    ``prefix_affinity``, ``round_robin``). ``affinity_slack`` and ``affinity_capacity``
    configure ``prefix_affinity`` (a slack given to another policy is an error).

    >>> make_dispatch("fastest")
    Traceback (most recent call last):
    ...
    ValueError: unknown dispatch policy 'fastest'; known: least_work, prefix_affinity, round_robin
    """
    if not isinstance(name, str) or name not in DISPATCH:
        raise ValueError(f"unknown dispatch policy {name!r}; known: "
                         f"{', '.join(sorted(DISPATCH))}")
    if name == PrefixAffinity.name:
        return PrefixAffinity(2048 if affinity_slack is None else affinity_slack,
                              affinity_capacity)
    if affinity_slack is not None:
        raise ValueError(f"affinity_slack applies to dispatch: prefix_affinity, not {name!r}")
    return DISPATCH[name]()
