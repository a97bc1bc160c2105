"""Streaming semantic state: ``semantic_state`` keeps a live vector index up to date.

The stage upserts (or deletes) documents by id in a process-wide live index that
``retrieve`` stages of any pipeline read with ``index: live:NAME``. Documents come either
as the stage's own records (any source: a JSONL file, the HTTP runs endpoint, a Python
iterable such as ``follow_jsonl``) or, with ``follow: FILE``, from a JSONL file that a
background feeder tails like ``tail -f`` while the pipeline's records pass through.

Freshness bound: a document is visible to every search that starts after the
``semantic_state`` call that ingested it returns, i.e. at most one micro-batch
(embedding <= ``max_batch`` documents) after the stage receives it. With ``follow:``, a
line appended to the file is visible within one feeder poll: at most ``poll_ms`` plus the
time to embed and upsert one batch of at most ``max_batch`` lines. In follow mode the
stage holds its first records until the feeder has read the file to its end once, so
those records see every document the file held when the run started.

State: the index logs every change before applying it and snapshots periodically
(``snapshot_every_s``) and when the process exits; on restart it is restored from the
snapshot plus the log, and a feeder resumes at the file offset saved with its last
change, so no acknowledged document is lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..engines import open_engine
from ..errors import TailraceError
from .core import FieldError, _get, positive_int
from .registry import LinkContext, OpDef, OpRuntime, Param, register
from .retrieval import _ENGINE_HINT, link_engine

_LOG = logging.getLogger(__name__)


class JsonlTail:
    """The complete JSON lines appended to a file since the last read (``tail -f``).

    A partial last line waits for its newline; a file that shrank below the offset was
    replaced and is read again from its start; a line that is not a JSON object is
    skipped, counted in ``bad_lines`` and described in ``last_problem``.
    """

    def __init__(self, path: str, offset: int = 0) -> None:
        """Start reading ``path`` at byte ``offset``.

        path:   the JSONL file (it may not exist yet).
        offset: the byte offset to resume from (a saved cursor).
        """
        self.path = path
        self.offset = offset
        self.bad_lines = 0
        self.last_problem = ""

    def read(self, max_lines: int) -> list[tuple[dict, int]]:
        """Up to ``max_lines`` new records, each with the file offset just after it.

        max_lines: the most records to return.
        """
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            return []
        if size < self.offset:
            _LOG.warning("%s shrank below offset %d: reading it again from the start",
                         self.path, self.offset)
            self.offset = 0
        if size == self.offset:
            return []
        out: list[tuple[dict, int]] = []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while len(out) < max_lines:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break  # nothing more, or a line still being written
                start, self.offset = self.offset, self.offset + len(line)
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    rec = e
                if not isinstance(rec, dict):
                    self.bad_lines += 1
                    self.last_problem = f"{self.path}: line at byte {start} is not a JSON object"
                    _LOG.warning("%s; skipped", self.last_problem)
                    continue
                out.append((rec, self.offset))
        return out


class follow_jsonl:  # noqa: N801 - used like a generator function
    """The records of a JSONL file, then those appended to it, until ``stop`` is set.

    Iterable (blocking) and async-iterable: a pipeline source gets each record as soon
    as it is read, e.g. ``p.source(follow_jsonl("news.jsonl", stop=ev))``.
    """

    def __init__(self, path: str, *, poll_s: float = 0.05,
                 stop: threading.Event | None = None, offset: int = 0) -> None:
        """Follow ``path`` from byte ``offset``.

        path:   the JSONL file to follow (it may not exist yet).
        poll_s: seconds between looks at the end of the file.
        stop:   an event that ends the iteration (None: follow forever).
        offset: the byte offset to start at.
        """
        self.tail = JsonlTail(path, offset)
        self.poll_s = poll_s
        self.stop = stop or threading.Event()

    def __iter__(self) -> Iterator[dict]:
        while not self.stop.is_set():
            got = self.tail.read(256)
            yield from (rec for rec, _ in got)
            if not got:
                self.stop.wait(self.poll_s)

    async def __aiter__(self) -> AsyncIterator[dict]:
        while not self.stop.is_set():
            got = self.tail.read(256)
            for rec, _ in got:
                yield rec
            if not got:
                await asyncio.sleep(self.poll_s)


def doc_time(value: Any) -> float:
    """Seconds since the epoch from a number or an ISO 8601 text (``2025-01-31T12:00:00Z``).

    value: the record's time field.

    >>> doc_time(1700000000), doc_time("2023-11-14T22:13:20Z")
    (1700000000.0, 1700000000.0)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise FieldError(f"time must be seconds since the epoch or an ISO 8601 text like "
                     f"2025-01-31T12:00:00Z, got {value!r}")


