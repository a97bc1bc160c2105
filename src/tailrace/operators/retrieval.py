"""Retrieval operators: embed, retrieve, rerank (MMR), refine, and select.

Engine-backed operators are ``blocking`` (they run in a worker thread) and call their
engine once per micro-batch, so batching across records comes for free. Engines and
indexes are linked at compile time (unknown names fail before anything runs) and
opened when the run starts.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..engines import home, open_engine
from ..errors import TailraceError
from .common import (
    ENGINE_HINT,
    FieldError,
    count_param,
    each_record,
    get_field,
    link_engine,
    link_token_counter,
    token_counter,
)
from .registry import LinkContext, OpDef, OpRuntime, Param, register


def _typed(record: Any, field: str, want: type | tuple) -> Any:
    """``record[field]``; FieldError if it is missing or not of type ``want``."""
    v = get_field(record, field)
    if not isinstance(v, want):
        raise FieldError(f"field '{field}' must be {_type_name(want)}, got {type(v).__name__}")
    return v


def _batch_rows(batch: list, errors: list, field: str, want: type | tuple) -> tuple[list, list]:
    """(records, values) of the records whose ``field`` is present and of type ``want``."""
    return each_record(batch, errors, lambda r: _typed(r, field, want), FieldError)


def _type_name(want: type | tuple) -> str:
    names = [t.__name__ for t in (want if isinstance(want, tuple) else (want,))]
    return {"str": "text", "ndarray": "a vector (from an embed stage)"}.get(names[0], names[0])


def _io(params: dict, reads: tuple[str, ...]) -> tuple:
    return tuple(r for r in reads if r), (params["output"],)


# -- embed ----------------------------------------------------------------------------
def _build_embed(params: dict, contract: Any) -> OpRuntime:
    engine = open_engine(params["_engine"])
    inp, out = params["input"], params["output"]

    def batch_fn(batch: list, errors: list) -> list:
        keep, texts = _batch_rows(batch, errors, inp, str)
        if not keep:
            return []
        vecs = engine.embed(texts)
        return [{**r, out: v} for r, v in zip(keep, vecs, strict=True)]

    return OpRuntime("map", batch_fn=batch_fn, max_batch=params["max_batch"])


register(OpDef(
    "embed", "map", _build_embed,
    (Param("engine", (str,), required=True, want=ENGINE_HINT),
     Param("input", (str,), required=True, want="a text field"),
     Param("output", (str,), required=True, want="a field name"),
     count_param("max_batch", 256)),
    batchable=True, blocking=True, fields=lambda p: _io(p, (p["input"],)),
    prepare=lambda p, ctx: link_engine(p, ctx, "embed"),
    doc="embed a text field into a vector field"))


# -- retrieve -------------------------------------------------------------------------
def index_dir(name: str) -> str:
    """An index name (``wiki``) lives in ``$TAILRACE_HOME/indexes/NAME``; a path is used as is."""
    if os.sep in name or name.startswith("."):
        return name
    return str(home() / "indexes" / name)


def _prepare_retrieve(params: dict, ctx: LinkContext) -> dict:
    """Find the embedding model of the stage that wrote the query vector."""
    model = None
    if params.get("embedder"):
        params = link_engine(params, ctx, "embed", key="embedder")
        model = params["_embedder"].get("model")
    else:
        for _, op, wparams in ctx.writers.get(params["query"], []):
            if op == "embed" and wparams.get("engine") in ctx.engines:
                model = ctx.engines[wparams["engine"]].get("model")
    params["_model"] = model
    return params


def _build_retrieve(params: dict, contract: Any) -> OpRuntime:
    import numpy as np

    from ..stores.vector_index import VectorIndex

    if params["index"].startswith("live:"):  # a live index that semantic_state stages update
        from ..stores.live_index import open_live_index

        index: Any = open_live_index(params["index"][5:])
        index.expect_model(params.get("_model"))
    else:
        index = VectorIndex.open(index_dir(params["index"]), expect_model=params.get("_model"))
    q, k, out = params["query"], params["k"], params["output"]

    def batch_fn(batch: list, errors: list) -> list:
        keep, vecs = _batch_rows(batch, errors, q, np.ndarray)
        if not keep:
            return []
        hits = index.search(np.stack(vecs).astype(np.float32, copy=False), k)
        return [{**r, out: h} for r, h in zip(keep, hits, strict=True)]

    return OpRuntime("map", batch_fn=batch_fn, max_batch=params["max_batch"])


register(OpDef(
    "retrieve", "map", _build_retrieve,
    (Param("index", (str,), required=True, want="an index name (see tailrace ingest) or path"),
     Param("query", (str,), required=True, want="a vector field written by an embed stage"),
     count_param("k", 5),
     Param("output", (str,), default="passages", want="a field name"),
     Param("embedder", (str,), want=ENGINE_HINT),
     count_param("max_batch", 256)),
    batchable=True, blocking=True, fields=lambda p: _io(p, (p["query"],)),
    prepare=_prepare_retrieve, doc="top-k passages from a vector index"))


# -- rerank ---------------------------------------------------------------------------
def mmr(query: Any, docs: Any, k: int, diversity: float) -> list[int]:
    """Maximal marginal relevance: indices of ``k`` docs balancing relevance to the
    query against similarity to the docs already chosen (vectors unit-norm)."""
    import numpy as np

    rel = docs @ query
    chosen: list[int] = []
    left = list(range(len(docs)))
    while left and len(chosen) < k:
        red = (docs[left] @ docs[chosen].T).max(axis=1) if chosen else np.zeros(len(left))
        score = (1 - diversity) * rel[left] - diversity * red
        best = left[int(np.argmax(score))]
        chosen.append(best)
        left.remove(best)
    return chosen


def _build_rerank(params: dict, contract: Any) -> OpRuntime:
    import numpy as np

    engine = open_engine(params["_engine"])
    inp, q, out = params["input"], params["query"], params["output"] or params["input"]
    k, div = params["k"], params["diversity"]

    def batch_fn(batch: list, errors: list) -> list:
        keep, rows = each_record(batch, errors, lambda r: (_typed(r, inp, list), get_field(r, q)),
                                 FieldError)  # rows: (passages, query)
        texts = [p.get("text", "") for ps, _ in rows for p in ps]
        vecs = engine.embed(texts) if texts else np.zeros((0, 1), np.float32)
        qtexts = [x for _, x in rows if isinstance(x, str)]
        qvecs = iter(engine.embed(qtexts)) if qtexts else iter(())
        result, i = [], 0
        for r, (ps, query) in zip(keep, rows, strict=True):
            qv = next(qvecs) if isinstance(query, str) else np.asarray(query, np.float32)
            dv = vecs[i:i + len(ps)]
            i += len(ps)
            order = mmr(qv, dv, min(k, len(ps)), div) if len(ps) else []
            ranked = [{**ps[j], "rerank_score": float(dv[j] @ qv)} for j in order]
            result.append({**r, out: ranked})
        return result

    return OpRuntime("map", batch_fn=batch_fn, max_batch=params["max_batch"])


register(OpDef(
    "rerank", "map", _build_rerank,
    (Param("engine", (str,), required=True, want=ENGINE_HINT),
     Param("input", (str,), required=True, want="a passages field (from retrieve)"),
     Param("query", (str,), required=True, want="the question text or query vector field"),
     count_param("k", 5),
     Param("diversity", (int, float), default=0.3, want="a number from 0 to 1",
           check=lambda v: 0 <= v <= 1),
     Param("output", (str,), want="a field name"),
     count_param("max_batch", 64)),
    batchable=True, blocking=True,
    fields=lambda p: ((p["input"], p["query"]), (p.get("output") or p["input"],)),
    prepare=lambda p, ctx: link_engine(p, ctx, "embed"),
    doc="re-order passages by similarity with MMR diversity"))


# -- refine ---------------------------------------------------------------------------
_WORD = re.compile(r"\w+")


def _shingles(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


class Packer:
    """Pack passages into a token budget: drop near-duplicates (word-set Jaccard >=
    ``dedup``), keep the given (relevance) order, truncate the last one to fit."""

    def __init__(self, max_tokens: int, dedup: float, count: Any) -> None:
        self.max_tokens = max_tokens
        self.dedup = dedup
        self.count = count

    def pack(self, passages: list[dict]) -> tuple[str, list[dict]]:
        parts: list[str] = []
        kept: list[dict] = []
        seen: list[set[str]] = []
        used = 0
        for p in passages:
            text = str(p.get("text", "")).strip()
            words = _shingles(text)
            if any(len(words & s) / max(1, len(words | s)) >= self.dedup for s in seen):
                continue
            piece = f"[{len(kept) + 1}] {p.get('title', '')}: {text}".strip()
            n = self.count(piece) + (1 if parts else 0)
            if used + n > self.max_tokens:
                piece = self._truncate(piece, self.max_tokens - used - (1 if parts else 0))
                if piece:
                    parts.append(piece)
                    kept.append(p)
                break
            parts.append(piece)
            kept.append(p)
            seen.append(words)
            used += n
        return "\n".join(parts), kept

    def _truncate(self, piece: str, budget: int) -> str:
        """The longest word-prefix of ``piece`` within ``budget`` tokens (binary search)."""
        if budget < 8:
            return ""
        words = piece.split(" ")
        lo, hi = 0, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(" ".join(words[:mid]) + " ...") <= budget:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo]) + " ..." if lo else ""


def _build_refine(params: dict, contract: Any) -> OpRuntime:
    packer = Packer(params["max_tokens"], params["dedup"], token_counter(params))
    inp, out, src = params["input"], params["output"], params.get("sources")

    def batch_fn(batch: list, errors: list) -> list:
        keep, lists = _batch_rows(batch, errors, inp, list)
        result = []
        for r, passages in zip(keep, lists, strict=True):
            context, kept = packer.pack(passages)
            rec = {**r, out: context}
            if src:
                rec[src] = [p.get("title", "") for p in kept]
            result.append(rec)
        return result

    return OpRuntime("map", batch_fn=batch_fn)


register(OpDef(
    "refine", "map", _build_refine,
    (Param("input", (str,), required=True, want="a passages field (from retrieve/rerank)"),
     Param("output", (str,), default="context", want="a field name"),
     count_param("max_tokens", 512),
     Param("dedup", (int, float), default=0.8, want="a Jaccard threshold from 0 to 1",
           check=lambda v: 0 <= v <= 1),
     Param("sources", (str,), want="a field name for the kept passages' titles"),
     Param("engine", (str,), want="a generation engine (its tokenizer counts tokens)")),
    blocking=True,
    fields=lambda p: ((p["input"],), (p["output"],) + ((p["sources"],) if p.get("sources")
                                                        else ())),
    prepare=link_token_counter, doc="pack passages into a token budget"))


# -- select ---------------------------------------------------------------------------
def _build_select(params: dict, contract: Any) -> OpRuntime:
    keep, drop = params.get("fields"), params.get("drop") or []

    def batch_fn(batch: list, errors: list) -> list:
        out = []
        for r in batch:
            if not isinstance(r, dict):
                errors.append((r, FieldError(f"select needs JSON objects, got "
                                             f"{type(r).__name__}")))
            elif keep is not None:  # transient fields (_stream, _admission) stay
                out.append({k: v for k, v in r.items() if k in keep or k.startswith("_")})
            else:
                out.append({k: v for k, v in r.items() if k not in drop})
        return out

    return OpRuntime("map", batch_fn=batch_fn)


def _prepare_select(params: dict, ctx: LinkContext) -> dict:
    if (params.get("fields") is None) == (params.get("drop") is None):
        raise TailraceError("select needs exactly one of 'fields' (keep) or 'drop'")
    return params


register(OpDef(
    "select", "map", _build_select,
    (Param("fields", (list,), want="a list of field names to keep"),
     Param("drop", (list,), want="a list of field names to drop")),
    fields=lambda p: ((), None),
    prepare=_prepare_select, doc="keep or drop record fields"))
