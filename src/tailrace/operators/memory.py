"""Memory operators: ``memory_read`` and ``memory_write`` over a structured memory store.

``memory_write`` stores a record's turns under its (user, session) and, optionally,
facts about its user; ``memory_read`` packs the session's last turns and the user's
facts most relevant to a query into a token budget. The user is the tenant: a record
only reads its own user's memory (docs/memory.md).

>>> import tailrace as tr
>>> mem = {"backend": "sqlite", "path": ":memory:"}
>>> p = tr.Pipeline("chat")
>>> s = p.source(fields=["uid", "sid", "question"])
>>> s = s.apply("memory_read", store=mem, user="uid", session="sid")
>>> s = s.map(lambda r: {**r, "answer": "echo: " + r["question"]})
>>> s.apply("memory_write", store=mem, user="uid", session="sid").sink(out := [])
>>> for q in ["hello", "again"]:
...     _ = tr.run(p, input=[{"uid": "doc-ada", "sid": "s1", "question": q}])
>>> print(out[-1]["memory"])
Conversation so far:
user: hello
assistant: echo: hello
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ..stores.memory import Fact, FactHit, Turn, check_store_spec, open_store
from .common import (
    ENGINE_HINT,
    FieldError,
    count_param,
    each_record,
    get_field,
    link_engine,
    link_token_counter,
    non_negative,
    positive,
    token_counter,
)
from .registry import BuildContext, LinkContext, OpDef, OpRuntime, Param, register

FACTS_HEADER = "Known facts about the user:"
TURNS_HEADER = "Conversation so far:"


COMMON_PARAMS = (
    Param("user", (str,), required=True, want="the field holding the user (tenant) id"),
    Param("session", (str,), required=True, want="the field holding the session id"),
    Param("store", (dict,), want="a mapping like {backend: sqlite, path: memory.sqlite} "
          "or {backend: postgres, dsn: postgresql://...}"),
    Param("embedder", (str,), want=ENGINE_HINT + " (an embedding engine)"),
    Param("clock", (str,), callable=True,
          want="a callable returning epoch seconds (tests inject one)"),
)


def _record_id(record: Any, name: str) -> str:
    """A user or session id: a non-empty string or an integer field."""
    v = get_field(record, name)
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if not isinstance(v, str) or not v:
        raise FieldError(f"field '{name}' must be a non-empty id (text or integer), got {v!r}")
    return v


def _prepare_store(params: dict, ctx: LinkContext, texts: str) -> dict:
    """Check the store config; link ``embedder`` when the ``texts`` parameter is set."""
    params["_store"] = check_store_spec(params.get("store"))
    if params.get(texts) is not None:
        if not params.get("embedder"):
            raise ValueError(f"'{texts}' needs 'embedder' ({ENGINE_HINT}, an embedding "
                             "engine) to embed its texts")
        params = link_engine(params, ctx, "embed", key="embedder")
    elif params.get("embedder"):
        raise ValueError(f"'embedder' is unused without '{texts}'; set '{texts}' or remove it")
    return params


def _embedder(params: dict, ctx: BuildContext) -> tuple[Any, str]:
    """(engine, model name) of the stage's embedder, or (None, "")."""
    spec = params.get("_embedder")
    if not spec:
        return None, ""
    engine = ctx.open_engine(spec)
    name = getattr(engine, "model", None) or spec.get("model") or spec.get("path") or "embedder"
    return engine, str(name)


# -- memory_read ----------------------------------------------------------------------
def pack_memory(turns: list[tuple[str, str]], facts: list[FactHit], budget: int,
                count: Any) -> tuple[str, list[tuple[str, str]], list[FactHit]]:
    """Fit turns and facts into ``budget`` tokens; returns (text, kept turns, kept facts).

    turns:  ``(role, text)`` oldest first; the newest are kept first and a turn that
            does not fit ends the history (no gaps).
    facts:  best first; a fact that does not fit is skipped.
    budget: tokens for the whole text (headers and newlines included).
    count:  ``count(text) -> tokens``.
    Turns and facts take turns (newest turn, best fact, next turn, ...), so neither
    crowds the other out.
    """
    used = 0
    t_lines = [f"{role}: {text}" for role, text in turns]
    f_lines = [f"- {f.text}" for f in facts]
    kept_t: list[int] = []
    kept_f: list[int] = []
    ti, fi = len(turns) - 1, 0
    while ti >= 0 or fi < len(facts):
        if ti >= 0:
            cost = count(t_lines[ti]) + 1 + (0 if kept_t else count(TURNS_HEADER) + 1)
            if used + cost <= budget:
                kept_t.append(ti)
                used += cost
                ti -= 1
            else:
                ti = -1
        if fi < len(facts):
            cost = count(f_lines[fi]) + 1 + (0 if kept_f else count(FACTS_HEADER) + 1)
            if used + cost <= budget:
                kept_f.append(fi)
                used += cost
            fi += 1
    kept_t.reverse()
    parts = ([FACTS_HEADER] + [f_lines[i] for i in kept_f] if kept_f else []) + \
        ([TURNS_HEADER] + [t_lines[i] for i in kept_t] if kept_t else [])
    return "\n".join(parts), [turns[i] for i in kept_t], [facts[i] for i in kept_f]


