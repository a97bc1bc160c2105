"""A faiss vector index saved to disk together with its documents and metadata.

Vectors are expected L2-normalised, so inner product is cosine similarity. A saved index
is a directory of three files: ``index.faiss`` (the faiss index), ``docs.jsonl`` (one
document per vector, in insertion order) and ``meta.json`` (format version, embedding
model, dim, kind, count, fingerprint, efSearch). ``save`` writes a new version folder
beside the target (``NAME.vNNNNNN/``), fsyncs it and then switches the link ``NAME`` to it
(see ``atomic``), so a crash at any instant leaves the old or the new index, never half
of one or none. faiss and numpy are imported on first use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import StoreError
from .atomic import current, replace_dir
from .live_store import faiss as _faiss

FORMAT_VERSION = 1
KINDS = ("flat", "hnsw")


def _corrupt(where: Path, what: str) -> StoreError:
    return StoreError(f"index at {where} is corrupt: {what}; rebuild it with `tailrace ingest`")


class VectorIndex:
    """Normalised vectors searchable by cosine similarity, each with a JSON document."""

    def __init__(self, index: Any, docs: list[dict], *, model: str, kind: str,
                 ef_search: int, fingerprint: str = "") -> None:
        """Wrap a faiss index (inner-product metric) and one JSON-able doc per vector, in
        index order; use ``create`` or ``open`` instead. ``fingerprint``: what the index was
        built from (e.g. a hash of the corpus)."""
        self._index = index
        self._docs = docs
        self._model = model
        self._kind = kind
        self._ef_search = ef_search
        self._fingerprint = fingerprint

    @classmethod
    def create(cls, dim: int, *, model: str, kind: str = "flat", hnsw_m: int = 32,
               ef_search: int = 64) -> VectorIndex:
        """An empty index.

        dim:       vector dimension (the embedding model's).
        model:     the embedding model the vectors come from (checked by ``open``).
        kind:      ``flat`` (exact search) or ``hnsw`` (graph search, faster on big corpora).
        hnsw_m:    HNSW neighbours per node.
        ef_search: HNSW candidates kept while searching (higher: better recall, slower).
        """
        if kind not in KINDS:
            raise StoreError(f"unknown index kind '{kind}'; known: {', '.join(KINDS)}")
        if not isinstance(dim, int) or dim < 1:
            raise StoreError(f"index dim must be a positive integer, got {dim!r}")
        faiss = _faiss()
        if kind == "flat":
            index = faiss.IndexFlatIP(dim)
        else:
            index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efSearch = ef_search
        return cls(index, [], model=model, kind=kind, ef_search=ef_search)

    @property
    def model(self) -> str:
        """The embedding model the vectors come from."""
        return self._model

    @property
    def dim(self) -> int:
        """Vector dimension."""
        return int(self._index.d)

    @property
    def kind(self) -> str:
        """``flat`` or ``hnsw``."""
        return self._kind

    @property
    def fingerprint(self) -> str:
        """What the index was built from, as given to ``save``."""
        return self._fingerprint

    @property
    def docs(self) -> list[dict]:
        """The documents, in insertion order (read-only by convention)."""
        return self._docs

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def _matrix(self, vectors: Any, what: str) -> Any:
        """``vectors`` as a C-contiguous float32 matrix of this index's dim."""
        import numpy as np

        if not isinstance(vectors, np.ndarray):
            raise StoreError(f"{what} must be a numpy array, got {type(vectors).__name__}")
        if vectors.ndim == 1:
            vectors = vectors[None, :]
        if vectors.ndim != 2:
            raise StoreError(f"{what} must have shape (n, {self.dim}), got {vectors.shape}")
        if vectors.shape[1] != self.dim:
            raise StoreError(f"{what} have dim {vectors.shape[1]} but the index has dim "
                             f"{self.dim} (model '{self._model}')")
        if not np.issubdtype(vectors.dtype, np.floating):
            raise StoreError(f"{what} must be floating point (float32), got {vectors.dtype}")
        if not np.isfinite(vectors).all():
            raise StoreError(f"{what} contain NaN or infinite values")
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def add(self, vectors: Any, docs: list[dict]) -> None:
        """Append ``vectors`` (float32 ``(n, dim)``, rows L2-normalised) and their ``n``
        JSON-able docs (e.g. ``{"id", "title", "text"}``)."""
        matrix = self._matrix(vectors, "vectors")
        if not isinstance(docs, list) or len(docs) != len(matrix):
            n = len(docs) if isinstance(docs, list) else type(docs).__name__
            raise StoreError(f"add() got {len(matrix)} vectors but {n} docs; "
                             "give a list with one doc per vector")
        for i, doc in enumerate(docs):
            if not isinstance(doc, dict):
                raise StoreError(f"doc {i} must be a dict, got {type(doc).__name__}")
            if "score" in doc:
                raise StoreError(f"doc {i} has a 'score' field, which search results use; "
                                 "rename it")
            try:
                json.dumps(doc)
            except (TypeError, ValueError) as e:
                raise StoreError(f"doc {i} is not JSON-serialisable: {e}") from None
        self._index.add(matrix)
        self._docs.extend(dict(d) for d in docs)

    def search(self, queries: Any, k: int) -> list[list[dict]]:
        """Per query (float32 ``(n, dim)`` or ``(dim,)``, rows L2-normalised), up to ``k``
        hits ``{"score": cosine, **doc}``, best first (fewer while the index holds fewer)."""
        matrix = self._matrix(queries, "queries")
        if not isinstance(k, int) or k < 1:
            raise StoreError(f"k must be a positive integer, got {k!r}")
        if len(self) == 0:
            return [[] for _ in range(len(matrix))]
        scores, ids = self._index.search(matrix, min(k, len(self)))
        return [[{"score": float(s), **self._docs[i]}
                 for s, i in zip(srow, irow, strict=True) if i >= 0]  # -1: no hit
                for srow, irow in zip(scores.tolist(), ids.tolist(), strict=True)]

    def save(self, directory: str | os.PathLike[str], *, fingerprint: str = "") -> Path:
        """Write the index to ``directory``, replacing any index there only once complete;
        ``fingerprint`` (what the index was built from) is kept in ``meta.json``."""
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT_VERSION, "model": self._model, "dim": self.dim,
                "kind": self._kind, "count": len(self), "fingerprint": fingerprint,
                "ef_search": self._ef_search}
        with replace_dir(target) as tmp:
            _faiss().write_index(self._index, str(tmp / "index.faiss"))
            with open(tmp / "docs.jsonl", "w", encoding="utf-8") as f:
                for doc in self._docs:
                    f.write(json.dumps(doc, ensure_ascii=False) + "\n")
            with open(tmp / "meta.json", "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2)
        self._fingerprint = fingerprint
        return target

    @classmethod
    def open(cls, directory: str | os.PathLike[str], *,
             expect_model: str | None = None) -> VectorIndex:
        """Reopen the index ``save`` wrote to ``directory`` without re-embedding anything;
        ``expect_model``: the embedding model queries will use (a different one is refused)."""
        where = Path(directory)
        found = current(where)
        if found is None or (found == where and not (found / "meta.json").is_file()):
            raise StoreError(f"no index at {where}; build it with `tailrace ingest`")
        if not (found / "meta.json").is_file():
            raise _corrupt(where, f"no meta.json in {found}")
        try:
            meta = json.loads((found / "meta.json").read_text(encoding="utf-8"))
            version, model, kind = meta["format"], meta["model"], meta["kind"]
            dim, count = int(meta["dim"]), int(meta["count"])
        except (ValueError, KeyError, TypeError) as e:
            raise _corrupt(where, f"bad meta.json ({e})") from None
        if kind not in KINDS:
            raise _corrupt(where, f"unknown kind '{kind}' in meta.json")
        if version != FORMAT_VERSION:
            raise StoreError(f"index at {where} has format {version}, this tailrace reads "
                             f"format {FORMAT_VERSION}; rebuild it with `tailrace ingest`")
        if expect_model is not None and model != expect_model:
            raise StoreError(f"index at {where} was built with embedding model '{model}' but "
                             f"this pipeline embeds queries with '{expect_model}'; rebuild it "
                             f"with `tailrace ingest --embedder {expect_model}` or use the "
                             "same embedder")
        faiss = _faiss()
        try:
            index = faiss.read_index(str(found / "index.faiss"))
        except Exception as e:
            raise _corrupt(where, f"cannot read index.faiss ({e})") from None
        docs = _read_docs(found / "docs.jsonl", where)
        if not index.ntotal == len(docs) == count or index.d != dim:
            raise StoreError(f"index at {where} is inconsistent: meta.json says {count} x "
                             f"{dim}, index.faiss holds {index.ntotal} x {index.d}, docs.jsonl "
                             f"holds {len(docs)} docs; rebuild it with `tailrace ingest`")
        ef_search = int(meta.get("ef_search", 64))
        if kind == "hnsw":
            index.hnsw.efSearch = ef_search
        return cls(index, docs, model=model, kind=kind, ef_search=ef_search,
                   fingerprint=str(meta.get("fingerprint", "")))


def _read_docs(path: Path, where: Path) -> list[dict]:
    """The documents of ``docs.jsonl`` (``where``: the index, for messages); StoreError
    naming the first bad line."""
    docs: list[dict] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    doc = json.loads(line)
                except ValueError:
                    doc = None
                if not isinstance(doc, dict):
                    raise _corrupt(where, f"docs.jsonl line {lineno} is not a JSON object")
                docs.append(doc)
    except (OSError, UnicodeDecodeError) as e:
        raise _corrupt(where, f"cannot read docs.jsonl ({e})") from None
    return docs
