"""A faiss vector index saved to disk together with its documents and metadata.

Vectors are expected L2-normalised, so inner product is cosine similarity. A saved index
is a directory of ``index.faiss``, ``docs.jsonl`` (one document per vector, in order),
``meta.json`` (format, model, dim, kind, count, fingerprint, efSearch) and ``sparse/``, a
BM25 index (``sparse_index``; built and cached on first keyword search if missing),
written as one ``atomic`` version. faiss and numpy are imported on first use.

Three searches: ``search`` (dense: cosine of the query vectors), ``search_text`` (sparse:
BM25 of the query words) and ``hybrid_search`` (both, fused by weighted reciprocal rank,
``Fusion``). Each takes ``allow``, a ``Selection`` made by ``select(filter)``, and searches
only the documents it holds, so k hits come back whenever k of them match.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StoreError
from .atomic import current, replace_dir
from .filters import Filter
from .live_store import faiss as _faiss
from .sparse_index import SparseIndex, rrf

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KINDS = ("flat", "hnsw")


@dataclass(frozen=True)
class Fusion:
    """How ``hybrid_search`` fuses the dense and the sparse ranking: each document scores
    ``dense / (k + dense rank) + sparse / (k + sparse rank)`` over the top ``candidates`` of
    each (a document missing from a ranking gets nothing from it)."""

    k: int = 60
    dense: float = 1.0
    sparse: float = 1.0
    candidates: int = 50


@dataclass(frozen=True, eq=False)
class Selection:
    """The documents a filter keeps, ready for the searches (``VectorIndex.select``)."""

    filter: Filter
    mask: Any  # bool array over rows
    rows: Any  # int64 array of the kept rows
    selector: Any  # faiss IDSelectorBitmap over ``mask`` (holds ``bitmap`` alive)
    bitmap: Any
    vectors: dict = field(default_factory=dict)  # "rows": their vectors, once needed

    def __len__(self) -> int:
        return len(self.rows)


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
        self._sparse: SparseIndex | None = None
        self._dir: Path | None = None  # the version folder ``open`` read (sparse cache)

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
        self._dir = None  # no longer what the saved folder holds

    def _check_k(self, k: Any) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise StoreError(f"k must be a positive integer, got {k!r}")

    def select(self, where: Filter) -> Selection:
        """The documents ``where`` keeps (a ``filters.compile_filter`` result), for the
        searches' ``allow``; computed once, reused by every search."""
        import numpy as np

        mask = where.mask(self._docs)
        bitmap = np.packbits(mask, bitorder="little")
        selector = _faiss().IDSelectorBitmap(bitmap)
        return Selection(where, mask, np.flatnonzero(mask), selector, bitmap)

    def search(self, queries: Any, k: int, *, allow: Selection | None = None) -> list[list[dict]]:
        """Per query (float32 ``(n, dim)`` or ``(dim,)``, rows L2-normalised), up to ``k``
        hits ``{"score": cosine, **doc}``, best first (fewer while the index, or ``allow``,
        holds fewer)."""
        return [[{"score": s, **self._docs[i]} for i, s in row]
                for row in self.search_rows(queries, k, allow=allow)]

    def search_rows(self, queries: Any, k: int, *,
                    allow: Selection | None = None) -> list[list[tuple[int, float]]]:
        """``search`` as ``(row, cosine)`` pairs."""
        import numpy as np

        matrix = self._matrix(queries, "queries")
        self._check_k(k)
        n = len(self) if allow is None else len(allow)
        if n == 0:
            return [[] for _ in range(len(matrix))]
        want = min(k, n)
        if allow is None:
            scores, ids = self._index.search(matrix, want)
        else:
            faiss = _faiss()
            params = (faiss.SearchParametersHNSW(sel=allow.selector,
                                                 efSearch=max(self._ef_search, want))
                      if self._kind == "hnsw" else faiss.SearchParameters(sel=allow.selector))
            scores, ids = self._index.search(matrix, want, params=params)
            short = (ids < 0).any(axis=1)
            if short.any():  # the HNSW graph walk ran out of allowed nodes: exact over them
                if "rows" not in allow.vectors:  # kept for the next short walk
                    allow.vectors["rows"] = self._index.reconstruct_batch(allow.rows)
                sims = matrix[short] @ allow.vectors["rows"].T
                top = self._top(sims, want)
                ids[short] = allow.rows[top]
                scores[short] = np.take_along_axis(sims, top, axis=1)
        return [[(int(i), float(s)) for s, i in zip(srow, irow, strict=True) if i >= 0]
                for srow, irow in zip(scores.tolist(), ids.tolist(), strict=True)]

    @staticmethod
    def _top(sims: Any, k: int) -> Any:
        import numpy as np

        part = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(sims, part, axis=1), axis=1, kind="stable")
        return np.take_along_axis(part, order, axis=1)

    def sparse(self) -> SparseIndex:
        """The BM25 index over the documents: loaded from the saved ``sparse/`` folder, or
        built (and cached there when the folder is writable)."""
        if self._sparse is not None and len(self._sparse) == len(self._docs):
            return self._sparse
        found = None
        if self._dir is not None:
            found = SparseIndex.load(self._dir / "sparse", len(self._docs))
        if found is None:
            found = SparseIndex.build(self._docs)
            if self._dir is not None:
                self._cache_sparse(found, self._dir)
        self._sparse = found
        return found

    @staticmethod
    def _cache_sparse(sparse: SparseIndex, where: Path) -> None:
        """Write ``sparse`` to ``where/sparse`` (a temp folder renamed into place; a stale
        one, e.g. of an older tokenizer, moved away first)."""
        tmp = old = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".sparse-", dir=where))
            os.chmod(tmp, 0o755)
            sparse.save(tmp)
            if (where / "sparse").exists():
                old = Path(tempfile.mkdtemp(prefix=".sparse-old-", dir=where))
                os.replace(where / "sparse", old / "sparse")
            os.replace(tmp, where / "sparse")
        except OSError as e:  # e.g. a read-only index: search works, rebuilt next open
            log.warning("could not cache the BM25 index in %s (%s); it is rebuilt on each "
                        "open", where, e)
        finally:
            for leftover in (tmp, old):
                if leftover is not None and leftover.exists():
                    shutil.rmtree(leftover, ignore_errors=True)

    def search_text(self, texts: list[str], k: int, *,
                    allow: Selection | None = None) -> list[list[dict]]:
        """Per query text, up to ``k`` hits ``{"score": BM25, **doc}``, best first, among
        the documents sharing a word with it (and held by ``allow``)."""
        self._check_k(k)
        rows = self.sparse().search(texts, k, None if allow is None else allow.mask)
        return [[{"score": s, **self._docs[i]} for i, s in row] for row in rows]

    def hybrid_search(self, queries: Any, texts: list[str], k: int, *,
                      fusion: Fusion = Fusion(),
                      allow: Selection | None = None) -> list[list[dict]]:
        """Per query (its vector in ``queries`` and its words in ``texts``), up to ``k``
        hits ``{"score": fused, **doc}``: the dense and sparse top ``fusion.candidates``
        fused by weighted reciprocal rank, best first."""
        self._check_k(k)
        n = len(self._matrix(queries, "queries"))
        if len(texts) != n:
            raise StoreError(f"hybrid_search got {n} query vectors but {len(texts)} query texts")
        depth = max(k, fusion.candidates)
        dense = self.search_rows(queries, depth, allow=allow)
        sparse = self.sparse().search(texts, depth, None if allow is None else allow.mask)
        out = []
        for d, s in zip(dense, sparse, strict=True):
            fused = rrf([[i for i, _ in d], [i for i, _ in s]], [fusion.dense, fusion.sparse],
                        fusion.k, top=k)
            out.append([{"score": sc, **self._docs[i]} for i, sc in fused])
        return out

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
                f.writelines(json.dumps(doc, ensure_ascii=False) + "\n" for doc in self._docs)
            with open(tmp / "meta.json", "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2)
            self._sparse = SparseIndex.build(self._docs)
            self._sparse.save(tmp / "sparse")
        self._fingerprint = fingerprint
        self._dir = current(target)
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
        opened = cls(index, docs, model=model, kind=kind, ef_search=ef_search,
                     fingerprint=str(meta.get("fingerprint", "")))
        opened._dir = found
        return opened


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
