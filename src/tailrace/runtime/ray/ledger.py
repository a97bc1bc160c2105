"""The driver's ledger: what each source batch has delivered, so that replays never
deliver a record twice and never mix two executions of one input.

Delivery between actors is at-least-once and a replayed stage may behave differently
(a non-deterministic ``filter``, ``flat_map`` or ``generate``), so the driver compares
lineage ids (``lineage.py``), not positions in micro-batches; an entry's route
(``messages.BatchKey``) names one execution (``token``) per fan-out hop. The rules
(docs/ray.md, "Fault tolerance"):

1. **First delivery wins**, per lineage id and route: a later one is a replay, dropped;
   so is a record whose ancestor already ended as an error on a route it extends, or an
   error whose descendants were already delivered.
2. **A fan-out execution counts only once it commits** (all it produced acknowledged
   end to end: one whose actor died delivers nothing); per input id the first execution
   to commit wins, the others are dropped whole.
3. **Drops are not deliveries**: a replay may deliver what an earlier filter dropped.
4. A settled source batch frees its ledger; what still waits or arrives is dropped.

Cost: a route without fan-out hops costs a few set operations per delivery, in C;
per-record Python work happens only behind a fan-out stage and for duplicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .messages import BatchKey, Commit, Delivery

_NONE: frozenset = frozenset()


def peel(lin: Any, depth: int) -> Any:
    """The lineage id ``depth`` fan-outs up (``(parent, ordinal)`` -> parent)."""
    for _ in range(depth):
        lin = lin[0]
    return lin


class _Batch:
    """One source batch's ledger."""

    __slots__ = ("terminal", "touched", "winners", "committed", "waiting")

    def __init__(self) -> None:
        self.terminal: dict[BatchKey, set] = {}  # route -> ids delivered on exactly it
        self.touched: dict[BatchKey, set] = {}  # route -> ids with descendants delivered
        self.winners: dict[tuple, dict] = {}  # (route in, stage) -> {parent id: token}
        self.committed: set[int] = set()  # tokens of fan-out executions that committed
        self.waiting: dict[int, list] = {}  # token -> entries waiting for its commit


class Ledger:
    """De-duplication state of one run (see the module doc).

    ``offer(entry)`` returns the entries ready to deliver (possibly with fewer records);
    ``commit(c)`` those a fan-out commit releases; ``settle(key)`` frees a source batch.
    ``dropped`` counts the sink records dropped (replays, superseded executions).
    """

    def __init__(self) -> None:
        self.batches: dict[tuple[int, int], _Batch] = {}
        self.low: dict[int, int] = {}  # per source: every seq below it is settled
        self.above: dict[int, set[int]] = {}  # per source: settled seqs >= low
        self.dropped = 0

    def _batch(self, key: BatchKey) -> _Batch | None:
        src, seq = key[0], key[1]
        if seq < self.low.get(src, 0) or seq in self.above.get(src, ()):
            return None
        b = self.batches.get((src, seq))
        if b is None:
            b = self.batches[(src, seq)] = _Batch()
        return b

    def settle(self, key: BatchKey) -> None:
        """Source batch ``key[:2]`` is acknowledged end to end: forget it, and drop
        whatever still waits for it or arrives later."""
        src, seq = key[0], key[1]
        b = self.batches.pop((src, seq), None)
        if b is not None:
            for entries in b.waiting.values():
                for e in entries:
                    self._drop(e, len(e[3]))
        above = self.above.setdefault(src, set())
        above.add(seq)
        low = self.low.get(src, 0)
        while low in above:
            above.discard(low)
            low += 1
        self.low[src] = low

    def _drop(self, e: Any, n: int) -> None:
        if type(e) is Delivery:
            self.dropped += n

    def offer(self, e: Any) -> list:
        """An outbox entry (``Delivery``, ``Failures``, ``Unsendable``): what of it to
        deliver now (the entry itself, a copy with fewer records, or nothing)."""
        key: BatchKey = e.key
        lin: Sequence = e.lineage
        b = self._batch(key)
        if b is None:
            self._drop(e, len(lin))
            return []
        if len(key) == 2:  # no hops: the common case, in C
            term = b.terminal.get(key)
            touch = b.touched.get(key)
            if term is None:
                if touch is None or touch.isdisjoint(lin):
                    b.terminal[key] = set(lin)
                    return [e]
            elif term.isdisjoint(lin) and (touch is None or touch.isdisjoint(lin)):
                term.update(lin)
                return [e]
            return self._pick(b, e, key, lin, [])
        fans = [(p, h) for p, h in enumerate(key) if p >= 2 and type(h) is tuple]
        if not fans:  # only copies: an id is its ancestors' id, still set operations
            prefixes = [key[:p] for p in range(2, len(key))]
            term = b.terminal.get(key)
            touch = b.touched.get(key)
            if (term is None or term.isdisjoint(lin)) and \
                    (touch is None or touch.isdisjoint(lin)) and \
                    all(b.terminal.get(r, _NONE).isdisjoint(lin) for r in prefixes):
                b.terminal.setdefault(key, set()).update(lin)
                for r in prefixes:
                    b.touched.setdefault(r, set()).update(lin)
                return [e]
            return self._pick(b, e, key, lin, fans)
        for _, (_, token) in fans:
            if token not in b.committed:
                b.waiting.setdefault(token, []).append(e)
                return []
        return self._pick(b, e, key, lin, fans)

    def commit(self, c: Commit) -> list:
        """Fan-out stage ``c.stage`` finished execution ``c.token`` of a push with input
        route ``c.key`` and input ids ``c.parents``: it wins every input not won yet;
        returns the entries this releases."""
        b = self._batch(c.key)
        if b is None:
            return []
        won = b.winners.setdefault((c.key, c.stage), {})
        setdefault = won.setdefault
        token = c.token
        for parent in c.parents:
            setdefault(parent, token)
        b.committed.add(token)
        out: list = []
        for e in b.waiting.pop(token, ()):
            out += self.offer(e)
        return out

    def _pick(self, b: _Batch, e: Any, key: BatchKey, lin: Sequence, fans: list) -> list:
        """Record by record: the winners' records that are new (rule 1 and 2)."""
        m = len(fans)
        checks = [(b.winners.get((key[:p], stage), {}), m - f, token)
                  for f, (p, (stage, token)) in enumerate(fans)]
        # cuts: every hop ends a shorter route the record's ancestor was on
        cuts = []
        after = m
        for p in range(2, len(key)):
            cuts.append((key[:p], after))
            if type(key[p]) is tuple:
                after -= 1
        term = b.terminal.setdefault(key, set())
        touch = b.touched.get(key)
        keep: list[int] = []
        for j, lj in enumerate(lin):
            if any(won.get(peel(lj, depth)) != token for won, depth, token in checks):
                continue  # another execution of an ancestor won
            if lj in term or (touch is not None and lj in touch):
                continue
            if any(peel(lj, depth) in b.terminal.get(route, ()) for route, depth in cuts):
                continue  # an ancestor already ended as an error here
            term.add(lj)
            for route, depth in cuts:
                b.touched.setdefault(route, set()).add(peel(lj, depth))
            keep.append(j)
        n = len(lin)
        if len(keep) == n:
            return [e]
        self._drop(e, n - len(keep))
        if not keep:
            return []
        items = e[2]  # records, errors or reprs: lineage is the next field
        return [e._replace(**{e._fields[2]: [items[j] for j in keep],
                              "lineage": [lin[j] for j in keep]})]
