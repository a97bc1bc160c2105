"""Streaming semantic state: ``semantic_state`` keeps a live vector index up to date.

The stage upserts (or deletes) documents by id in a process-wide live index that
``retrieve`` stages of any pipeline read with ``index: live:NAME``. Documents come either
as the stage's own records (any source: a JSONL file, the HTTP runs endpoint, a Python
iterable such as ``follow.follow_jsonl``) or, with ``follow: FILE``, from a JSONL file
that a background feeder (``follow.Feeder``) tails like ``tail -f`` while the pipeline's
records pass through. In follow mode the stage holds its first records until the
feeder has read the file to its end once, so they see every document it held then.

With ``chunk_tokens: N`` a document is stored as chunks ``ID#0``, ``ID#1``, ...; a new
version replaces all of them. The freshness bound, chunking and recovery are in
docs/stateful.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..errors import TailraceError
from .common import ENGINE_HINT, FieldError, count_param, get_field, link_engine, positive
from .follow import start_feeder
from .registry import BuildContext, LinkContext, OpDef, OpRuntime, Param, register


def doc_time(value: Any) -> float:
    """Seconds since the epoch from a number or an ISO 8601 text (``2025-01-31T12:00:00Z``).

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

    def __init__(self, index: Any, engine: Any, params: dict) -> None:
        """Bind the live index, the stage's embedder (or None) and its parameters
        (``doc_id``, ``text``, ``vector``, ``time``, ``delete``)."""
        self.index = index
        self.engine = engine
        self.model = params.get("_model")
        self.id, self.text, self.vector = params["doc_id"], params["text"], params.get("vector")
        self.time, self.delete = params.get("time"), params["delete"]
        self.chunker = None
        if params.get("chunk_tokens"):
            from ..stores.chunking import Chunker

            self.chunker = Chunker(self.model or "", max_tokens=params["chunk_tokens"],
                                   overlap=params["chunk_overlap"])
            self.title = params["title"]

    def _stale(self, doc_id: Any, keep: int) -> list:
        """Ids of a chunked document's stored chunks from number ``keep`` on (and of the
        document stored whole)."""
        out = [doc_id] if doc_id in self.index else []
        j = keep
        while f"{doc_id}#{j}" in self.index:
            out.append(f"{doc_id}#{j}")
            j += 1
        return out

    def _change(self, r: Any) -> tuple[str, Any, Any, float | None]:
        """(action, id, text or vector, time) of one record; FieldError if malformed."""
        doc_id = get_field(r, self.id)
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
            raise FieldError(f"field '{self.id}' (the document id) must be a string or an "
                             f"integer, got {type(doc_id).__name__}")
        if r.get(self.delete):
            return "delete", doc_id, None, None
        t = doc_time(get_field(r, self.time)) if self.time else None
        if self.vector:
            return "upsert", doc_id, get_field(r, self.vector), t
        text = get_field(r, self.text)
        if not isinstance(text, str):
            raise FieldError(f"field '{self.text}' must be text, got {type(text).__name__}")
        return "upsert", doc_id, text, t

    def ingest(self, records: list, errors: list, cursor: dict | None = None) -> list:
        """Apply records in order (runs of upserts embedded together); returns the good ones.
        ``errors`` receives ``(record, exception)`` per malformed record; ``cursor`` is the
        feeder position after the last record (saved with the change)."""
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
                    self.index.delete(self._stale(change[1], 0) if self.chunker
                                      else [change[1]])
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
        ids = [c[1] for _, c in run]
        stale: list = []
        try:
            if self.chunker is not None:
                ids, payload, docs, times, stale = self._chunked(ids, payload, docs, times)

            vecs = (np.stack([np.asarray(v, dtype=np.float32) for v in payload])
                    if self.vector else self.engine.embed(payload))
            if stale:
                self.index.delete(stale)
            self.index.upsert(ids, vecs, docs, model=self.model,
                              cursor=cursor, times=None if self.time is None else times)
        except (TailraceError, ValueError) as e:
            if cursor is not None:  # a feeder: stop rather than skip documents
                raise
            errors.extend((r, e) for r, _ in run)
            return []
        return [r for r, _ in run]

    def _chunked(self, ids: list, texts: list, docs: list, times: list) -> tuple:
        """Each document as its chunks (ids ``ID#n``, docs with ``doc_id``, ``heading``,
        ``start``, ``end``), plus the ids of chunks its earlier version had beyond them."""
        out: tuple[list, list, list, list, list] = ([], [], [], [], [])
        assert self.chunker is not None
        for doc_id, text, doc, t in zip(ids, texts, docs, times, strict=True):
            title = doc.get(self.title) if self.title else None
            title = title if isinstance(title, str) else ""
            chunks = self.chunker.chunk(text, title)
            for i, c in enumerate(chunks):
                out[0].append(f"{doc_id}#{i}")
                out[1].append(c.context(title))
                out[2].append({**doc, "id": f"{doc_id}#{i}", "doc_id": doc_id,
                               self.text: c.text, "heading": c.heading, "start": c.start,
                               "end": c.end})
                out[3].append(t)
            out[4].extend(self._stale(doc_id, len(chunks)))
        return out


