"""Retrieval operators: embed, retrieve, rerank (MMR), refine, and select.

Engine-backed operators are ``blocking`` (they run in a worker thread) and call their
engine once per micro-batch, so batching across records comes for free. Engines and
indexes are linked at compile time (unknown names fail before anything runs) and
opened when the run starts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..engines import home
from ..engines.price import price_of
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
from .registry import BuildContext, LinkContext, OpDef, OpRuntime, Param, register


def _typed(record: Any, field: str, want: type) -> Any:
    """``record[field]``; FieldError if it is missing or not of type ``want``."""
    v = get_field(record, field)
    if not isinstance(v, want):
        name = {"str": "text", "ndarray": "a vector (from an embed stage)"}.get(
            want.__name__, want.__name__)
        raise FieldError(f"field '{field}' must be {name}, got {type(v).__name__}")
    return v


def _batch_rows(batch: list, errors: list, field: str, want: type) -> tuple[list, list]:
    """(records, values) of the records whose ``field`` is present and of type ``want``."""
    return each_record(batch, errors, lambda r: _typed(r, field, want), FieldError)


# -- embed ----------------------------------------------------------------------------
def _build_embed(params: dict, ctx: BuildContext) -> OpRuntime:
    engine = ctx.open_engine(params["_engine"])
    inp, out = params["input"], params["output"]
    price = price_of(params["_engine"])
    spent = [0.0]  # priced embedders: this replica's spend (the ``cost`` counter)

    def batch_fn(batch: list, errors: list) -> list:
        keep, texts = _batch_rows(batch, errors, inp, str)
        if not keep:
            return []
        vecs = engine.embed(texts)
        if price is not None:  # one tokenizer pass per text, only when priced
            spent[0] += price.cost(sum(engine.count_tokens(t) for t in texts), 0)
        return [{**r, out: v} for r, v in zip(keep, vecs, strict=True)]

    return OpRuntime("map", batch_fn=batch_fn,
                     counters=None if price is None else lambda: {"cost": spent[0]})


register(OpDef(
    "embed", "map", _build_embed,
    (Param("engine", (str,), required=True, want=ENGINE_HINT),
     Param("input", (str,), required=True, want="a text field"),
     Param("output", (str,), required=True, want="a field name"),
     count_param("max_batch", 256)),
    batchable=True, blocking=True, fields=lambda p: ((p["input"],), (p["output"],)),
    prepare=lambda p, ctx: link_engine(p, ctx, "embed"),
    doc="embed a text field into a vector field"))


# -- retrieve -------------------------------------------------------------------------
def index_dir(name: str) -> str:
    """An index name (``wiki``) lives in ``$TAILRACE_HOME/indexes/NAME``; a path is used as is."""
    if os.sep in name or name.startswith("."):
        return name
    return str(home() / "indexes" / name)


MODES = ("dense", "sparse", "hybrid")
FUSION_KEYS = ("k", "dense", "sparse", "candidates")


def fusion_of(spec: Any) -> Any:
    """A ``Fusion`` from a stage's ``fusion:`` mapping (missing keys: defaults); ValueError
    naming the key that is wrong."""
    from ..stores.vector_index import Fusion

    if not isinstance(spec, dict):
        raise ValueError(f"'fusion' must be a mapping like {{k: 60, dense: 1.0, sparse: 1.0, "
                         f"candidates: 50}}, got {spec!r}")
    bad = [str(k) for k in spec if k not in FUSION_KEYS]
    if bad:
        raise ValueError(f"unknown fusion key(s) {', '.join(bad)}; known: "
                         f"{', '.join(FUSION_KEYS)}")
    for key in ("k", "candidates"):
        v = spec.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"fusion '{key}' must be a positive integer, got {v!r}")
    for key in ("dense", "sparse"):
        v = spec.get(key, 1.0)
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
            raise ValueError(f"fusion '{key}' (a weight) must be a number >= 0, got {v!r}")
    f = Fusion(**spec)
    if f.dense == 0 and f.sparse == 0:
        raise ValueError("fusion weights 'dense' and 'sparse' are both 0; give one > 0")
    return f


def _prepare_retrieve(params: dict, ctx: LinkContext) -> dict:
    """Check the mode's fields, fusion and filter; find the embedding model of the stage
    that wrote the query vector."""
    from ..stores.filters import compile_filter

    mode = params["mode"]  # one of MODES (the param's check)
    if mode != "sparse" and not params.get("query"):
        raise ValueError(f"mode {mode} needs 'query' (a vector field written by an embed "
                         "stage)")
    if mode != "dense" and not params.get("text"):
        raise ValueError(f"mode {mode} needs 'text' (the field holding the query text, "
                         "for BM25)")
    if mode == "sparse" and params.get("query"):
        raise ValueError("mode sparse searches words only; drop 'query' or use mode: hybrid")
    if mode == "dense" and params.get("text"):
        raise ValueError("mode dense searches vectors only; drop 'text' or use mode: hybrid")
    if params.get("fusion") is not None:
        if mode != "hybrid":
            raise ValueError(f"'fusion' applies to mode hybrid, not {mode}")
        fusion_of(params["fusion"])
    if params.get("filter") is not None:
        compile_filter(params["filter"])
    if params["index"].startswith("live:") and (mode != "dense" or params.get("filter")):
        raise ValueError("a live index searches dense vectors without filters; use a saved "
                         "index (tailrace ingest) for sparse, hybrid or filtered retrieval")
    model = None
    if params.get("embedder"):
        params = link_engine(params, ctx, "embed", key="embedder")
        model = params["_embedder"].get("model")
    elif params.get("query"):
        for _, op, wparams in ctx.writers.get(params["query"], []):
            if op == "embed" and wparams.get("engine") in ctx.engines:
                model = ctx.engines[wparams["engine"]].get("model")
    params["_model"] = model
    return params


def _build_retrieve(params: dict, ctx: BuildContext) -> OpRuntime:
    import numpy as np

    from ..stores.filters import compile_filter
    from ..stores.vector_index import Fusion, VectorIndex

    mode = params["mode"]
    if params["index"].startswith("live:"):  # a live index that semantic_state stages update
        from ..stores.live_index import open_live_index

        index: Any = open_live_index(params["index"][5:])
        index.expect_model(params.get("_model"))
    else:
        index = VectorIndex.open(index_dir(params["index"]), expect_model=params.get("_model"))
        if mode != "dense":
            index.sparse()  # load (or build) the BM25 index now, not on the first record
    allow = index.select(compile_filter(params["filter"])) if params.get("filter") else None
    fusion = fusion_of(params["fusion"]) if params.get("fusion") is not None else Fusion()
    q: str = params.get("query") or ""
    t: str = params.get("text") or ""
    k, out = params["k"], params["output"]

    def batch_fn(batch: list, errors: list) -> list:
        if mode == "sparse":
            keep, texts = _batch_rows(batch, errors, t, str)
            hits = index.search_text(texts, k, allow=allow) if keep else []
        elif mode == "dense":
            keep, vecs = _batch_rows(batch, errors, q, np.ndarray)
            mat = np.stack(vecs).astype(np.float32, copy=False) if keep else None
            hits = [] if mat is None else (index.search(mat, k) if allow is None else
                                           index.search(mat, k, allow=allow))
        else:
            keep, rows = each_record(batch, errors, lambda r: (_typed(r, q, np.ndarray),
                                                               _typed(r, t, str)), FieldError)
            hits = index.hybrid_search(
                np.stack([v for v, _ in rows]).astype(np.float32, copy=False),
                [x for _, x in rows], k, fusion=fusion, allow=allow) if keep else []
        return [{**r, out: h} for r, h in zip(keep, hits, strict=True)]

    return OpRuntime("map", batch_fn=batch_fn)


register(OpDef(
    "retrieve", "map", _build_retrieve,
    (Param("index", (str,), required=True, want="an index name (see tailrace ingest) or path"),
     Param("query", (str,), want="a vector field written by an embed stage"),
     count_param("k", 5),
     Param("output", (str,), default="passages", want="a field name"),
     Param("embedder", (str,), want=ENGINE_HINT),
     count_param("max_batch", 256),
     Param("mode", (str,), default="dense", want="one of dense, sparse, hybrid",
           check=lambda v: v in MODES),
     Param("text", (str,), want="the field holding the query text (sparse, hybrid)"),
     Param("fusion", (dict,), want="a mapping like {k: 60, dense: 1.0, sparse: 1.0}"),
     Param("filter", (dict,), want="a mapping of document field to condition, like "
           "{path: {in: [a.md]}, page: {gte: 2}}")),
    batchable=True, blocking=True,
    fields=lambda p: (tuple(f for f in (p.get("query"), p.get("text")) if f), (p["output"],)),
    prepare=_prepare_retrieve,
    doc="top-k passages from an index: dense, BM25 (sparse) or both fused (hybrid)"))


# -- rerank ---------------------------------------------------------------------------
def mmr(query: Any, docs: Any, k: int, diversity: float, rel: Any = None) -> list[int]:
    """Maximal marginal relevance: indices of ``k`` docs balancing relevance to the
    query against similarity to the docs already chosen (vectors unit-norm); ``rel``:
    the relevance of each doc if not its cosine with ``query`` (e.g. a scorer's)."""
    import numpy as np

    rel = docs @ query if rel is None else np.asarray(rel, np.float32)
    chosen: list[int] = []
    left = list(range(len(docs)))
    while left and len(chosen) < k:
        red = (docs[left] @ docs[chosen].T).max(axis=1) if chosen else np.zeros(len(left))
        score = (1 - diversity) * rel[left] - diversity * red
        best = left[int(np.argmax(score))]
        chosen.append(best)
        left.remove(best)
    return chosen


def _unit(scores: Any) -> Any:
    """Scores scaled to 0..1 (all equal: all 1), so MMR can weigh them against cosines."""
    import numpy as np

    s = np.asarray(scores, np.float32)
    span = float(s.max() - s.min()) if len(s) else 0.0
    return (s - s.min()) / span if span > 0 else np.ones_like(s)


def _scores(scorer: Any, query: str, texts: list[str]) -> list[float]:
    """``scorer(query, texts)`` checked: one number per text."""
    out = list(scorer(query, texts))
    if len(out) != len(texts) or not all(isinstance(x, int | float) for x in out):
        raise TailraceError(f"the rerank scorer must return one number per passage; got "
                            f"{len(out)} values for {len(texts)} passages")
    return [float(x) for x in out]


def _build_rerank(params: dict, ctx: BuildContext) -> OpRuntime:
    import numpy as np

    engine = ctx.open_engine(params["_engine"]) if params.get("_engine") else None
    scorer = params.get("scorer")
    inp, q, out = params["input"], params["query"], params["output"] or params["input"]
    k = params["k"]
    div = params["diversity"] if params["diversity"] is not None else 0.3

    def _query(r: Any) -> Any:
        v = get_field(r, q)
        if scorer is not None and not isinstance(v, str):
            raise FieldError(f"field '{q}' must be text (the scorer reads the question), "
                             f"got {type(v).__name__}")
        return v

    def batch_fn(batch: list, errors: list) -> list:
        keep, rows = each_record(batch, errors, lambda r: (_typed(r, inp, list),
                                                           _query(r)), FieldError)
        vecs: Any = None
        qvecs: Any = iter(())
        if engine is not None:  # one embed call for every passage of the batch
            texts = [p.get("text", "") for ps, _ in rows for p in ps]
            vecs = engine.embed(texts) if texts else np.zeros((0, 1), np.float32)
            qtexts = [x for _, x in rows if isinstance(x, str)]
            qvecs = iter(engine.embed(qtexts)) if qtexts else iter(())
        result, i = [], 0
        for r, (ps, query) in zip(keep, rows, strict=True):
            n = min(k, len(ps))
            rel: list[float] = (_scores(scorer, query, [str(p.get("text", "")) for p in ps])
                                if scorer is not None and ps else [])
            if vecs is None:  # a scorer alone: sort by its scores
                order = sorted(range(len(ps)), key=lambda j: -rel[j])[:n]
                result.append({**r, out: [{**ps[j], "rerank_score": rel[j]} for j in order]})
                continue
            qv = next(qvecs) if isinstance(query, str) else np.asarray(query, np.float32)
            dv = vecs[i:i + len(ps)]
            i += len(ps)
            order = mmr(qv, dv, n, div, _unit(rel) if rel else None) if len(ps) else []
            ranked = [{**ps[j], "rerank_score": rel[j] if rel else float(dv[j] @ qv)}
                      for j in order]
            result.append({**r, out: ranked})
        return result

    return OpRuntime("map", batch_fn=batch_fn)


def _prepare_rerank(params: dict, ctx: LinkContext) -> dict:
    if not params.get("engine") and params.get("scorer") is None:
        raise ValueError("rerank needs 'engine' (an embedding engine: MMR by cosine), "
                         "'scorer' (a function (question, texts) -> scores, e.g. a "
                         "cross-encoder) or both (scorer relevance, MMR diversity)")
    if not params.get("engine") and params.get("diversity") is not None:
        raise ValueError("'diversity' needs 'engine' (an embedding engine measures how "
                         "alike passages are); drop it or add the engine")
    if params.get("engine"):
        link_engine(params, ctx, "embed")
    return params


register(OpDef(
    "rerank", "map", _build_rerank,
    (Param("engine", (str,), want=ENGINE_HINT),
     Param("input", (str,), required=True, want="a passages field (from retrieve)"),
     Param("query", (str,), required=True, want="the question text or query vector field"),
     count_param("k", 5),
     Param("diversity", (int, float), want="a number from 0 to 1 (default 0.3)",
           check=lambda v: 0 <= v <= 1),
     Param("output", (str,), want="a field name"),
     count_param("max_batch", 64),
     Param("scorer", (str,), callable=True,
           want="a function (question, texts) -> one relevance score per text")),
    batchable=True, blocking=True,
    fields=lambda p: ((p["input"], p["query"]), (p.get("output") or p["input"],)),
    prepare=_prepare_rerank,
    doc="re-order passages: a scorer's relevance and/or embedding MMR diversity"))


# -- refine ---------------------------------------------------------------------------
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Packer:
    """Pack passages into a token budget: drop near-duplicates (word-set Jaccard >=
    ``dedup``), keep the given (relevance) order, truncate the last one to fit."""

    max_tokens: int
    dedup: float
    count: Any

    def pack(self, passages: list[dict]) -> tuple[str, list[dict]]:
        parts: list[str] = []
        kept: list[dict] = []
        seen: list[set[str]] = []
        used = 0
        for p in passages:
            text = str(p.get("text", "")).strip()
            words = set(_WORD.findall(text.lower()))
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


def _prepare_refine(params: dict, ctx: LinkContext) -> dict:
    if params.get("source_fields") and not params.get("sources"):
        raise ValueError("'source_fields' says what each source holds; add 'sources' (the "
                         "field to write them to)")
    return link_token_counter(params, ctx)


def _build_refine(params: dict, ctx: BuildContext) -> OpRuntime:
    packer = Packer(params["max_tokens"], params["dedup"], token_counter(params, ctx))
    inp, out, src = params["input"], params["output"], params.get("sources")
    cite = params.get("source_fields")

    def batch_fn(batch: list, errors: list) -> list:
        keep, lists = _batch_rows(batch, errors, inp, list)
        result = []
        for r, passages in zip(keep, lists, strict=True):
            context, kept = packer.pack(passages)
            rec = {**r, out: context}
            if src and cite:  # where the kept passages came from: {path, page, ...}, each
                cited: list[dict] = []  # place once (chunks of one section: one source)
                for p in kept:
                    c = {f: p[f] for f in cite if f in p}
                    if c not in cited:
                        cited.append(c)
                rec[src] = cited
            elif src:
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
     Param("source_fields", (list,), want="a list of passage fields to cite, like "
           "[title, path, page, heading]",
           check=lambda v: bool(v) and all(isinstance(f, str) for f in v)),
     Param("engine", (str,), want="a generation engine (its tokenizer counts tokens)")),
    blocking=True,
    fields=lambda p: ((p["input"],), (p["output"],) + ((p["sources"],) if p.get("sources")
                                                        else ())),
    prepare=_prepare_refine, doc="pack passages into a token budget"))


# -- select ---------------------------------------------------------------------------
def _build_select(params: dict, ctx: BuildContext) -> OpRuntime:
    keep, drop = params.get("fields"), params.get("drop") or []

    def batch_fn(batch: list, errors: list) -> list:
        out = []
        for r in batch:
            if not isinstance(r, dict):
                errors.append((r, FieldError(f"select needs JSON objects, got "
                                             f"{type(r).__name__}")))
            elif keep is not None:  # the record's request (``_request``) stays
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