class Ingester:
    """Turns document records into live-index changes (shared by both feeding modes)."""

    def __init__(self, index: Any, params: dict) -> None:
        """Bind the index and the stage's field names.

        index:  the live index to change.
        params: the stage's parameters (``doc_id``, ``text``, ``vector``, ``time``, ``delete``).
        """
        self.index = index
        self.engine = open_engine(params["_engine"]) if params.get("_engine") else None
        self.model = params.get("_model")
        self.id, self.text, self.vector = params["doc_id"], params["text"], params.get("vector")
        self.time, self.delete = params.get("time"), params["delete"]

    def _change(self, r: Any) -> tuple[str, Any, Any, float | None]:
        """(action, id, text or vector, time) of one record; FieldError if malformed."""
        doc_id = _get(r, self.id)
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
            raise FieldError(f"field '{self.id}' (the document id) must be a string or an "
                             f"integer, got {type(doc_id).__name__}")
        if r.get(self.delete):
            return "delete", doc_id, None, None
        t = doc_time(_get(r, self.time)) if self.time else None
        if self.vector:
            return "upsert", doc_id, _get(r, self.vector), t
        text = _get(r, self.text)
        if not isinstance(text, str):
            raise FieldError(f"field '{self.text}' must be text, got {type(text).__name__}")
        return "upsert", doc_id, text, t

    def ingest(self, records: list, errors: list, cursor: dict | None = None) -> list:
        """Apply records in order (runs of upserts embedded together); returns the good ones.

        records: document records.
        errors:  receives ``(record, exception)`` for each malformed record.
        cursor:  the feeder position after the last record (saved with the change).
        """
        good: list = []
        run: list = []
        for r in records:
            try:
                change = self._change(r)
            except FieldError as e:
                errors.append((r, e))
                continue
            if change[0] == "delete":
                good += self._upsert(run, errors)
                run = []
                try:
                    self.index.delete([change[1]])
                    good.append(r)
                except TailraceError as e:
                    errors.append((r, e))
            else:
                run.append((r, change))
        return good + self._upsert(run, errors, cursor)

    def _upsert(self, run: list, errors: list, cursor: dict | None = None) -> list:
        """Upsert a run of records in one call; all of them fail together if it fails."""
        if not run:
            if cursor is not None:
                self.index.upsert([], None, [], cursor=cursor)
            return []
        import numpy as np

        payload = [c[2] for _, c in run]
        docs = [{k: v for k, v in r.items() if not k.startswith("_") and k != self.vector}
                for r, _ in run]
        times = [c[3] for _, c in run]
        try:
            vecs = (np.stack([np.asarray(v, dtype=np.float32) for v in payload])
                    if self.vector else self.engine.embed(payload))  # type: ignore[union-attr]
            self.index.upsert([c[1] for _, c in run], vecs, docs, model=self.model,
                              cursor=cursor, times=None if self.time is None else times)
        except (TailraceError, ValueError) as e:
            if cursor is not None:  # a feeder: stop rather than skip documents
                raise
            errors.extend((r, e) for r, _ in run)
            return []
        return [r for r, _ in run]


@dataclass(frozen=True)
class FeederStats:
    """What a follow feeder has done: lines ingested, bad lines, polls, batch times."""

    path: str
    offset: int
    lines: int
    bad_lines: int
    errors: int
    polls: int
    max_batch_ms: float
    failure: str | None


class Feeder:
    """A thread that tails a JSONL file into a live index until the index closes."""

    def __init__(self, index: Any, ingester: Ingester, path: str, poll_s: float,
                 max_batch: int) -> None:
        """Start following ``path`` from the offset saved in the index (if the same file).

        index:     the live index (its ``cursor`` holds the saved offset).
        ingester:  turns records into index changes.
        path:      the JSONL file to follow.
        poll_s:    seconds between looks at the end of the file.
        max_batch: the most lines per change.
        """
        self.path = os.path.abspath(path)
        self.key = "follow:" + self.path
        self.tail = JsonlTail(self.path, int(index.cursor.get(self.key, 0)))
        self.ingester, self.poll_s, self.max_batch = ingester, poll_s, max_batch
        self.caught_up = threading.Event()
        self.polls = self.lines = self.errors = 0
        self.max_batch_s = 0.0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"tailrace-follow-{os.path.basename(path)}")
        index.on_close(self.stop)
        self._thread.start()

    def _loop(self) -> None:
        errors: list = []
        try:
            while not self._stop.is_set():
                got = self.tail.read(self.max_batch)
                if got:
                    t0 = time.perf_counter()
                    cursor = {self.key: got[-1][1]}
                    self.ingester.ingest([r for r, _ in got], errors, cursor)
                    self.max_batch_s = max(self.max_batch_s, time.perf_counter() - t0)
                    self.lines += len(got)
                    for r, e in errors:
                        _LOG.warning("%s: document %r skipped: %s", self.path, r, e)
                    self.errors += len(errors)
                    errors.clear()
                self.polls += 1
                if len(got) < self.max_batch:
                    self.caught_up.set()
                    self._stop.wait(self.poll_s)
        except BaseException as e:  # noqa: BLE001 - reported to the stage's records
            self.failure = e
            _LOG.error("feeder for %s failed: %s", self.path, e)
        finally:
            self.caught_up.set()

    def stop(self) -> None:
        """Stop following and wait for the batch in progress."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def statistics(self) -> FeederStats:
        """A snapshot of the feeder's counters."""
        return FeederStats(self.path, self.tail.offset, self.lines, self.tail.bad_lines,
                           self.errors, self.polls, self.max_batch_s * 1000,
                           None if self.failure is None else str(self.failure))


