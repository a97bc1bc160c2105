"""Small text functions the demo pipeline names by dotted path."""

from __future__ import annotations

import re

_WORD = re.compile(r"[A-Za-z0-9']+")


def normalize(text: str) -> str:
    """Collapse whitespace: ``"a  b\\n"`` -> ``"a b"``."""
    return " ".join(text.split())


def count_words(text: str) -> int:
    return len(_WORD.findall(text))


def is_long(n_words: int) -> bool:
    return n_words > 12


def headline(text: str) -> str:
    """The first eight words and an ellipsis."""
    return " ".join(text.split()[:8]) + " ..."


def as_is(text: str) -> str:
    return text


def running_count(state: int | None, record: dict) -> tuple[int, int]:
    """Keyed state: how many records of this topic so far (including this one)."""
    n = (state or 0) + 1
    return n, n


def citations(passages: list[dict]) -> list[str]:
    """Where each retrieved chunk comes from: ``path > heading (p. N) score``."""
    out = []
    for p in passages:
        where = " > ".join(x for x in (p.get("path", p.get("title", "")), p.get("heading"))
                           if x)
        page = f" (p. {p['page']})" if "page" in p else ""
        out.append(f"{where}{page} [{p.get('score', 0):.2f}]")
    return out
