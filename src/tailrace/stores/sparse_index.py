"""A BM25 keyword index over documents' ``title``, ``heading`` and ``text``; rank fusion.

``SparseIndex`` wraps ``bm25s`` (imported on first use); a document's position is its
row in the dense index beside it. A score is ``bm25(title. heading. text) + title_weight
* bm25(title)`` (why: docs/design.md, "Hybrid retrieval fuses ranks"). ``save``/``load``
keep a ``sparse.json`` naming the tokenizer and document count, so a stale folder is
detected. ``search`` keeps the top k of the documents an optional mask allows (a filter
inside the search); ``rrf`` fuses ranked lists by weighted reciprocal rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import StoreError

TOKENIZER = "bm25s-lower-en-stopwords-title-heading-v3"  # what ``build`` does; in sparse.json
TITLE_WEIGHT = 2.0


def _bm25s() -> Any:
    try:
        import bm25s
    except ImportError:
        raise StoreError("sparse and hybrid retrieval need the package 'bm25s'; install it "
                         "with: pip install 'tailrace[rag]'") from None
    return bm25s


def doc_text(doc: dict) -> str:
    """What BM25 indexes of a document: its title, its heading (a chunk's section, when
    ingest recorded one) and its text."""
    parts = (doc.get("title"), doc.get("heading"), doc.get("text"))
    return ". ".join(str(p) for p in parts if p)


def _bm25(texts: list[str]) -> Any:
    """A ``bm25s.BM25`` over ``texts``; None when none of them holds a word."""
    tokens = _tokens(texts)
    if not any(tokens):
        return None
    bm25 = _bm25s().BM25()
    bm25.index(tokens, show_progress=False)
    return bm25


def _tokens(texts: Sequence[str]) -> list[list[str]]:
    return _bm25s().tokenize(list(texts), stopwords="en", return_ids=False,
                             show_progress=False)


class SparseIndex:
    """BM25 scores of documents (rows ``0..n-1``) for keyword queries."""

    def __init__(self, body: Any, title: Any, count: int) -> None:
        """Wrap the ``bm25s.BM25`` of ``doc_text`` and of titles over ``count``
        documents (None: no document holds a word there); use ``build`` or ``load``."""
        self._fields = {"body": body, "title": title}
        self._count = count

    @classmethod
    def build(cls, docs: Sequence[dict]) -> SparseIndex:
        """Index each doc's ``doc_text`` and ``title`` (row i: ``docs[i]``)."""
        return cls(_bm25([doc_text(d) for d in docs]),
                   _bm25([str(d.get("title", "")) for d in docs]), len(docs))

    def __len__(self) -> int:
        return self._count

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the index into ``directory`` (created)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for name, bm25 in self._fields.items():
            if bm25 is not None:
                bm25.save(str(d / name), show_progress=False)
        (d / "sparse.json").write_text(json.dumps(
            {"tokenizer": TOKENIZER, "count": self._count,
             "fields": [n for n, b in self._fields.items() if b is not None]}),
            encoding="utf-8")

    @classmethod
    def load(cls, directory: str | os.PathLike[str], count: int) -> SparseIndex | None:
        """The index ``save`` wrote to ``directory`` if it indexes ``count`` documents with
        this tokenizer; None if it is missing or stale (then ``build`` it again)."""
        d = Path(directory)
        try:
            meta = json.loads((d / "sparse.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict) or meta.get("tokenizer") != TOKENIZER \
                or meta.get("count") != count or not isinstance(meta.get("fields"), list):
            return None
        try:
            found = {n: _bm25s().BM25.load(str(d / n), show_progress=False)
                     for n in ("body", "title") if n in meta["fields"]}
        except (OSError, ValueError, KeyError) as e:
            raise StoreError(f"sparse index at {d} is corrupt ({e}); delete that folder "
                             "and it is rebuilt") from None
        return cls(found.get("body"), found.get("title"), count)

    def scores(self, query: str, title_weight: float = TITLE_WEIGHT) -> Any:
        """BM25 score of every document for ``query`` (float32 array, 0: no shared word):
        of ``doc_text`` plus ``title_weight`` times that of the title."""
        import numpy as np

        toks = _tokens([query])[0]
        total = np.zeros(self._count, np.float32)
        if not toks:
            return total
        for name, w in (("body", 1.0), ("title", title_weight)):
            bm25 = self._fields[name]
            if bm25 is not None and w:
                total += w * np.asarray(bm25.get_scores(toks), np.float32)
        return total

    def search(self, queries: Sequence[str], k: int, allow: Any = None, *,
               title_weight: float = TITLE_WEIGHT) -> list[list[tuple[int, float]]]:
        """Per query, up to ``k`` ``(row, score)`` best first, among the documents sharing
        a word with it and allowed by ``allow`` (a bool array over rows; None: all)."""
        import numpy as np

        out = []
        for q in queries:
            s = self.scores(q, title_weight)
            if allow is not None:
                s = np.where(allow, s, 0.0)
            hits = np.flatnonzero(s > 0)
            if len(hits) > k:
                hits = hits[np.argpartition(-s[hits], k - 1)[:k]]
            hits = hits[np.lexsort((hits, -s[hits]))]  # best first, ties by row
            out.append([(int(i), float(s[i])) for i in hits])
        return out


def rrf(rankings: Sequence[Sequence[int]], weights: Sequence[float], k: int = 60,
        top: int | None = None) -> list[tuple[int, float]]:
    """Weighted reciprocal rank fusion: each id scores ``sum(w / (k + rank))`` over the
    rankings it appears in (rank 1 = first); best first, ties by first appearance.

    >>> rrf([[7, 3], [3, 9]], [1.0, 1.0], k=60)[0]
    (3, 0.03252247488101534)
    """
    if len(rankings) != len(weights):
        raise ValueError(f"{len(rankings)} rankings but {len(weights)} weights")
    fused: dict[int, float] = {}
    for ranking, w in zip(rankings, weights, strict=True):
        for rank, i in enumerate(ranking, 1):
            fused[i] = fused.get(i, 0.0) + w / (k + rank)
    order = sorted(fused.items(), key=lambda t: -t[1])  # stable: first appearance wins ties
    return order[:top] if top is not None else order
