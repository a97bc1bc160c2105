"""Record lineage inside a stage replica: which input record each output and error came from.

Every record that crosses an actor carries a *lineage id* (docs/ray.md, "Fault
tolerance"), sent beside the records as one list per push (a ``range`` straight from
the source: no per-record object there). One-to-one operators keep it; the outputs and
errors of a *fan-out* stage (a ``flat_map``) get ``(parent id, ordinal)``, outputs
counting 0, 1, ... and errors -1, -2, ... per parent (``ids``).

The stage worker (``stage.py``) tracks lineage when it is given a ``Trace`` (the Ray
runtime does; the local one does not need it): when every operator kept every record
(the common case) it costs one length check per operator, and only a batch with errors,
drops or branches pays a walk to attribute them (by object identity: filters and
branches pass their input objects on, errors name their inputs; identical objects are
interchangeable, so any consistent attribution among them is right).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..api.records import ErrorRecord

#: Positions of a step's records within the stage's input batch (None: 0, 1, ... n-1).
Src = list[int] | None


class Trace:
    """The lineage of one stage call, filled by the stage worker.

    src:    port -> positions in the call's input of each output's input (None: one to
            one).
    esrc:   positions of the inputs of the error records, in the order they were added.
    fanned: some input gave several records.
    """

    __slots__ = ("src", "esrc", "fanned")

    def __init__(self) -> None:
        self.src: dict[str | None, Src] = {}
        self.esrc: list[int] = []
        self.fanned = False


def error_positions(before: list, errs: list) -> list[int]:
    """Positions in ``before`` of the inputs named by ``errs`` (``(input, exc)`` pairs or
    ``ErrorRecord``s), matched by identity in any order; an error naming no input of the
    batch takes the first position left (never the same one twice)."""
    if not errs:
        return []
    where: dict[int, list[int]] = {}
    for j in range(len(before) - 1, -1, -1):
        where.setdefault(id(before[j]), []).append(j)
    used: set[int] = set()
    out: list[int] = []
    unmatched = 0
    for e in errs:
        x = e.input if isinstance(e, ErrorRecord) else e[0]
        stack = where.get(id(x))
        if stack:
            j = stack.pop()
            used.add(j)
            out.append(j)
        else:
            out.append(-1)
            unmatched += 1
    if unmatched:
        free = (j for j in range(len(before)) if j not in used)
        out = [next(free, 0) if j < 0 else j for j in out]
    return out


def kept_positions(before: list, after: list, failed: list[int]) -> list[int]:
    """Positions in ``before`` of the records in ``after`` for an operator that gives at
    most one output per input, in order (``failed``: positions that became errors).
    Kept records are matched by identity (a filter passes its inputs on); when the outputs
    are new objects and some inputs gave none, the first inputs are taken, in order; extra
    outputs (an operator other than ``flat_map`` that fans out) go to the last input."""
    bad = set(failed)
    ok = [j for j in range(len(before)) if j not in bad] if bad else list(range(len(before)))
    n_out = len(after)
    if n_out >= len(ok):  # one each (more: an operator that fans out unannounced)
        return ok + [ok[-1] if ok else 0] * (n_out - len(ok))
    kept: list[int] = []
    p = 0
    for j in ok:
        if p < n_out and before[j] is after[p]:
            kept.append(j)
            p += 1
    if p < n_out:  # outputs that are not their inputs: attribute by position
        return ok[:n_out]
    return kept


def compose(src: Src, positions: list[int]) -> list[int]:
    """Positions relative to a step's input -> positions in the stage's input."""
    return positions if src is None else [src[k] for k in positions]


def split_branch(before: list, t: list, f: list, failed: list[int]) -> tuple[list, list]:
    """Positions in ``before`` of a branch's true and false records (identity walk)."""
    bad = set(failed)
    pt: list[int] = []
    pf: list[int] = []
    it, iff, nt, nf = 0, 0, len(t), len(f)
    for j, x in enumerate(before):
        if j in bad:
            continue
        if it < nt and t[it] is x:
            pt.append(j)
            it += 1
        elif iff < nf and f[iff] is x:
            pf.append(j)
            iff += 1
    return pt, pf


def fan_out(record_fn: Any, batch: list, src: Src, errs: list,
             esrc: list) -> tuple[list, list[int]]:
    """A fan-out operator record by record: its outputs and their input positions."""
    out: list = []
    pos: list[int] = []
    for j, x in enumerate(batch):
        try:
            r = record_fn(x)
        except Exception as e:  # noqa: BLE001 - operator code may raise anything
            errs.append((x, e))
            esrc.append(j if src is None else src[j])
            continue
        if r:
            out.extend(r)
            pos.extend([j if src is None else src[j]] * len(r))
    return out, pos


def ids(lin: Sequence, src: Src, fan: bool, errors: bool = False,
        counts: dict[int, int] | None = None) -> Sequence:
    """Lineage ids of a step's records from the stage input's ids ``lin``.

    src:    positions of the records in the stage's input (None: one to one).
    fan:    the stage fans out: ids are ``(parent id, ordinal)``.
    errors: these are error records of a fan-out stage (ordinals -1, -2, ...).
    counts: ordinals already given per input position (shared by a part's ports, so
            that a fan-out followed by a branch never gives two records one id).
    """
    if not fan:
        return lin if src is None else [lin[s] for s in src]
    if src is None:
        src = list(range(len(lin)))
    seen: dict[int, int] = {} if counts is None else counts
    out: list = []
    step = -1 if errors else 1
    base = -1 if errors else 0
    for s in src:
        k = seen.get(s, base)
        seen[s] = k + step
        out.append((lin[s], k))
    return out
