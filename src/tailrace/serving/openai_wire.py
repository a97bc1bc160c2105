"""The OpenAI wire format: request parsing, response and SSE chunk shaping, error bodies.

A parsed request (``WireRequest``) is its text (the last ``user`` message, or the
``prompt``), a chat request's conversation and the sampling options it sets; a field
tailrace cannot honour is a 400 naming it (docs/serving.md, "Request fields", lists
every field). How a pipeline answers is ``binding.py``'s: this module knows nothing of
plans or operators.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engines.structured import check_response_format
from ..engines.tool_calls import ToolSpec, check_tools, split_calls

#: The ``error.type`` OpenAI clients expect for each HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error"}


class WireError(Exception):
    """A request the server refuses: its message (what is wrong and how to fix it, in one
    line), HTTP status, OpenAI ``error.code`` and ``Retry-After`` seconds (or None), as
    ``ServiceError``'s."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


def error_body(message: str, status: int, code: str) -> dict[str, Any]:
    """OpenAI's error JSON: ``{"error": {"message", "type", "code"}}``; ``status``
    chooses the ``type``."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"),
                      "code": code}}


def retry_headers(retry_after: float | None) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` headers (none
    for None)."""
    if retry_after is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(retry_after))),
            "retry-after-ms": str(max(1, math.ceil(retry_after * 1000)))}