_FEEDERS: dict[tuple[int, str], Feeder] = {}
_FEEDERS_LOCK = threading.Lock()


def feeder_for(index: Any, path: str) -> Feeder | None:
    """The running feeder of ``index`` that follows ``path``, if any.

    index: a live index.
    path:  the followed file.
    """
    return _FEEDERS.get((id(index), os.path.abspath(path)))


def _start_feeder(index: Any, ingester: Ingester, params: dict) -> Feeder:
    key = (id(index), os.path.abspath(params["follow"]))
    with _FEEDERS_LOCK:
        feeder = _FEEDERS.get(key)
        if feeder is None or feeder._stop.is_set() or feeder.failure is not None:
            feeder = Feeder(index, ingester, params["follow"], params["poll_ms"] / 1000,
                            params["max_batch"])
            _FEEDERS[key] = feeder
            index.on_close(lambda: _FEEDERS.pop(key, None))
        return feeder


def _build_semantic(params: dict, contract: Any) -> OpRuntime:
    from ..stores.live_index import open_live_index

    index = open_live_index(params["index"])
    index.ttl_s = params.get("ttl_s")
    index.snapshot_every_s = params["snapshot_every_s"]
    ingester = Ingester(index, params)
    out, name = params.get("output"), params["index"]

    if params.get("follow"):
        feeder = _start_feeder(index, ingester, params)

        def passthrough(batch: list, errors: list) -> list:
            feeder.caught_up.wait()
            if feeder.failure is not None:
                e = TailraceError(f"the feeder of live index '{name}' following "
                                  f"{feeder.path} failed: {feeder.failure}")
                errors.extend((r, e) for r in batch)
                return []
            return batch

        return OpRuntime("map", batch_fn=passthrough)

    def batch_fn(batch: list, errors: list) -> list:
        good = ingester.ingest(batch, errors)
        if out is None:
            return good
        size = len(index)
        return [{**r, out: {"index": name, "action": "delete" if r.get(ingester.delete)
                            else "upsert", "docs": size}} for r in good]

    return OpRuntime("map", batch_fn=batch_fn, max_batch=params["max_batch"])


def _prepare_semantic(params: dict, ctx: LinkContext) -> dict:
    if (params.get("engine") is None) == (params.get("vector") is None):
        raise ValueError("semantic_state needs exactly one of 'engine' (an embedding engine "
                         "for the text field) or 'vector' (a field holding the vector)")
    if params.get("follow") and params.get("vector"):
        raise ValueError("'follow' reads raw lines, so it needs 'engine' to embed them, "
                         "not 'vector'")
    if params.get("engine"):
        params = link_engine(params, ctx, "embed")
        params["_model"] = params["_engine"].get("model")
    return params


def _fields(p: dict) -> tuple:
    if p.get("follow"):
        return (), ()
    reads = (p["doc_id"], p.get("vector") or p["text"]) + ((p["time"],) if p.get("time") else ())
    return reads, ((p["output"],) if p.get("output") else ())


def _positive(v: Any) -> bool:
    return not isinstance(v, bool) and v > 0


register(OpDef(
    "semantic_state", "map", _build_semantic,
    (Param("index", (str,), required=True, want="a live index name (retrieve reads it as "
                                                  "live:NAME) or directory"),
     Param("engine", (str,), want=_ENGINE_HINT + " (an embedding engine)"),
     Param("vector", (str,), want="a field holding the document vector (from embed)"),
     Param("doc_id", (str,), default="id", want="the document id field"),
     Param("text", (str,), default="text", want="the document text field"),
     Param("time", (str,), want="a field with the document time (epoch seconds or ISO 8601)"),
     Param("delete", (str,), default="deleted", want="a field that, when true, deletes the id"),
     Param("ttl_s", (int, float), want="a positive number of seconds", check=_positive),
     Param("snapshot_every_s", (int, float), default=30, want="a positive number of seconds",
           check=_positive),
     Param("follow", (str,), want="a JSONL file to tail into the index"),
     Param("poll_ms", (int, float), default=50, want="a positive number of milliseconds",
           check=_positive),
     Param("output", (str,), want="a field for the change's summary"),
     Param("max_batch", (int,), default=64, want="a positive integer", check=positive_int)),
    state="shared", batchable=True, blocking=True, fusable=False, fields=_fields,
    prepare=_prepare_semantic, doc="keep a live vector index up to date from a document stream"))
