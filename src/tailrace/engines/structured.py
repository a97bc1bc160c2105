"""Structured output: the ``response_format`` a generation request may carry.

A constraint is OpenAI's ``response_format`` object, checked and normalised by
``check_response_format``: ``{"type": "json_object"}`` (one JSON object), ``{"type":
"json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (JSON that
validates against ``schema``), or ``{"type": "text"}``/nothing (no constraint: None).
An engine enforces the types in its class attribute ``response_formats`` (llama.cpp: a
grammar; ``openai``: passed on to the server) and refuses the others; ``check_answer``
is the check every constrained answer gets afterwards, whatever the engine did.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import EngineError
from .models import engine_class

#: the constraint types there are (``GenerationRequest.response_format["type"]``)
RESPONSE_FORMATS = ("json_object", "json_schema")


def _jsonschema() -> Any:
    try:
        import jsonschema
    except ImportError:
        raise EngineError("structured output (response_format, json_schema) needs the "
                          "jsonschema package; install it with: pip install jsonschema"
                          ) from None
    return jsonschema


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """``schema`` if it is a valid JSON Schema (an object); ValueError naming ``where``."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be an object (a JSON Schema like {{\"type\": "
                         f"\"object\", \"properties\": {{...}}}}), got {type(schema).__name__}")
    jsonschema = _jsonschema()
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise ValueError(f"{where} is not a valid JSON Schema: {at + ': ' if at else ''}"
                         f"{e.message}") from None
    return schema


def check_response_format(fmt: Any, where: str = "response_format") -> dict[str, Any] | None:
    """The normalised constraint of an OpenAI ``response_format`` value ``fmt`` (None:
    plain text); ValueError naming the bad field (prefixed with ``where``)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError(f"{where} must be an object like {{\"type\": \"json_object\"}}, got "
                         f"{type(fmt).__name__}")
    kind = fmt.get("type")
    if kind not in ("text", *RESPONSE_FORMATS):
        raise ValueError(f"{where}.type must be 'text', 'json_object' or 'json_schema', got "
                         f"{kind!r}")
    extra = sorted(set(fmt) - {"type", "json_schema"} if kind == "json_schema"
                   else set(fmt) - {"type"})
    if extra:
        raise ValueError(f"{where}: unknown field {extra[0]!r} for type '{kind}'")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise ValueError(f"{where}.json_schema must be an object like {{\"name\": \"answer\", "
                         f"\"schema\": {{...}}}}, got {type(js).__name__}")
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ValueError(f"{where}.json_schema: unknown field {unknown[0]!r} (it takes name, "
                         "schema, strict, description)")
    name = js.get("name", "response")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.json_schema.name must be a non-empty string, got {name!r}")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.json_schema.strict must be true or false, got {strict!r}")
    if "schema" not in js:
        raise ValueError(f"{where}.json_schema.schema is required: the JSON Schema the answer "
                         "must validate against")
    out: dict[str, Any] = {"name": name,
                           "schema": check_schema(js["schema"], f"{where}.json_schema.schema")}
    if strict is not None:
        out["strict"] = strict
    if isinstance(js.get("description"), str):
        out["description"] = js["description"]
    return {"type": "json_schema", "json_schema": out}


def schema_of(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema of a checked constraint (None for ``json_object``)."""
    return fmt["json_schema"]["schema"] if fmt["type"] == "json_schema" else None


def enforced_by(spec: Any) -> frozenset[str]:
    """The constraint types the engine of ``spec`` (an engine spec, a pool's too)
    enforces: its class's ``response_formats``, found without opening it (empty if none)."""
    return frozenset(getattr(engine_class(spec), "response_formats", ()))


def calls_tools(spec: Any) -> bool:
    """Whether the engine of ``spec`` answers client tools (``GenerationRequest.tools``):
    its class's ``tool_calls``, found without opening it."""
    return bool(getattr(engine_class(spec), "tool_calls", False))


def check_enforceable(spec: Any, fmt: dict[str, Any]) -> None:
    """Raise the engine's own error (e.g. ``StructuredOutputError``) if the engine of
    ``spec`` cannot turn the checked constraint ``fmt`` into one: its class's optional
    ``check_constraint(fmt)`` (llama.cpp: the schema converts to a grammar). Lets callers
    refuse such a schema up front (a 400, a compile error) instead of at generation."""
    check = getattr(engine_class(spec), "check_constraint", None)
    if check is not None:
        check(fmt)


def refuse(engine: Any, requests: Any) -> None:
    """EngineError if a request carries a constraint ``engine`` cannot enforce (engines call
    this first; one without ``response_formats`` enforces none)."""
    kinds = getattr(engine, "response_formats", ())
    for r in requests:
        fmt = getattr(r, "response_format", None)
        if fmt is not None and fmt.get("type") not in kinds:
            raise EngineError(f"engine '{getattr(engine, 'model', '?')}' "
                              f"({type(engine).__name__}) cannot enforce response_format "
                              f"'{fmt.get('type')}'; use a llama_cpp or openai engine")


def check_answer(text: str, fmt: dict[str, Any], finish_reason: str,
                 max_tokens: int) -> str | None:
    """Why the generated ``text`` does not satisfy the checked constraint ``fmt``, in one
    line (None: it does); ``finish_reason`` and ``max_tokens`` explain a cut answer."""
    try:
        value = json.loads(text)
    except ValueError as e:
        if finish_reason == "length":
            return (f"the answer was cut at max_tokens={max_tokens} before its JSON was "
                    "complete; raise max_tokens")
        if finish_reason == "cancelled":
            return "the answer was cancelled before its JSON was complete"
        return f"the answer is not valid JSON ({e}): {text[:80]!r}"
    if fmt["type"] == "json_object":
        if not isinstance(value, dict):
            return f"the answer is JSON but not an object: {text[:80]!r}"
        return None
    jsonschema = _jsonschema()
    schema = schema_of(fmt)
    from referencing import Registry  # (a jsonschema dependency)

    try:  # an empty registry: a client's schema never makes the server fetch a $ref URL
        validator = jsonschema.validators.validator_for(schema)(schema, registry=Registry())
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except Exception as e:  # noqa: BLE001 - e.g. a $ref to a schema not at hand
        return (f"the answer could not be checked against the json_schema "
                f"'{fmt['json_schema']['name']}': {type(e).__name__}: {e}")
    if error is None:
        return None
    at = "/".join(str(p) for p in error.absolute_path)
    return (f"the answer does not match the json_schema '{fmt['json_schema']['name']}'"
            f"{' at ' + at if at else ''}: {error.message}")