def jsonable(v: Any) -> Any:
    """A JSON encoder's ``default``: sets and tuples as lists, numpy values as lists or
    numbers, anything else its repr."""
    if isinstance(v, (set, frozenset, tuple)):
        return list(v)
    tolist = getattr(v, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        return tolist()
    return repr(v)


_encode = json.JSONEncoder(ensure_ascii=False, default=jsonable,
                           separators=(",", ":")).encode


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes; numpy values become lists/numbers, other objects their repr."""
    return _encode(obj).encode()


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# -- requests ----------------------------------------------------------------------------
@dataclass(frozen=True)
class WireRequest:
    """A parsed ``/v1/chat/completions`` or ``/v1/completions`` request."""

    model: str
    text: str
    stream: bool
    include_usage: bool
    chat: bool
    messages: tuple[dict[str, str], ...] | None = None  # chat: the conversation, as text
    options: dict[str, Any] = field(default_factory=dict)  # sampling options it set
    prompts: tuple[str, ...] = ()  # completions with a list of prompts: all of them
    tools: ToolSpec | None = None  # chat: the client tools it offers


#: fields every OpenAI request may carry that tailrace accepts and ignores by design
#: (``user`` and ``metadata`` reach the record only through a pipeline's ``serve:``;
#: ``user`` is also the session id engine pools route by: ``sessions.session_of``)
IGNORED = frozenset({"user", "metadata", "service_tier", "store"})
_HANDLED = frozenset({"model", "stream", "stream_options", "n", "max_tokens", "temperature",
                      "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
                      "logprobs", "logit_bias",
                      "priority", "deadline_ms",  # admission: urgency.py
                      "budget"})  # what the answer may cost: urgency.budget
#: fields only one endpoint has
CHAT_ONLY = frozenset({"messages", "max_completion_tokens", "top_logprobs", "tools",
                       "tool_choice", "parallel_tool_calls", "functions", "function_call",
                       "response_format"})
COMPLETION_ONLY = frozenset({"prompt", "echo", "best_of", "suffix"})
#: the sampling options a request may set (see ``options``)
OPTION_FIELDS = ("max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
                 "frequency_penalty")


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise WireError(f"'{name}' must be a number from {lo:g} to {hi:g}, got {v!r}",
                        code="invalid_parameter")
    return float(v)


def _options(body: dict, chat: bool) -> dict[str, Any]:
    """The sampling options the request sets (absent or null: not set); 400 naming a
    field with a bad value."""
    opts: dict[str, Any] = {}
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise WireError(f"'{name}' must be a positive integer, got {v!r}",
                            code="invalid_parameter")
        opts["max_tokens"] = min(v, opts.get("max_tokens", v))
    for name, lo, hi in (("temperature", 0, 2), ("top_p", 0, 1),
                         ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2)):
        v = _number(body, name, lo, hi)
        if v is not None:
            opts[name] = v
    if opts.get("top_p") == 0:
        raise WireError("'top_p' must be above 0", code="invalid_parameter")
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise WireError(f"'seed' must be an integer, got {seed!r}", code="invalid_parameter")
        opts["seed"] = seed
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 \
                or not all(isinstance(x, str) and x for x in stops):
            raise WireError("'stop' must be a string or a list of at most 4 non-empty "
                            f"strings, got {stop!r}", code="invalid_parameter")
        if stops:
            opts["stop"] = tuple(stops)
    if chat:
        try:
            fmt = check_response_format(body.get("response_format"))
        except ValueError as e:
            raise WireError(str(e), code="invalid_response_format") from None
        if fmt is not None:
            opts["response_format"] = fmt
    return opts


def _unsupported(name: str, why: str) -> WireError:
    return WireError(f"'{name}' is not supported: {why}", code="unsupported_parameter")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """400 naming the first field tailrace cannot honour (see docs/serving.md's table)."""
    own = CHAT_ONLY if chat else COMPLETION_ONLY
    for name in body:
        if name not in _HANDLED and name not in IGNORED and name not in own:
            raise WireError(f"'{name}' is not a field tailrace accepts on this endpoint "
                            "(docs/serving.md lists them)", code="unsupported_parameter")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise WireError(f"'n' must be 1 (one answer per request), got {n!r}",
                        code="unsupported_n")
    lp = body.get("logprobs")
    if lp not in (None, False) and not (not chat and lp == 0):
        raise _unsupported("logprobs", "no token log-probabilities are returned")
    if body.get("top_logprobs") is not None:
        raise _unsupported("top_logprobs", "no token log-probabilities are returned")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "logits cannot be biased per request")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise _unsupported(name, "the deprecated functions API is not served; send "
                               "'tools' and 'tool_choice'")
    if body.get("echo"):
        raise _unsupported("echo", "the prompt is not echoed")
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of", "one answer per request")
    if body.get("suffix"):
        raise _unsupported("suffix", "no insertion mode")


def _common(body: dict, chat: bool) -> tuple[str, bool, bool]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise WireError("'model' is required: the name of a served pipeline "
                        "(GET /v1/models lists them)", code="missing_model")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise WireError(f"'stream' must be true or false, got {stream!r}",
                        code="invalid_stream")
    _refuse_unsupported(body, chat)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise WireError("'stream_options' must be an object like {\"include_usage\": true}",
                        code="invalid_stream_options")
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise WireError(f"'stream_options.include_usage' must be true or false, got "
                        f"{include_usage!r}", code="invalid_stream_options")
    return model, stream, include_usage


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise WireError(f"messages[{i}].content[{j}].type: '{kind}' parts are not "
                                "supported (text only: no image or audio input here)",
                                code="unsupported_content")
            if not isinstance(p, dict) or p.get("type") != "text" \
                    or not isinstance(p.get("text"), str):
                raise WireError(f"messages[{i}].content: only text parts "
                                "({\"type\": \"text\", \"text\": ...}) are supported",
                                code="invalid_content")
            parts.append(p["text"])
        return "".join(parts)
    raise WireError(f"messages[{i}].content must be a string or a list of text parts, got "
                    f"{type(content).__name__}", code="invalid_content")


_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked (400 naming the bad one)."""
    if not isinstance(calls, list) or not calls:
        raise WireError(f"messages[{i}].tool_calls must be a non-empty list",
                        code="invalid_messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function" \
                or not isinstance(c.get("id"), str) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            raise WireError(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": "
                            "\"function\", \"function\": {\"name\", \"arguments\": JSON text}}",
                            code="invalid_messages")
        out.append({"id": c["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def parse_messages(messages: Any) -> tuple[str, tuple[dict[str, Any], ...]]:
    """A chat's messages, checked: (the last user message's text, the conversation).
    Assistant ``tool_calls`` and ``tool`` results are kept; it ends with a user or tool
    message. ``WireError`` (400) naming the bad message."""
    if not isinstance(messages, list) or not messages:
        raise WireError("'messages' must be a non-empty list like "
                        "[{\"role\": \"user\", \"content\": \"...\"}]", code="invalid_messages")
    text = None
    conv: list[dict[str, Any]] = []
    called: set[str] = set()  # the ids of the calls made so far
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise WireError(f"messages[{i}] must be an object with a 'role' and 'content'",
                            code="invalid_messages")
        role = m["role"]
        if role not in _CHAT_ROLES:
            raise WireError(f"messages[{i}].role: '{role}' is not supported (system, "
                            "developer, user, assistant and tool messages are)",
                            code="unsupported_role")
        content = m.get("content")
        if len(m) == 2 and type(content) is str and role != "tool":  # the common case
            conv.append({"role": role, "content": content})
            if role == "user":
                text = content
            continue
        extra = sorted(set(m) - _MESSAGE_KEYS)
        if extra:
            raise WireError(f"messages[{i}].{extra[0]} is not supported (no audio or "
                            "function_call messages here)", code="unsupported_message_field")
        if m.get("tool_calls") is not None and role != "assistant":
            raise WireError(f"messages[{i}].tool_calls: only assistant messages carry calls",
                            code="invalid_messages")
        msg: dict[str, Any] = {"role": role}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
            called.update(c["id"] for c in msg["tool_calls"])
            msg["content"] = "" if m.get("content") is None else _content_text(m["content"], i)
        else:
            msg["content"] = _content_text(m.get("content"), i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise WireError(f"messages[{i}].tool_call_id is required: the id of the call "
                                "this message answers", code="invalid_messages")
            if m["tool_call_id"] not in called:
                raise WireError(f"messages[{i}].tool_call_id: '{m['tool_call_id']}' answers no "
                                "call of an earlier assistant message's tool_calls",
                                code="invalid_messages")
            msg["tool_call_id"] = m["tool_call_id"]
        elif m.get("tool_call_id") is not None:
            raise WireError(f"messages[{i}].tool_call_id: only tool messages carry one",
                            code="invalid_messages")
        conv.append(msg)
        if role == "user":
            text = msg["content"]
    if text is None:
        raise WireError("'messages' has no user message; the last user message is the "
                        "pipeline's input", code="no_user_message")
    if conv[-1]["role"] not in ("user", "tool"):
        raise WireError(f"messages[{len(conv) - 1}]: the conversation must end with a user "
                        f"or tool message (got '{conv[-1]['role']}' last)",
                        code="invalid_messages")
    return text, tuple(conv)


def check_tool_fields(tools: Any, choice: Any, parallel: Any, *, flat: bool = False
                      ) -> ToolSpec | None:
    """The request's ``ToolSpec`` (None: no tools); 400 naming the bad field."""
    try:
        return check_tools(tools, choice, parallel, flat=flat)
    except ValueError as e:
        raise WireError(str(e), code="invalid_tools") from None


