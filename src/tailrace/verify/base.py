"""What every verifier is: a ``Verdict`` and the ``Verifier`` base class.

>>> import asyncio
>>> class NonEmpty(Verifier):
...     name = "non_empty"
...     async def __call__(self, answer, record):
...         return self.verdict(bool(answer.strip()), "has text" if answer.strip() else "empty")
>>> asyncio.run(NonEmpty()("  ", {}))
Verdict(ok=False, reason='empty', verifier='non_empty')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FieldError
from ..request import field_list

#: the longest reason a verdict carries (one line)
REASON_CHARS = 200


def one_line(text: Any, n: int = REASON_CHARS) -> str:
    """``text`` on one line, at most ``n`` characters.

    >>> one_line("a\\n  b" + "c" * 300)[:8], len(one_line("x" * 300))
    ('a bccccc', 200)
    """
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one answer.

    ok:       the answer passed.
    reason:   why, in one line ("passed", "timeout after 10 s", "no match for '^\\d+$'").
    verifier: the verifier's name ("unit_tests", "regex", "python:mypkg.checks.f", ...).
    """

    ok: bool
    reason: str
    verifier: str

    def to_dict(self) -> dict[str, Any]:
        """The record form: ``{"ok": ..., "reason": ..., "verifier": ...}``."""
        return {"ok": self.ok, "reason": self.reason, "verifier": self.verifier}


class Verifier:
    """Checks an answer: ``await verifier(answer, record) -> Verdict``.

    name:   what verdicts and stats call it.
    fields: the record fields it reads besides the answer (the ``verify`` operator checks
            them at compile time and at run time).

    A verifier never raises for a wrong answer (that is a failing verdict); it raises for
    a broken setup (a record without a field it reads, a check function that crashes).
    Subclasses are immutable after construction and may be shared by concurrent calls.
    """

    name: str = "verifier"
    fields: tuple[str, ...] = ()

    async def __call__(self, answer: str, record: Mapping[str, Any]) -> Verdict:
        raise NotImplementedError(f"{type(self).__name__} must define async __call__")

    def verdict(self, ok: bool, reason: str) -> Verdict:
        """A verdict of this verifier; ``reason`` is put on one bounded line."""
        return Verdict(bool(ok), one_line(reason), self.name)

    def __repr__(self) -> str:
        return f"<verifier {self.name}>"


def field_of(record: Mapping[str, Any], name: str, verifier: str) -> Any:
    """``record[name]``, or a FieldError saying which verifier needs it (a served
    request's 400)."""
    try:
        return record[name]
    except (KeyError, TypeError):
        raise FieldError(f"verifier {verifier} reads field '{name}', which the record lacks "
                         f"(it has: {field_list(record)})") from None


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S)


def fenced_block(text: str, languages: tuple[str, ...] | None = None) -> str | None:
    """The body of the first fenced block (```lang ... ```) of ``text`` whose language is
    in ``languages`` (None: any; ``""``: an unlabelled block), or None. An unclosed block
    runs to the end (an answer cut by ``max_tokens``).

    >>> fenced_block("Here:\\n```python\\nx = 1\\n```\\nDone.", ("python", ""))
    'x = 1'
    >>> fenced_block("no code here") is None
    True
    """
    for m in _FENCE.finditer(text):
        if languages is None or m.group(1).lower() in languages:
            return m.group(2)
    return None
