"""What the built-in operators share: reading a record's field, linking a stage to a
declared engine, counting tokens for a budget, and parameter checks.

>>> get_field({"q": "hi"}, "q")
'hi'
>>> get_field({"q": "hi"}, "text")
Traceback (most recent call last):
...
tailrace.errors.FieldError: record has no field 'text' (it has: q)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engines import check_spec
from ..engines.tokens import approx_tokens
from ..errors import FieldError
from ..request import field_list
from .registry import BuildContext, LinkContext, Param

ENGINE_HINT = "a name declared under 'engines:'"


def get_field(record: Any, name: str) -> Any:
    """``record[name]``, or a FieldError that says which fields the record has."""
    try:
        return record[name]
    except KeyError:
        raise FieldError(f"record has no field '{name}' (it has: {field_list(record)})") from None
    except TypeError:
        raise FieldError(f"stage reads field '{name}' but the record is a "
                         f"{type(record).__name__}, not a JSON object") from None


def each_record(batch: list, errors: list, fn: Callable[[Any], Any],
                catch: type[Exception] = Exception) -> tuple[list, list]:
    """``(records, values)``: ``fn(record)`` of each record for which it did not raise
    ``catch``; a record for which it did goes to ``errors`` as ``(record, exception)``.

    >>> errors = []
    >>> each_record([4, 0, 2], errors, lambda x: 8 // x), errors
    (([4, 2], [2, 4]), [(0, ZeroDivisionError('integer division or modulo by zero'))])
    """
    keep, values = [], []
    for r in batch:
        try:
            values.append(fn(r))
        except catch as e:  # this record only
            errors.append((r, e))
            continue
        keep.append(r)
    return keep, values


def non_negative(v: Any) -> bool:
    """True for a number >= 0 (not a bool)."""
    return not isinstance(v, bool) and v >= 0


def positive(v: Any) -> bool:
    """True for a number > 0 (not a bool)."""
    return not isinstance(v, bool) and v > 0


def count_param(name: str, default: int | None = None, *, required: bool = False) -> Param:
    """An integer parameter >= 1: a batch size, a token budget, a number of rounds."""
    return Param(name, (int,), required=required, default=default, want="a positive integer",
                 check=lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)


def link_engine(params: dict, ctx: LinkContext, kind: str, *, key: str = "engine") -> dict:
    """Resolve ``params[key]`` (an engine name declared in ``ctx``) to its spec in
    ``params['_' + key]``; ``params`` is changed in place and returned. ``kind``: what the
    stage calls the engine for ("embed" or "generate")."""
    name = params.get(key)
    if name is None:
        raise ValueError(f"needs '{key}' ({ENGINE_HINT})")
    if name not in ctx.engines:
        declared = ", ".join(ctx.engines) or "none"
        raise ValueError(f"unknown engine '{name}' (declared engines: {declared}); add it "
                         f"under 'engines:' like {name}: {{backend: ..., model: ...}}")
    spec = ctx.engines[name]
    check_spec(name, spec, kind)
    params["_" + key] = {**spec, "_name": name}  # pools and cluster engines go by name
    return params


def link_token_counter(params: dict, ctx: LinkContext) -> dict:
    """Link the engine whose tokenizer counts a token budget: ``params['engine']`` if
    given, else the pipeline's only generation engine, else none (``approx_tokens``);
    ``params`` is changed in place and returned."""
    if params.get("engine"):
        return link_engine(params, ctx, "generate")
    gens = [n for n, s in ctx.engines.items() if isinstance(s, dict) and
            (s.get("backend") == "llama_cpp" or
             (s.get("backend") == "openai" and s.get("kind", "generate") == "generate"))]
    if len(gens) == 1:  # count tokens with the pipeline's generation model
        params["engine"] = gens[0]
        return link_engine(params, ctx, "generate")
    return params


def token_counter(params: dict, ctx: BuildContext) -> Callable[[str], int]:
    """The token count a stage linked by ``link_token_counter`` uses at run time."""
    if params.get("_engine"):
        return ctx.open_engine(params["_engine"]).count_tokens
    return approx_tokens