def parse_chat(body: dict) -> WireRequest:
    """Parse a chat completion request; raises ``WireError`` (400) naming the bad field.
    The conversation must end with a ``user`` (or ``tool``) message; its last user
    message is the pipeline's input."""
    model, stream, include_usage = _common(body, True)
    text, conv = parse_messages(body.get("messages"))
    tools = check_tool_fields(body.get("tools"), body.get("tool_choice"),
                              body.get("parallel_tool_calls")) \
        if "tools" in body or "tool_choice" in body or "parallel_tool_calls" in body else None
    options = _options(body, True)
    if tools is not None and tools.offered and "response_format" in options:
        raise _unsupported("response_format", "not together with 'tools' (send one)")
    return WireRequest(model, text, stream, include_usage, chat=True, messages=conv,
                       options=options, tools=tools)


#: most prompts one ``/v1/completions`` request may carry (each is a record in the pipeline)
MAX_PROMPTS = 64


def parse_completion(body: dict) -> WireRequest:
    """Parse a (legacy) completion request; raises ``WireError`` (400). Each prompt of
    a list is its own record and its own choice, by index; a list is not streamed."""
    model, stream, include_usage = _common(body, False)
    prompt = body.get("prompt")
    prompts: tuple[str, ...] = ()
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise WireError(f"'prompt' has {len(prompt)} prompts; at most {MAX_PROMPTS} per "
                            "request", code="too_many_prompts")
        if len(prompt) > 1:
            if stream:
                raise WireError("'stream' with a list of prompts is not supported; stream "
                                "one prompt per request, or send the list without 'stream'",
                                code="unsupported_parameter")
            prompts = tuple(prompt)
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, int) and not isinstance(p, bool)
            or isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        raise WireError("'prompt': token-id arrays are not supported; send the text (a "
                        "string or a list of strings)", code="unsupported_prompt")
    if not isinstance(prompt, str):
        raise WireError("'prompt' must be a string or a non-empty list of strings",
                        code="invalid_prompt")
    return WireRequest(model, prompt, stream, include_usage, chat=False,
                       options=_options(body, False), prompts=prompts)


