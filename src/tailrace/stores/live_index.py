"""A live vector index: documents upserted and deleted by id while other pipelines query it.

Freshness: a change is visible to every ``search`` that starts after ``upsert``/``delete``
returned (one lock orders them). Durability (docs/stateful.md, "State and restart"): a
write-ahead log, fsynced with ``durable=True``, and atomic snapshots (``live_store``).
Documents past their TTL are dropped lazily. Indexes are shared in the process by name
(``open_live_index``): ``semantic_state`` writes one, ``retrieve`` (``live:NAME``) reads it.

    >>> import numpy as np, tempfile
    >>> ix = LiveIndex(tempfile.mkdtemp())
    >>> ix.upsert(["a", "b"], np.eye(2, dtype=np.float32), [{"id": "a"}, {"id": "b"}])
    2
    >>> ix.search(np.array([[0.0, 1.0]], dtype=np.float32), 1)
    [[{'id': 'b', 'score': 1.0}]]
    >>> ix.delete(["b"]), len(ix)
    (1, 1)
    >>> ix.close()
"""

from __future__ import annotations

import base64
import contextlib
import heapq
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engines.models import home
from ..errors import StoreError
from ..registry import Registry
from .live_store import FORMAT_VERSION, faiss, read_log, read_snapshot, write_snapshot


def _np() -> Any:
    import numpy as np

    return np


@dataclass(frozen=True)
class LiveIndexStats:
    """What a live index holds and has done since it was opened in this process."""

    name: str  # the index name (its directory for path names)
    docs: int  # documents searchable now
    version: int  # changes applied in this process (upserted + deleted documents)
    upserts: int  # documents upserted
    deletes: int  # documents deleted (that existed)
    expired: int  # documents dropped by TTL
    snapshots: int  # snapshots written
    wal_records: int  # changes in the log since the last snapshot
    model: str | None  # the embedding model of the vectors (None until the first upsert)


def _check_id(doc_id: Any, i: int) -> None:
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise StoreError(f"document {i}: id must be a string or an integer, got "
                         f"{type(doc_id).__name__} {doc_id!r}")