def _prepare_read(params: dict, ctx: LinkContext) -> dict:
    if params.get("query") is None:
        if params.get("k"):
            raise ValueError("'k' facts need 'query' (the text field to find relevant facts "
                             "for); set query or remove k")
        params["k"] = 0
    elif params.get("k") is None:
        params["k"] = 3
    return link_token_counter(_prepare_store(params, ctx, "query"), ctx)


def _query_value(record: Any, name: str) -> Any:
    v = get_field(record, name)
    if isinstance(v, str | list) or type(v).__name__ == "ndarray":
        return v
    raise FieldError(f"field '{name}' must be the query text (or a vector), got "
                     f"{type(v).__name__}")


def _build_read(params: dict, ctx: BuildContext) -> OpRuntime:
    store = open_store(params["_store"])
    embedder, model = _embedder(params, ctx)
    count = token_counter(params, ctx)
    clock = params["clock"] or time.time
    ufield, sfield, qfield = params["user"], params["session"], params.get("query")
    n_turns, k, budget = params["turns"], params["k"], params["max_tokens"]
    min_score, out, detail = params.get("min_score"), params["output"], params.get("detail")
    ordered, wait_s = params["ordered"], params["wait_ms"] / 1000.0

    def parse(r: Any) -> tuple:
        return ((_record_id(r, ufield), _record_id(r, sfield)),
                _query_value(r, qfield) if qfield else None)

    def batch_fn(batch: list, errors: list) -> list:
        keep, parsed = each_record(batch, errors, parse, FieldError)
        texts = [q for _, q in parsed if isinstance(q, str)]
        vecs = iter(embedder.embed(texts)) if texts else iter(())
        result = []
        for r, ((user, session), query) in zip(keep, parsed, strict=True):
            vec = next(vecs) if isinstance(query, str) else query
            now = clock()
            try:
                if ordered:
                    store.claim_session(user, session, wait_s)
                    now = clock()
                turns = store.last_turns(user, session, n_turns, now)
                facts = store.top_facts(user, model, vec, k, now) if vec is not None else []
            except Exception as e:  # noqa: BLE001 - this record only (store or vector error)
                errors.append((r, e))
                if ordered:
                    with contextlib.suppress(Exception):  # else the claim goes stale
                        store.add((), (), now, release=[(user, session)])
                continue
            if min_score is not None:
                facts = [f for f in facts if f.score >= min_score]
            text, kept_t, kept_f = pack_memory(turns, facts, budget, count)
            rec = {**r, out: text}
            if detail:
                rec[detail] = {"turns": [{"role": a, "text": b} for a, b in kept_t],
                               "facts": [{"text": f.text, "score": round(f.score, 4),
                                          "metadata": f.metadata} for f in kept_f]}
            result.append(rec)
        return result

    return OpRuntime("map", batch_fn=batch_fn)


register(OpDef(
    "memory_read", "map", _build_read,
    COMMON_PARAMS + (
        Param("query", (str,), want="a text field (or vector field) to rank facts by"),
        Param("turns", (int,), default=6, want="a number of turns >= 0",
              check=non_negative),
        Param("k", (int,), want="a number of facts >= 0", check=non_negative),
        Param("min_score", (int, float), want="a cosine similarity from -1 to 1",
              check=lambda v: -1 <= v <= 1),
        count_param("max_tokens", 256),
        Param("engine", (str,), want="a generation engine (its tokenizer counts tokens)"),
        Param("output", (str,), default="memory", want="a field name"),
        Param("detail", (str,), want="a field name for the kept turns and facts"),
        Param("ordered", (object,), default=False, want="true or false",
              check=lambda v: isinstance(v, bool)),
        Param("wait_ms", (int, float), default=30000, want="a positive number",
              check=positive),
        count_param("max_batch", 64)),
    state="shared", blocking=True,
    fields=lambda p: ((p["user"], p["session"]) + ((p["query"],) if p.get("query") else ()),
                      (p["output"],) + ((p["detail"],) if p.get("detail") else ())),
    prepare=_prepare_read,
    max_batch=lambda p: 1 if p.get("ordered") else p.get("max_batch"),  # ordered: one a call
    doc="last turns of the session and relevant facts of the user, in a token budget"))