# -- responses ---------------------------------------------------------------------------
def completion_body(req: WireRequest, rid: str, created: int,
                    answers: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """The non-streaming response object (``created``: Unix seconds): one choice per
    answer (its text, finish reason and usage; a completion's list of prompts gives
    several, in order), usage summed."""
    choices: list[dict[str, Any]] = []
    for i, (a, f, _) in enumerate(answers):
        if not req.chat:
            choices.append({"index": i, "text": a, "finish_reason": f, "logprobs": None})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": a}
        content, calls = split_calls(a) if req.tools is not None else (a, [])
        if calls:  # an answer in the call form is its tool_calls
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": [{"id": call_id(), "type": "function",
                                       "function": {"name": n, "arguments": args}}
                                      for n, args in calls]}
            f = "tool_calls" if f == "stop" else f
        choices.append({"index": i, "finish_reason": f, "logprobs": None, "message": message})
    usage: dict[str, Any] = {k: sum(u[k] for _, _, u in answers)
                             for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                 for _, _, u in answers)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    by: dict[str, int] = {}
    for _, _, u in answers:  # a collaborative engine's tokens per model
        for m, n in u.get("completion_tokens_details", {}).get("by_model", {}).items():
            by[m] = by.get(m, 0) + n
    if by:
        usage["completion_tokens_details"] = {"by_model": by}
    if any("cost" in u for _, _, u in answers):
        usage["cost"] = sum(u.get("cost", 0.0) for _, _, u in answers)
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion",
            "created": created, "model": req.model, "choices": choices, "usage": usage}


def call_id() -> str:
    """A new tool call's id."""
    return "call_" + uuid.uuid4().hex[:24]


def call_delta(event: tuple) -> list[dict[str, Any]]:
    """A chat chunk's ``delta.tool_calls`` for a ``CallStream`` call event: a call's start
    (its index, a new id, the name, empty arguments), or more of its arguments."""
    if event[0] == "call":
        return [{"index": event[1], "id": call_id(), "type": "function",
                 "function": {"name": event[2], "arguments": ""}}]
    return [{"index": event[1], "function": {"arguments": event[2]}}]


def chunk(req: WireRequest, rid: str, created: int, text: str | None,
          finish: str | None = None, *, role: bool = False,
          usage: dict[str, Any] | None = None,
          tool_calls: list[dict[str, Any]] | None = None) -> bytes:
    """One streamed SSE chunk (``text`` None and ``usage`` given: the usage-only chunk;
    ``role``: the first chat chunk, with ``role: assistant``; ``tool_calls``: a chat
    delta's calls, ``call_delta``'s)."""
    choices: list[dict[str, Any]]
    if text is None and usage is not None:
        choices = []
    elif req.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish,
                    "logprobs": None}]
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if req.chat
                           else "text_completion", "created": created, "model": req.model,
                           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return sse(out)
