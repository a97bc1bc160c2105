"""Metadata filters over index documents: equality, ``in`` and numeric or date ranges.

A filter is a mapping from a document field to a condition, all of which must hold::

    {"lang": "en"}                                  # equality
    {"path": {"in": ["docs/a.md", "docs/b.md"]}}    # one of several values
    {"page": {"gte": 2, "lt": 10}}                  # numeric range
    {"mtime": {"gte": "2026-01-01"}}                # ISO date range (dates or datetimes)

``compile_filter`` validates it (ValueError naming the field and what is wrong) and
returns a ``Filter`` whose ``mask(docs)`` is the bool array of the documents it keeps;
the indexes search only those (see ``VectorIndex.search``). A document without the field,
or whose value cannot be compared (a string against a number), does not match. Dates
compare as instants: a naive date or datetime is taken as UTC.

>>> f = compile_filter({"year": {"gte": 2000}, "lang": {"in": ["en", "fr"]}})
>>> [f.matches(d) for d in ({"year": 2001, "lang": "fr"}, {"year": 1999, "lang": "en"})]
[True, False]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

from ..api.pipeline import is_real

RANGE_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "gt": lambda a, b: a > b, "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b, "lte": lambda a, b: a <= b}
OPS = ("eq", "in", *RANGE_OPS)
SCALARS = (str, int, float, bool)


def _instant(v: Any) -> datetime | None:
    """An ISO date/datetime string (or ``date``) as an aware UTC datetime; None if not one."""
    if isinstance(v, str):
        try:
            v = datetime.fromisoformat(v)
        except ValueError:
            return None
    if isinstance(v, date) and not isinstance(v, datetime):
        v = datetime(v.year, v.month, v.day)
    if not isinstance(v, datetime):
        return None
    return v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)


def _bound(field: str, op: str, v: Any) -> tuple[bool, Any]:
    """(is_date, value) of a range bound; ValueError unless a number or an ISO date."""
    if is_real(v):
        return False, v
    t = _instant(v)
    if t is None:
        raise ValueError(f"filter on '{field}': '{op}' must be a number or an ISO date like "
                         f"2026-01-31, got {v!r}")
    return True, t


def _equals(want: Any) -> Callable[[Any], bool]:
    def test(v: Any) -> bool:  # 1 == 1.0, but true is not 1 and "1" is not 1
        return (type(v) is type(want) and v == want) or (is_real(v) and is_real(want)
                                                         and v == want)
    return test


def _one_of(allowed: frozenset) -> Callable[[Any], bool]:
    def test(v: Any) -> bool:
        return isinstance(v, SCALARS) and v in allowed
    return test


def _in_range(cmp: Callable[[Any, Any], bool], is_date: bool,
              bound: Any) -> Callable[[Any], bool]:
    def test(v: Any) -> bool:
        if is_date:
            t = _instant(v)
            return t is not None and cmp(t, bound)
        return is_real(v) and cmp(v, bound)
    return test


def _condition(field: str, cond: Any) -> Callable[[Any], bool]:
    """The test one field's value must pass; ValueError naming the field if malformed."""
    if not isinstance(cond, dict):
        if not isinstance(cond, SCALARS):
            raise ValueError(f"filter on '{field}' must be a value (text, number, true/false) "
                             f"or a mapping like {{in: [...]}} or {{gte: x, lte: y}}, got "
                             f"{cond!r}")
        cond = {"eq": cond}
    if not cond:
        raise ValueError(f"filter on '{field}' is empty; give one of: {', '.join(OPS)}")
    bad = [str(k) for k in cond if k not in OPS]
    if bad:
        raise ValueError(f"filter on '{field}': unknown operator(s) {', '.join(bad)}; "
                         f"known: {', '.join(OPS)}")
    tests: list[Callable[[Any], bool]] = []
    if "eq" in cond:
        want = cond["eq"]
        if not isinstance(want, SCALARS):
            raise ValueError(f"filter on '{field}': 'eq' must be a text, number or "
                             f"true/false, got {want!r}")
        tests.append(_equals(want))
    if "in" in cond:
        values = cond["in"]
        if not isinstance(values, list) or not values or \
                not all(isinstance(x, SCALARS) for x in values):
            raise ValueError(f"filter on '{field}': 'in' must be a non-empty list of texts, "
                             f"numbers or true/false, got {values!r}")
        tests.append(_one_of(frozenset(values)))
    ranges = [(op, *_bound(field, op, cond[op])) for op in RANGE_OPS if op in cond]
    if len({is_date for _, is_date, _ in ranges}) > 1:
        raise ValueError(f"filter on '{field}' mixes numbers and dates in one range")
    tests.extend(_in_range(RANGE_OPS[op], is_date, b) for op, is_date, b in ranges)
    return lambda v: all(t(v) for t in tests)


@dataclass(frozen=True)
class Filter:
    """A compiled metadata filter (see ``compile_filter``)."""

    spec: dict
    tests: tuple[tuple[str, Callable[[Any], bool]], ...]

    def matches(self, doc: dict) -> bool:
        """Whether ``doc`` has every filtered field with a value that passes."""
        missing = object()
        return all((v := doc.get(f, missing)) is not missing and t(v) for f, t in self.tests)

    def mask(self, docs: Sequence[dict]) -> Any:
        """A bool numpy array: ``mask[i]`` is ``matches(docs[i])``."""
        import numpy as np

        return np.fromiter((self.matches(d) for d in docs), dtype=bool, count=len(docs))


def compile_filter(spec: Any) -> Filter:
    """Validate a filter mapping (see the module doc) and compile it; ValueError naming the
    field and what is wrong."""
    if not isinstance(spec, dict) or not spec:
        raise ValueError("filter must be a non-empty mapping of field to condition, like "
                         f"{{path: {{in: [a.md, b.md]}}, page: {{gte: 2}}}}, got {spec!r}")
    tests = []
    for field, cond in spec.items():
        if not isinstance(field, str) or not field:
            raise ValueError(f"filter field names must be texts, got {field!r}")
        if field == "score":
            raise ValueError("filter on 'score': it is a search result, not document "
                             "metadata; filter on a document field")
        tests.append((field, _condition(field, cond)))
    return Filter(dict(spec), tuple(tests))