# -- memory_write ---------------------------------------------------------------------
def _prepare_write(params: dict, ctx: LinkContext) -> dict:
    if not params["turns"] and not params.get("facts"):
        raise ValueError("memory_write stores nothing: give 'turns' and/or 'facts'")
    if params.get("metadata") and not params.get("facts"):
        raise ValueError("'metadata' belongs to facts: set 'facts' (the fact text field) too")
    if params.get("ttl_s") is not None and not params.get("facts"):
        raise ValueError("'ttl_s' is the facts' TTL: set 'facts' too (turns use turn_ttl_s)")
    return _prepare_store(params, ctx, "facts")


def _fact_texts(record: Any, name: str) -> list[str]:
    v = record.get(name) if isinstance(record, dict) else None
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise FieldError(f"field '{name}' must be a fact text or a list of them, got {v!r}")
    return [x.strip() for x in items if x.strip()]


def _metadata(record: Any, name: str | None) -> dict:
    v = record.get(name) if name and isinstance(record, dict) else None
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise FieldError(f"field '{name}' must be a JSON object of fact metadata, got {v!r}")
    return v


def _build_write(params: dict, ctx: BuildContext) -> OpRuntime:
    import json

    store = open_store(params["_store"])
    embedder, model = _embedder(params, ctx)
    clock = params["clock"] or time.time
    store.purge(clock())
    ufield, sfield, turn_fields = params["user"], params["session"], dict(params["turns"])
    facts_field, meta_field = params.get("facts"), params.get("metadata")
    ttl, turn_ttl = params.get("ttl_s"), params.get("turn_ttl_s")

    def batch_fn(batch: list, errors: list) -> list:
        keep, turns, pending, keys = [], [], [], []
        for r in batch:
            try:
                key = (_record_id(r, ufield), _record_id(r, sfield))
                keys.append(key)
                ts = []
                for role, f in turn_fields.items():
                    text = get_field(r, f)
                    if not isinstance(text, str):
                        raise FieldError(f"field '{f}' ({role} turn) must be text, got "
                                         f"{type(text).__name__}")
                    ts.append(Turn(key[0], key[1], role, text, turn_ttl))
                texts = _fact_texts(r, facts_field) if facts_field else []
                meta = _metadata(r, meta_field)
                json.dumps(meta)
            except (FieldError, TypeError, ValueError) as e:
                errors.append((r, e))
                continue
            keep.append(r)
            turns += ts
            pending += [(key[0], text, meta) for text in texts]
        vecs = embedder.embed([t for _, t, _ in pending]) if pending else []
        facts = [Fact(u, t, v, model, m, ttl) for (u, t, m), v in zip(pending, vecs, strict=True)]
        store.add(turns, facts, clock(), release=keys)  # also ends the sessions' ordered reads
        return keep

    return OpRuntime("map", batch_fn=batch_fn)


register(OpDef(
    "memory_write", "map", _build_write,
    COMMON_PARAMS + (
        Param("turns", (dict,), default={"user": "question", "assistant": "answer"},
              want="a mapping of role -> text field, like {user: question, assistant: answer}",
              check=lambda v: all(isinstance(k, str) and k and isinstance(f, str) and f
                                  for k, f in v.items())),
        Param("facts", (str,), want="a field holding a fact text (or a list) to remember"),
        Param("metadata", (str,), want="a field holding a JSON object stored with the facts"),
        Param("ttl_s", (int, float), want="a positive number of seconds", check=positive),
        Param("turn_ttl_s", (int, float), want="a positive number of seconds",
              check=positive),
        count_param("max_batch", 64)),
    state="shared", blocking=True,
    fields=lambda p: ((p["user"], p["session"]) + tuple(dict(p["turns"]).values()), ()),
    prepare=_prepare_write,
    doc="store the record's turns per session and its facts per user"))