def _build_semantic(params: dict, ctx: BuildContext) -> OpRuntime:
    from ..stores.live_index import open_live_index

    index = open_live_index(params["index"])
    index.ttl_s = params.get("ttl_s")
    index.snapshot_every_s = params["snapshot_every_s"]
    engine = ctx.open_engine(params["_engine"]) if params.get("_engine") else None
    ingester = Ingester(index, engine, params)
    out, name = params.get("output"), params["index"]

    if params.get("follow"):
        feeder = start_feeder(index, ingester.ingest, params["follow"],
                              params["poll_ms"] / 1000, params["max_batch"])

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

    return OpRuntime("map", batch_fn=batch_fn)


def _prepare_semantic(params: dict, ctx: LinkContext) -> dict:
    if (params.get("engine") is None) == (params.get("vector") is None):
        raise ValueError("semantic_state needs exactly one of 'engine' (an embedding engine "
                         "for the text field) or 'vector' (a field holding the vector)")
    if params.get("follow") and params.get("vector"):
        raise ValueError("'follow' reads raw lines, so it needs 'engine' to embed them, "
                         "not 'vector'")
    if params.get("chunk_tokens") and not params.get("engine"):
        raise ValueError("'chunk_tokens' chunks the text field before embedding it, so it "
                         "needs 'engine', not 'vector'")
    if params.get("chunk_tokens") and params["chunk_overlap"] * 2 >= params["chunk_tokens"]:
        raise ValueError(f"'chunk_overlap' ({params['chunk_overlap']}) must be below half of "
                         f"'chunk_tokens' ({params['chunk_tokens']})")
    if params.get("engine"):
        params = link_engine(params, ctx, "embed")
        params["_model"] = params["_engine"].get("model")
    return params


def _fields(p: dict) -> tuple:
    if p.get("follow"):
        return (), ()
    reads = (p["doc_id"], p.get("vector") or p["text"]) + ((p["time"],) if p.get("time") else ())
    return reads, ((p["output"],) if p.get("output") else ())


register(OpDef(
    "semantic_state", "map", _build_semantic,
    (Param("index", (str,), required=True, want="a live index name (retrieve reads it as "
                                                  "live:NAME) or directory"),
     Param("engine", (str,), want=ENGINE_HINT + " (an embedding engine)"),
     Param("vector", (str,), want="a field holding the document vector (from embed)"),
     Param("doc_id", (str,), default="id", want="the document id field"),
     Param("text", (str,), default="text", want="the document text field"),
     Param("time", (str,), want="a field with the document time (epoch seconds or ISO 8601)"),
     Param("delete", (str,), default="deleted", want="a field that, when true, deletes the id"),
     Param("ttl_s", (int, float), want="a positive number of seconds", check=positive),
     Param("snapshot_every_s", (int, float), default=30, want="a positive number of seconds",
           check=positive),
     Param("follow", (str,), want="a JSONL file to tail into the index"),
     Param("poll_ms", (int, float), default=50, want="a positive number of milliseconds",
           check=positive),
     Param("output", (str,), want="a field for the change's summary"),
     Param("chunk_tokens", (int,), want="an integer >= 16 (tokens per chunk)",
           check=lambda v: v >= 16),
     Param("chunk_overlap", (int,), default=32, want="an integer >= 0 (tokens)",
           check=lambda v: v >= 0),
     Param("title", (str,), default="title", want="the document title field (chunk context)"),
     count_param("max_batch", 64)),
    state="shared", batchable=True, blocking=True, fusable=False, fields=_fields,
    prepare=_prepare_semantic, doc="keep a live vector index up to date from a document stream"))