class LiveIndex:
    """Unit-norm vectors searchable by cosine similarity, changed by document id."""

    def __init__(self, directory: str | os.PathLike[str], *, name: str | None = None,
                 clock: Callable[[], float] = time.time, durable: bool = False) -> None:
        """Open (restore) or create the index whose snapshot and log live in ``directory``
        (created if missing). ``name``: shown in errors and statistics (default: the
        directory); ``clock``: epoch seconds for TTLs and snapshot periods; ``durable``:
        fsync the log on every change (survives power loss, costs a disk sync)."""
        self.directory = Path(directory)
        self.name = name or str(directory)
        self.ttl_s: float | None = None  # documents expire ttl_s after their time
        self.snapshot_every_s: float | None = 30.0  # None: only on close()
        self.cursor: dict[str, Any] = {}  # where feeders stopped (merged, saved with changes)
        self._clock = clock
        self._durable = durable
        self._lock = threading.RLock()
        self._snap_lock = threading.Lock()
        self._index: Any = None  # faiss IndexIDMap2 over IndexFlatIP, once dim is known
        self._model: str | None = None
        self._expected: set[str] = set()  # query models of readers (retrieve stages)
        self._docs: dict[int, dict] = {}  # key -> document
        self._meta: dict[int, tuple[Any, float, float | None]] = {}  # key -> (id, t, expiry)
        self._keys: dict[Any, int] = {}  # document id -> key
        self._expiry: list[tuple[float, int]] = []  # heap of (expiry, key)
        self._next_key = 0
        self._seq = 0  # last change written to the log
        self._counts = {"upserts": 0, "deletes": 0, "expired": 0, "snapshots": 0, "wal": 0}
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"live index '{self.name}': cannot create {self.directory}: "
                             f"{e.strerror}") from None
        self._restore()
        self._last_snapshot = self._clock()
        self._wal = open(self.directory / "wal.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    # -- reading ----------------------------------------------------------------------
    @property
    def model(self) -> str | None:
        """The embedding model of the stored vectors (None while empty and new)."""
        return self._model

    def __len__(self) -> int:
        return len(self._docs)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._keys

    def get(self, doc_id: Any) -> dict | None:
        """The stored document with this id, or None."""
        with self._lock:
            key = self._keys.get(doc_id)
            return None if key is None else dict(self._docs[key])

    def expect_model(self, model: str | None) -> None:
        """Refuse vectors of another embedding model than ``model``, the one a reader embeds
        queries with (None: no check)."""
        if model is None:
            return
        with self._lock:
            if self._model is not None and self._model != model:
                raise StoreError(f"live index '{self.name}' holds vectors of embedding model "
                                 f"'{self._model}' but this pipeline embeds queries with "
                                 f"'{model}'; use the same embedder on both sides")
            self._expected.add(model)

    def search(self, queries: Any, k: int) -> list[list[dict]]:
        """Per query (float32 ``(n, dim)`` or ``(dim,)``, rows L2-normalised), up to ``k``
        hits ``{**doc, "score": cosine}``, best first (fewer while the index holds fewer)."""
        np = _np()
        q = np.asarray(queries, dtype=np.float32)
        if q.ndim == 1:
            q = q[None, :]
        if not isinstance(k, int) or k < 1:
            raise StoreError(f"k must be a positive integer, got {k!r}")
        with self._lock:
            if self._expiry and self._expiry[0][0] <= self._clock():
                self._expire(self._clock())
            if not self._docs:
                return [[] for _ in range(len(q))]
            q = self._matrix(q, "queries")
            scores, keys = self._index.search(q, min(k, len(self._docs)))
            docs = self._docs
            return [[{**docs[key], "score": float(s)}
                     for s, key in zip(srow, krow, strict=True) if key >= 0]
                    for srow, krow in zip(scores.tolist(), keys.tolist(), strict=True)]

    def statistics(self) -> LiveIndexStats:
        """A snapshot of the counters (see ``LiveIndexStats``)."""
        with self._lock:
            c = self._counts
            return LiveIndexStats(self.name, len(self._docs), c["upserts"] + c["deletes"],
                                  c["upserts"], c["deletes"], c["expired"], c["snapshots"],
                                  c["wal"], self._model)

    # -- changing ---------------------------------------------------------------------
    def upsert(self, ids: Sequence[Any], vectors: Any, docs: Sequence[dict], *,
               times: Sequence[float] | None = None, model: str | None = None,
               cursor: dict[str, Any] | None = None) -> int:
        """Insert or replace documents by id; returns the number of documents upserted.

        ids:     one id (string or integer) per document; a later duplicate wins.
        vectors: float32 array ``(n, dim)``, rows L2-normalised.
        docs:    ``n`` JSON-able dicts returned by searches.
        times:   per document, seconds since the epoch its TTL counts from (default: now).
        model:   the embedding model of ``vectors`` (checked against earlier vectors).
        cursor:  feeder positions after these documents (merged into ``cursor``, saved
                 with them).
        """
        np = _np()
        n = len(ids)
        if len(docs) != n or (times is not None and len(times) != n):
            raise StoreError(f"upsert got {n} ids, {len(docs)} docs and "
                             f"{'no' if times is None else len(times)} times; give one of "
                             "each per document")
        if n == 0:
            if cursor is not None:
                self._change([{"op": "cursor", "cursor": cursor}], cursor)
            return 0
        matrix = np.asarray(vectors, dtype=np.float32)
        if matrix.ndim != 2 or len(matrix) != n:
            raise StoreError(f"upsert got {n} documents but vectors of shape {matrix.shape}")
        with self._lock:
            self._check_model(model)
            matrix = self._matrix(matrix, "vectors")
            now = self._clock()
            lines = []
            for i in range(n):
                _check_id(ids[i], i)
                if not isinstance(docs[i], dict):
                    raise StoreError(f"document {i} must be a dict, got "
                                     f"{type(docs[i]).__name__}")
                t = float(times[i]) if times is not None else now
                lines.append({"op": "upsert", "id": ids[i], "t": t,
                              "exp": t + self.ttl_s if self.ttl_s is not None else None,
                              "doc": docs[i], "model": model,
                              "vec": base64.b64encode(matrix[i].tobytes()).decode()})
            if cursor is not None:
                lines.append({"op": "cursor", "cursor": cursor})
            self._change(lines, cursor, matrix)
            return n

    def delete(self, ids: Sequence[Any], *, cursor: dict[str, Any] | None = None) -> int:
        """Delete documents by id (unknown ids are ignored); returns how many existed.
        ``cursor``: the feeder's position after this change (saved with it)."""
        for i, doc_id in enumerate(ids):
            _check_id(doc_id, i)
        with self._lock:
            found = sum(1 for d in ids if d in self._keys)
            lines: list[dict] = [{"op": "delete", "ids": list(ids)}]
            if cursor is not None:
                lines.append({"op": "cursor", "cursor": cursor})
            self._change(lines, cursor)
            return found

    def _change(self, lines: list[dict], cursor: dict | None, matrix: Any = None) -> None:
        """Log ``lines`` (validated, one write), then apply them; lock held by the caller."""
        if self._closed:
            raise StoreError(f"live index '{self.name}' is closed")
        encode = json.JSONEncoder(ensure_ascii=False).encode
        out = []
        seq = self._seq
        for line in lines:
            seq += 1
            line["seq"] = seq
            try:
                out.append(encode(line))
            except (TypeError, ValueError) as e:
                raise StoreError(f"live index '{self.name}': document "
                                 f"{line.get('id', '')!r} is not JSON-serialisable: {e}") \
                    from None
        self._wal.write("\n".join(out) + "\n")
        self._wal.flush()
        if self._durable:
            os.fsync(self._wal.fileno())
        self._seq = seq
        self._apply(lines, matrix)
        every = self.snapshot_every_s
        if every is not None and self._clock() - self._last_snapshot >= every:
            self.snapshot()

    def _apply(self, lines: list[dict], matrix: Any = None) -> None:
        """Apply logged changes in order (live or replayed); upserts grouped per run."""
        np = _np()
        run: list[int] = []
        for i, line in enumerate(lines + [{"op": "end"}]):
            if line["op"] == "upsert":
                run.append(i)
                continue
            if run:
                rows = matrix[run] if matrix is not None else np.stack(
                    [np.frombuffer(base64.b64decode(lines[j]["vec"]), dtype=np.float32)
                     for j in run])
                self._apply_upserts([lines[j] for j in run], rows)
                run = []
            if line["op"] == "delete":
                self._remove([self._keys[d] for d in dict.fromkeys(line["ids"])
                              if d in self._keys], "deletes")
            elif line["op"] == "cursor":
                self.cursor = {**self.cursor, **line["cursor"]}
        self._counts["wal"] += len(lines)

    def _apply_upserts(self, lines: list[dict], rows: Any) -> None:
        np = _np()
        if self._index is None:
            self._index = faiss().IndexIDMap2(faiss().IndexFlatIP(int(rows.shape[1])))
        if self._model is None:
            self._model = next((ln["model"] for ln in lines if ln.get("model")), None)
        last = {ln["id"]: i for i, ln in enumerate(lines)}  # a later duplicate wins
        self._remove([self._keys[d] for d in last if d in self._keys], None)
        now = self._clock()
        keep = [i for i in last.values() if lines[i]["exp"] is None or lines[i]["exp"] > now]
        self._counts["expired"] += len(last) - len(keep)
        self._counts["upserts"] += len(last)
        if not keep:
            return
        keys = np.arange(self._next_key, self._next_key + len(keep), dtype=np.int64)
        self._next_key += len(keep)
        self._index.add_with_ids(np.ascontiguousarray(rows[keep]), keys)
        for key, i in zip(keys.tolist(), keep, strict=True):
            self._track(key, lines[i])

    def _track(self, key: int, d: dict) -> None:
        """Index document ``d`` (``id``, ``t``, ``exp``, ``doc``) under ``key``."""
        self._docs[key] = d["doc"]
        self._meta[key] = (d["id"], d["t"], d["exp"])
        self._keys[d["id"]] = key
        if d["exp"] is not None:
            heapq.heappush(self._expiry, (d["exp"], key))

    def _remove(self, keys: list[int], counter: str | None) -> None:
        if not keys:
            return
        for key in keys:
            del self._docs[key]
            doc_id = self._meta.pop(key)[0]
            del self._keys[doc_id]
        np = _np()
        self._index.remove_ids(np.asarray(keys, dtype=np.int64))
        if counter:
            self._counts[counter] += len(keys)

    def _expire(self, now: float) -> None:
        gone = []
        while self._expiry and self._expiry[0][0] <= now:
            exp, key = heapq.heappop(self._expiry)
            meta = self._meta.get(key)
            if meta is not None and meta[2] == exp:  # still the current version
                gone.append(key)
        self._remove(gone, "expired")

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        if self._model is not None and model != self._model:
            raise StoreError(f"live index '{self.name}' holds vectors of embedding model "
                             f"'{self._model}'; refusing vectors of '{model}'")
        wrong = self._expected - {model}
        if wrong:
            raise StoreError(f"live index '{self.name}' is queried with embedding model "
                             f"'{sorted(wrong)[0]}'; refusing vectors of '{model}' (use the "
                             "same embedder on both sides)")

    def _matrix(self, m: Any, what: str) -> Any:
        np = _np()
        dim = int(self._index.d) if self._index is not None else m.shape[1]
        if m.ndim != 2 or m.shape[1] != dim:
            raise StoreError(f"live index '{self.name}': {what} must have shape (n, {dim}), "
                             f"got {m.shape}")
        if not np.isfinite(m).all():
            raise StoreError(f"live index '{self.name}': {what} contain NaN or infinite "
                             "values")
        return np.ascontiguousarray(m, dtype=np.float32)

    # -- persistence ------------------------------------------------------------------
    def snapshot(self) -> Path:
        """Write the whole index to ``DIR/snapshot`` atomically and retire the log it covers.

        The state is copied under the lock (searches wait only for the copy); the files
        are written after it, so changes keep flowing into a fresh log meanwhile. The
        retired log is deleted only once the new snapshot is fsynced and linked.
        """
        with self._snap_lock:
            with self._lock:
                data = (faiss().serialize_index(self._index) if self._index is not None else None)
                docs = [{"key": k, "id": m[0], "t": m[1], "exp": m[2], "doc": self._docs[k]}
                        for k, m in self._meta.items()]
                meta: dict[str, Any] = {
                    "format": FORMAT_VERSION, "name": self.name, "model": self._model,
                    "count": len(docs), "seq": self._seq, "next_key": self._next_key,
                    "cursor": self.cursor, "saved_at": self._clock()}
                if self._wal.tell() > 0:  # retire the log: the snapshot covers it
                    self._wal.close()
                    os.replace(self.directory / "wal.jsonl",
                               self.directory / f"wal-{self._seq:012d}.jsonl")
                    self._wal = open(self.directory / "wal.jsonl", "a",  # noqa: SIM115
                                     encoding="utf-8")
                self._counts["wal"] = 0
                self._last_snapshot = self._clock()
            target = write_snapshot(self.directory, data, docs, meta)  # durable, linked
            self._drop_logs(int(meta["seq"]))
            self._counts["snapshots"] += 1
            return target

    def _drop_logs(self, seq: int) -> None:
        """Delete the retired logs that the linked snapshot (covering ``seq``) holds."""
        for old in self.directory.glob("wal-*.jsonl"):
            if int(old.stem[4:]) <= seq:
                old.unlink(missing_ok=True)

    def _restore(self) -> None:
        loaded = read_snapshot(self.directory, self.name)
        if loaded is not None:
            meta, docs, self._index = loaded
            self._model, self._seq = meta["model"], meta["seq"]
            self._next_key, self.cursor = meta["next_key"], meta.get("cursor") or {}
            for d in docs:
                self._track(d["key"], d)
            self._expire(self._clock())
            # a crash after the snapshot's switch left the logs it covers (read-only disk:
            # keep them, replaying them skips their changes anyway)
            with contextlib.suppress(OSError):
                self._drop_logs(self._seq)
        for log in sorted(self.directory.glob("wal-*.jsonl")) + [self.directory / "wal.jsonl"]:
            lines = read_log(log, self._seq, self.name)
            if lines:
                self._seq = lines[-1]["seq"]
                self._apply(lines)
        self._counts["upserts"] = self._counts["deletes"] = 0

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` first when the index closes (e.g. stop a feeder thread)."""
        self._on_close.append(callback)

    def close(self) -> None:
        """Stop feeders, snapshot what the log holds, close the log (idempotent)."""
        if self._closed:
            return
        for cb in self._on_close:
            cb()
        if self._wal.tell() > 0 or self._counts["wal"] > 0:  # changes since the snapshot
            self.snapshot()  # (an old log's or a retired log's, replayed at opening)
        with self._lock:
            self._closed = True
            self._wal.close()
        _forget(self)


# -- the process-wide registry -------------------------------------------------------
_OPEN: Registry[LiveIndex] = Registry("live indexes", at_exit=True)


def live_dir(name: str) -> Path:
    """Where live index ``name`` lives: ``$TAILRACE_HOME/live/NAME``; a path (it contains a
    path separator or starts with '.') is used as is."""
    if not name:
        raise StoreError("a live index needs a name, like 'news'")
    if os.sep in name or name.startswith("."):
        return Path(name)
    return home() / "live" / name


def open_live_index(name: str, *, clock: Callable[[], float] | None = None) -> LiveIndex:
    """The live index ``name`` (see ``live_dir``) of this process, restored from disk on
    first use; ``clock``: the clock of a newly opened index (tests pass a virtual one)."""
    directory = live_dir(name)
    key = str(directory.resolve())
    return _OPEN.get(key, lambda: LiveIndex(directory, name=name, clock=clock or time.time))


def _forget(index: LiveIndex) -> None:
    with _OPEN.lock:
        for k, v in _OPEN.items():
            if v is index:
                _OPEN.pop(k)


def close_live_indexes() -> None:
    """Close every open live index (final snapshots); runs at interpreter exit too."""
    _OPEN.close_all()
