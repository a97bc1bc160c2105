"""JSON-schema checks for tool arguments, and the JSON tool-call convention of small models.

The supported schema subset: ``type`` (one or a list), ``properties``, ``required``,
``enum``, ``items``, ``additionalProperties: false``; ``description``, ``title`` and
``default`` are accepted and ignored. Any other keyword is refused when the pipeline is
compiled, so no constraint is silently skipped.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import TailraceError

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),)}
_KEYWORDS = {"type", "properties", "required", "enum", "items", "description",
             "additionalProperties", "title", "default"}


class ToolError(TailraceError):
    """A tool call failed: unknown tool, invalid arguments, the tool raised or timed out."""


def check_schema(schema: Any, where: str = "schema") -> None:
    """Refuse a JSON schema outside the supported subset: ValueError naming ``where``."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a mapping like {{type: object, properties: ...}}")
    extra = sorted(set(schema) - _KEYWORDS)
    if extra:
        raise ValueError(f"{where}: unsupported JSON-schema keyword(s) {', '.join(extra)}; "
                         f"supported: {', '.join(sorted(_KEYWORDS))}")
    types = schema.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in _TYPES:
            raise ValueError(f"{where}.type: unknown type {t!r}; use one of "
                             f"{', '.join(_TYPES)}")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"{where}.properties must be a mapping of name -> schema")
    for name, sub in props.items():
        check_schema(sub, f"{where}.properties.{name}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required must be a list of property names")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{where}.enum must be a list of allowed values")
    if "items" in schema:
        check_schema(schema["items"], f"{where}.items")
    if not isinstance(schema.get("additionalProperties", False), bool):
        raise ValueError(f"{where}.additionalProperties: only true or false is supported")


def _is(value: Any, t: str) -> bool:
    if isinstance(value, bool) and t in ("integer", "number"):
        return False
    return isinstance(value, _TYPES[t]) or (t == "integer" and isinstance(value, float)
                                            and value.is_integer())


def validate(value: Any, schema: dict, path: str = "arguments") -> None:
    """Check the decoded JSON ``value`` against ``schema`` (one that passed
    ``check_schema``); ToolError names the first wrong path (from ``path``) and why.

    >>> validate({"city": 5}, {"type": "object", "properties": {"city": {"type": "string"}}})
    Traceback (most recent call last):
    tailrace.operators.tool_schema.ToolError: arguments.city: expected string, got integer 5
    """
    types = schema.get("type")
    if types is not None:
        allowed = types if isinstance(types, list) else [types]
        if not any(_is(value, t) for t in allowed):
            got = next((n for n in ("boolean", "integer", "number", "string", "object",
                                    "array", "null") if _is(value, n)), type(value).__name__)
            raise ToolError(f"{path}: expected {' or '.join(allowed)}, got {got} "
                            f"{json.dumps(value, default=str)[:60]}")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolError(f"{path}: {json.dumps(value, default=str)[:60]} is not one of "
                        f"{json.dumps(schema['enum'])}")
    if isinstance(value, dict):
        for name in schema.get("required", []):
            if name not in value:
                raise ToolError(f"{path}: missing required property '{name}'")
        props = schema.get("properties", {})
        for name, v in value.items():
            if name in props:
                validate(v, props[name], f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                raise ToolError(f"{path}: unexpected property '{name}' (allowed: "
                                f"{', '.join(props) or 'none'})")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            validate(v, schema["items"], f"{path}[{i}]")


def parse_json_call(text: str) -> tuple[str, Any] | None:
    """``(tool name, arguments)`` when the model's reply is a JSON-convention tool call,
    else None.

    >>> parse_json_call('```json\\n{"tool": "add", "arguments": {"a": 1}}\\n```')
    ('add', {'a': 1})
    >>> parse_json_call("Paris is sunny.") is None
    True
    """
    start = text.find("{")
    if start < 0:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("tool"), str):
        return None
    return obj["tool"], obj.get("arguments", {})
