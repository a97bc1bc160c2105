"""The OpenAI Responses API's wire format (``POST /v1/responses``; docs/responses.md).

A request is parsed (``parse_responses``) into what the chat path takes: its input items
become a chat conversation (function calls as an assistant's ``tool_calls``, their
outputs as ``tool`` messages), ``instructions`` a system message first, the sampling
and format fields the chat options; ``ResponsesRequest.wire`` then puts a stored
conversation (``previous_response_id``) before it and makes the ``WireRequest`` the
chat helpers check and submit. A field tailrace cannot honour is a 400 naming it. The
answer's side (output items, the response object, stream events) is
``responses_output.py``'s; the routes are ``responses_routes.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engines.structured import check_response_format
from ..engines.tool_calls import ToolSpec
from .openai_wire import WireError, WireRequest, check_tool_fields, parse_messages
from .responses_output import call_item, new_id

#: the fields honoured (``priority``, ``deadline_ms``, ``budget``, ``user``: as on chat)
HANDLED = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                     "parallel_tool_calls", "previous_response_id", "store",
                     "max_output_tokens", "temperature", "top_p", "text", "stream",
                     "truncation", "priority", "deadline_ms", "budget", "user"})
#: accepted and ignored by design (``metadata`` is echoed, and mapped by ``serve:``)
IGNORED = frozenset({"metadata", "service_tier", "stream_options"})
#: accepted only when off (null, false, empty); otherwise 400 saying why
OFF_ONLY = {
    "reasoning": "no reasoning effort or summaries (the models served do not reason apart)",
    "include": "no extra output data (reasoning content, logprobs, search results) is "
               "returned",
    "background": "a response is answered while the request waits (no background mode)",
    "prompt": "no stored prompt templates; send 'input' and 'instructions'",
    "max_tool_calls": "only client function tools, whose calls the client runs and bounds",
    "top_logprobs": "no token log-probabilities are returned",
    "conversation": "the Conversations API is not served; chain responses with "
                    "'previous_response_id'",
}


def unsupported(name: str, why: str) -> WireError:
    return WireError(f"'{name}' is not supported: {why}", code="unsupported_parameter")


def invalid(message: str) -> WireError:
    return WireError(message, code="invalid_input")


# -- requests ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponsesRequest:
    """A parsed ``POST /v1/responses``: this request's input as chat messages (``own``)
    and as input items with ids (``items``), the chat options and tools it sets, and the
    request fields its response object repeats (``echo``)."""

    model: str
    stream: bool
    own: tuple[dict[str, Any], ...]
    items: tuple[dict[str, Any], ...]
    instructions: str | None
    previous: str | None
    store: bool
    options: dict[str, Any]
    tools: ToolSpec | None
    echo: dict[str, Any]

    def wire(self, history: list[dict[str, Any]]) -> WireRequest:
        """The chat request this one is: ``instructions`` first, then ``history`` (the
        previous response's conversation), then this input; 400 without a user message,
        or for a function_call_output that answers no call."""
        conv = ([{"role": "system", "content": self.instructions}] if self.instructions
                else []) + list(history) + list(self.own)
        if not any(m["role"] == "user" for m in conv):
            raise WireError("'input' has no user message (nor has the previous response's "
                            "conversation); the last user message is the pipeline's input",
                            code="no_user_message")
        called = {c["id"] for m in conv for c in m.get("tool_calls", ())}
        for i, item in enumerate(self.items):
            if item["type"] == "function_call_output" and item["call_id"] not in called:
                raise invalid(f"input[{i}].call_id: '{item['call_id']}' answers no "
                              "function_call (of this input or the previous response's "
                              "output)")
        text, checked = parse_messages(conv)
        return WireRequest(self.model, text, self.stream, True, chat=True, messages=checked,
                           options=self.options, tools=self.tools)

    def shell(self, rid: str, created: int) -> dict[str, Any]:
        """The response object before any output (``status``: in_progress)."""
        return {"id": rid, "object": "response", "created_at": created,
                "status": "in_progress", "background": False, "error": None,
                "incomplete_details": None, "instructions": self.instructions,
                "max_output_tokens": self.options.get("max_tokens"), "model": self.model,
                "output": [], "previous_response_id": self.previous,
                "reasoning": {"effort": None, "summary": None}, "store": self.store,
                "truncation": "auto", "usage": None, **self.echo}


def _text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as text; 400 naming a bad part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text parts")
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text") and isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif isinstance(kind, str) and kind not in ("input_text", "output_text"):
            raise WireError(f"{where}[{j}].type: '{kind}' parts are not supported (text only: "
                            "input_text and output_text; no image, file or audio input)",
                            code="unsupported_content")
        else:
            raise invalid(f"{where}[{j}] must be {{\"type\": \"input_text\", \"text\": ...}}")
    return "".join(parts)


_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"}}
_ROLES = ("user", "system", "developer", "assistant")


def _strings(item: dict[str, Any], where: str, *names: str) -> None:
    for k in names:
        if not isinstance(item.get(k), str):
            raise invalid(f"{where}.{k} must be a string")
    if item.get("id") is not None and not isinstance(item["id"], str):
        raise invalid(f"{where}.id must be a string")


def parse_input(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``input`` as (chat messages, input items with ids); 400 naming a bad item."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid("'input' must be a string or a non-empty list of items like "
                      "[{\"role\": \"user\", \"content\": \"...\"}]")
    conv: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for i, it in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise invalid(f"{where} must be an object (a message, function_call or "
                          "function_call_output item)")
        kind = it.get("type", "message" if "role" in it else None)
        if kind not in _ITEM_KEYS:
            raise WireError(f"{where}.type: {kind!r} items are not supported (message, "
                            "function_call and function_call_output items are)",
                            code="unsupported_input_item")
        extra = sorted(k for k in set(it) - _ITEM_KEYS[kind] if it[k] is not None)
        if extra:
            raise invalid(f"{where}.{extra[0]}: not a field of a {kind} item")
        if kind == "message":
            role = it.get("role")
            if role not in _ROLES:
                raise invalid(f"{where}.role: {role!r} is not supported (user, system, "
                              "developer and assistant are)")
            _strings(it, where)
            text = _text(it.get("content"), f"{where}.content")
            conv.append({"role": role, "content": text})
            items.append({"id": it.get("id") or new_id("msg"), "type": "message", "role": role,
                          "status": "completed", "content": [
                              {"type": "output_text", "text": text, "annotations": []}
                              if role == "assistant" else {"type": "input_text", "text": text}]})
        elif kind == "function_call":
            _strings(it, where, "call_id", "name", "arguments")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if conv and conv[-1]["role"] == "assistant":  # an answer's text and its calls
                conv[-1].setdefault("tool_calls", []).append(call)
            else:
                conv.append({"role": "assistant", "content": "", "tool_calls": [call]})
            items.append(call_item(it["name"], it["arguments"], it["call_id"], it.get("id")))
        else:
            _strings(it, where, "call_id")
            output = _text(it.get("output"), f"{where}.output")
            conv.append({"role": "tool", "tool_call_id": it["call_id"], "content": output})
            items.append({"id": it.get("id") or new_id("fco"), "type": "function_call_output",
                          "call_id": it["call_id"], "output": output, "status": "completed"})
    if conv[-1]["role"] not in ("user", "tool"):
        raise invalid(f"input[{len(raw) - 1}]: the input must end with a user message or a "
                      f"function_call_output (got a {conv[-1]['role']} "
                      f"{'function_call' if conv[-1].get('tool_calls') else 'message'} last)")
    return conv, items


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi \
            or (name == "top_p" and v == 0):
        raise WireError(f"'{name}' must be a number from {lo:g} to {hi:g}"
                        f"{' (above 0)' if name == 'top_p' else ''}, got {v!r}",
                        code="invalid_parameter")
    return float(v)


def _text_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``text`` as (the chat ``response_format`` constraint or None, its echo)."""
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise WireError("'text' must be an object like {\"format\": {\"type\": \"text\"}}",
                        code="invalid_response_format")
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise unsupported(f"text.{extra[0]}", "'text' takes 'format'")
    if text.get("verbosity") is not None:
        raise unsupported("text.verbosity", "the models served have no verbosity setting")
    fmt = text.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    chat = fmt
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        extra = sorted(set(fmt) - {"type", *keys})
        if extra:
            raise WireError(f"text.format: unknown field '{extra[0]}' for type 'json_schema' "
                            "(it takes name, schema, strict, description)",
                            code="invalid_response_format")
        chat = {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    try:
        checked = check_response_format(chat, "text.format")
    except ValueError as e:
        raise WireError(str(e).replace("text.format.json_schema", "text.format"),
                        code="invalid_response_format") from None
    return checked, {"format": fmt}


def _refuse(body: dict) -> None:
    """400 naming the first field tailrace cannot honour (docs/responses.md's table)."""
    for name in body:
        if name not in HANDLED and name not in IGNORED and name not in OFF_ONLY:
            raise WireError(f"'{name}' is not a field tailrace accepts on /v1/responses "
                            "(docs/responses.md lists them)", code="unsupported_parameter")
    for name, why in OFF_ONLY.items():
        v = body.get(name)
        if not (v in (None, False, 0, [], {}) or isinstance(v, dict)
                and all(x is None for x in v.values())):
            raise unsupported(name, why)
    if body.get("truncation") not in (None, "auto"):
        raise unsupported("truncation", "the answering stage drops the oldest turns of a "
                          "conversation that does not fit its context ('auto'; send 'auto' "
                          "or leave it out)")
    tools = body.get("tools")
    for i, t in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(t, dict) and isinstance(t.get("type"), str) and t["type"] != "function":
            raise unsupported(f"tools[{i}].type", f"'{t['type']}' is a tool that runs on "
                              "OpenAI's side; tailrace serves client function tools only")


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise WireError(f"'{name}' must be true or false, got {v!r}", code="invalid_parameter")
    return v


def parse_responses(body: dict) -> ResponsesRequest:
    """Parse a ``POST /v1/responses`` body; ``WireError`` (400) naming the bad field."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise WireError("'model' is required: the name of a served pipeline "
                        "(GET /v1/models lists them)", code="missing_model")
    _refuse(body)
    stream, store = _flag(body, "stream", False), _flag(body, "store", True)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise WireError("'instructions' must be a string (a system message put first)",
                        code="invalid_parameter")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise WireError("'previous_response_id' must be a response id (resp_...)",
                        code="invalid_parameter")
    own, items = parse_input(body.get("input"))
    tools = check_tool_fields(body.get("tools"), body.get("tool_choice"),
                              body.get("parallel_tool_calls"), flat=True)
    options: dict[str, Any] = {}
    mot = body.get("max_output_tokens")
    if mot is not None:
        if isinstance(mot, bool) or not isinstance(mot, int) or mot < 1:
            raise WireError(f"'max_output_tokens' must be a positive integer, got {mot!r}",
                            code="invalid_parameter")
        options["max_tokens"] = mot
    for name, hi in (("temperature", 2), ("top_p", 1)):
        v = _number(body, name, 0, hi)
        if v is not None:
            options[name] = v
    fmt, text_echo = _text_format(body.get("text"))
    if fmt is not None:
        options["response_format"] = fmt
        if tools is not None and tools.offered:
            raise unsupported("text.format", "not together with 'tools' (send one)")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise WireError("'metadata' must be an object of string values",
                        code="invalid_metadata")
    echo = {"metadata": meta or {},
            "parallel_tool_calls": tools.parallel if tools is not None
            else _flag(body, "parallel_tool_calls", True),
            "temperature": options.get("temperature"), "top_p": options.get("top_p"),
            "text": text_echo, "tool_choice": body.get("tool_choice") or "auto",
            "tools": [{"type": "function", "name": t["name"],
                       "description": t.get("description"),
                       "parameters": t.get("parameters"), "strict": t.get("strict")}
                      for t in body.get("tools") or ()],
            "user": body.get("user")}
    return ResponsesRequest(model, stream, tuple(own), tuple(items), instructions or None,
                            previous, store, options, tools, echo)
