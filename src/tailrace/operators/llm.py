"""Generation operators: ``prompt`` (fill a template) and ``generate`` (call an LLM).

``generate`` calls its engine once per micro-batch, so concurrent requests share one
batched decode; an answer constrained to JSON that does not match becomes an error
record. A served record's request (``tailrace/request.py``) shapes the call: options,
granted priority, token sink and cancel (docs/serving.md, "Conversations").
"""

from __future__ import annotations

import string
from typing import Any

from ..engines import GenerationRequest
from ..engines.models import batches_continuously
from ..engines.price import price_of
from ..engines.structured import (
    calls_tools,
    check_answer,
    check_enforceable,
    check_schema,
    enforced_by,
)
from ..engines.tool_calls import split_calls
from ..errors import ContextOverflow, EngineError, StructuredOutputError
from ..request import request_of
from .common import (
    ENGINE_HINT,
    FieldError,
    count_param,
    each_record,
    link_engine,
    non_negative,
)
from .core import per_record
from .registry import Answers, BuildContext, OpDef, OpRuntime, Param, register


def template_fields(template: str) -> tuple[str, ...]:
    """The ``{field}`` names a template uses, in order, without repeats."""
    names: list[str] = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None:
            base = name.split(".")[0].split("[")[0]
            if not base:
                raise ValueError(f"template {template!r} has a positional '{{}}'; "
                                 "name the field, like {question}")
            if base not in names:
                names.append(base)
    return tuple(names)


def render(template: str, record: Any) -> str:
    try:
        return template.format_map(record)
    except KeyError as e:
        have = ", ".join(map(str, record)) if isinstance(record, dict) else ""
        raise FieldError(f"template needs field {e} (record has: {have or 'no fields'})") from None
    except (TypeError, AttributeError):
        raise FieldError(f"template needs a JSON object, got {type(record).__name__}") from None


def _check_template(params: dict, ctx: Any) -> dict:
    template_fields(params["template"])
    return params


# what generate, route and tool_call share: the prompt is a template or a field's text
PROMPT_PARAMS = (Param("prompt", (str,), want="a template with {field} placeholders"),
                 Param("input", (str,), want="a field holding the prompt text"))
TEMPERATURE = Param("temperature", (int, float), default=0.0, want="a number >= 0",
                    check=non_negative)


def check_prompt_source(params: dict, op: str) -> None:
    """ValueError unless exactly one of 'prompt' and 'input' is set; checks the template."""
    if (params.get("prompt") is None) == (params.get("input") is None):
        raise ValueError(f"{op} needs exactly one of 'prompt' (a template with {{fields}}) "
                         "or 'input' (a field holding the prompt text)")
    if params.get("prompt") is not None:
        template_fields(params["prompt"])


def prompt_reads(params: dict) -> tuple[str, ...]:
    """The fields the prompt is made of."""
    return template_fields(params["prompt"]) if params.get("prompt") else (params["input"],)


def prompt_text(template: str | None, inp: str | None, record: Any) -> str:
    """The prompt of ``record``: ``template`` filled in, else the text of field ``inp``."""
    if template is not None:
        return render(template, record)
    value = record.get(inp) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise FieldError(f"field '{inp}' must hold the prompt text")
    return value


def _build_prompt(params: dict, ctx: BuildContext) -> OpRuntime:
    template, out = params["template"], params["output"]
    f = lambda r: {**r, out: render(template, r)}  # noqa: E731
    return OpRuntime("map", batch_fn=per_record(f), record_fn=lambda x: [f(x)])


register(OpDef(
    "prompt", "map", _build_prompt,
    (Param("template", (str,), required=True, want="a text with {field} placeholders"),
     Param("output", (str,), default="prompt", want="a field name")),
    fields=lambda p: (template_fields(p["template"]), (p["output"],)),
    prepare=_check_template, doc="fill a template with record fields"))


#: tokens a chat template adds around each message (role markers, separators): an
#: estimate used when fitting a conversation into the context window
MESSAGE_OVERHEAD = 8
_SYSTEM_ROLES = ("system", "developer")


def chat_messages(system: str | None, conversation: Any, latest: str,
                  count: Any, limit: int) -> tuple[dict[str, Any], ...]:
    """The chat a stage answering a conversation sends (docs/serving.md,
    "Conversations"): one system message, the earlier turns, ``latest`` (the rendered
    prompt, in place of the last user message), then what came after it (an
    assistant's tool calls and their results). Oldest turns go first when it does not
    fit in ``limit`` tokens (``count``: a text's tokens, plus ``MESSAGE_OVERHEAD`` a
    message)."""
    if not isinstance(conversation, (list, tuple)):
        raise FieldError(f"the conversation must be a list of messages, got "
                         f"{type(conversation).__name__}")
    systems = [system] if system else []
    turns: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    last_user = max((i for i, m in enumerate(conversation)
                     if isinstance(m, dict) and m.get("role") == "user"), default=-1)
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
                or m.get("role") not in ("user", "assistant", "tool", *_SYSTEM_ROLES):
            raise FieldError(f"conversation message {i} must be {{'role': system|user|"
                             "assistant|tool, 'content': text}")
        if m["role"] in _SYSTEM_ROLES:
            systems.append(m["content"])
        elif i < last_user:
            turns.append(dict(m))
        elif i > last_user:
            after.append(dict(m))
    head = ({"role": "system", "content": "\n\n".join(systems)},) if systems else ()
    tail = ({"role": "user", "content": latest}, *after)

    def cost(m: dict[str, Any]) -> int:
        calls = m.get("tool_calls") or ()
        return count(m["content"]) + MESSAGE_OVERHEAD + sum(
            count(c["function"]["name"] + c["function"]["arguments"]) for c in calls)

    fixed = sum(cost(m) for m in head + tail)
    if fixed > limit:
        raise ContextOverflow(
            f"the system prompt and the latest question take about {fixed} tokens; the "
            f"model context leaves {limit} for the prompt (after max_tokens); shorten them "
            "or lower max_tokens")
    costs = [cost(m) for m in turns]
    total = fixed + sum(costs)
    k = 0
    while k < len(turns) and (total > limit or k and turns[k]["role"] != "user"):
        total -= costs[k]
        k += 1
    return head + tuple(turns[k:]) + tail


#: the per-request options a generate stage takes from its request's ``options``
OPTIONS = ("max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
           "frequency_penalty", "response_format")


#: what generate, route and tool_call share: the conversation field and frozen options
MESSAGES = Param("messages", (str, bool), want="a field holding the conversation (a list "
                 "of {role, content}), e.g. _messages; false: answer the prompt alone",
                 check=lambda v: v is False or isinstance(v, str))
FROZEN = Param("frozen", (list,), want=f"a list of request options the request may not set "
               f"(of {', '.join(OPTIONS)})",
               check=lambda v: isinstance(v, list) and all(x in OPTIONS for x in v))


#: the ``messages:`` value that names the conversation a served chat request carries
CONVERSATION = "_messages"


def answering(record: Any, out: str) -> dict | None:
    """The served request's options when the stage writing field ``out`` answers it;
    else None."""
    req = request_of(record)
    return req.options_for(out) if req is not None else None


def answers(record: Any, out: str) -> bool:
    """Whether the stage writing ``out`` answers the record's served request (and so
    reports its reply), with or without options."""
    req = request_of(record)
    return req is not None and req.answers == out


def stream_of(record: Any, out: str) -> Any:
    """The request's token sink if the stage writing ``out`` streams to it
    (``Request.sink_for``); else None."""
    req = request_of(record)
    return req.sink_for(out) if req is not None else None


def cancel_of(record: Any) -> Any:
    """The record's request's cancel signal, or None (a record of a batch run)."""
    req = request_of(record)
    return req.cancel if req is not None else None


def cancelled(record: Any) -> bool:
    """Whether the record's request was cancelled (its caller gave up)."""
    c = cancel_of(record)
    return c is not None and c.is_set()


def conversation(record: Any, field: str | bool | None, out: str, chat: bool = True) -> Any:
    """The conversation the stage writing ``out`` answers, or None: the record field
    ``field`` names (``_messages``: its request's); by default (``field`` None) its
    request's when it answers that request; ``False``: none (``messages: false``).
    ``chat``: whether its engine takes chat messages; a default conversation with more
    than the latest user message is then a FieldError."""
    if field is False or type(record) is not dict:
        return None
    if field is None:
        req = request_of(record)
        conv = req.messages if req is not None and req.answers == out else None
        if conv is None or chat:
            return conv
        if len(conv) > 1:
            raise FieldError("the request's system messages and earlier turns cannot reach "
                             "this stage's model: its engine takes a raw prompt (use a chat "
                             "model, or send only the last user message)")
        return None
    req = request_of(record) if field == CONVERSATION else None
    return req.messages if req is not None else record.get(field)


def tools_of(record: Any, out: str) -> Any:
    """The client tools the request offers the stage writing ``out``, or None."""
    req = request_of(record)
    return req.tools_for(out) if req is not None else None


def with_urgency(kw: dict[str, Any], record: Any) -> dict[str, Any]:
    """``kw`` plus the class and deadline admission granted the record's request, and
    its session, for engines that schedule by them (docs/engines.md)."""
    req = request_of(record)
    if req is None:
        return kw
    u = req.granted
    if u is not None:
        kw = {**kw, "priority": u[0], "deadline": u[1]}
    if isinstance(req.session, str):
        kw = {**kw, "session": req.session}
    return kw


def report(record: Any, out: str, finish: str | None, usage: dict[str, int],
           cost: float | None = None) -> None:
    """The stage writing ``out`` reports its answer (and what it cost, None: unpriced) to
    the record's request (kept when it is the answering stage)."""
    req = request_of(record)
    if req is not None:
        req.report(out, finish, usage, cost)


def request_options(base: dict[str, Any], opts: dict | None,
                    frozen: frozenset[str]) -> dict[str, Any]:
    """The sampling settings of one request: the stage's ``base``, overridden by the
    request's ``opts`` (None: ``base``) except the ``frozen`` ones; ``max_tokens``
    never above the stage's, ``stop`` added to its."""
    if opts is None:
        return base
    kw = dict(base)
    for k in OPTIONS:
        v = opts.get(k)
        if v is None or k in frozen:
            continue
        if k == "max_tokens":
            kw[k] = max(1, min(int(v), base["max_tokens"]))
        elif k == "stop":
            kw[k] = tuple(base.get("stop") or ()) + tuple(v)
        elif k == "seed":
            kw[k] = int(v)
        elif k == "response_format":
            kw[k] = v  # checked by the wire (engines.structured.check_response_format)
        else:
            kw[k] = float(v)
    return kw


def _prepare_generate(params: dict, ctx: Any) -> dict:
    check_prompt_source(params, "generate")
    params = link_engine(params, ctx, "generate")
    if params.get("json_schema") is not None:
        check_schema(params["json_schema"], "generate: json_schema")
        if "json_schema" not in enforced_by(params["_engine"]):
            raise ValueError(f"generate: json_schema needs an engine that enforces it "
                             f"(llama_cpp or openai); engine '{params['engine']}' (backend "
                             f"'{params['_engine'].get('backend')}') cannot")
        try:  # e.g. a schema llama.cpp cannot turn into a grammar
            check_enforceable(params["_engine"], {"type": "json_schema", "json_schema": {
                "name": params["output"], "schema": params["json_schema"]}})
        except EngineError as e:
            raise ValueError(f"generate: json_schema: {e}") from None
    return params


def _build_generate(params: dict, ctx: BuildContext) -> OpRuntime:
    engine = ctx.open_engine(params["_engine"])
    chat = getattr(engine, "chat", True)
    template, inp, out = params.get("prompt"), params.get("input"), params["output"]
    system = params.get("system")
    conv_field = params.get("messages")
    if conv_field not in (None, False) and not chat:
        raise ValueError(f"generate: 'messages: {conv_field}' needs a chat model; engine "
                         f"'{engine.model}' takes a raw prompt (drop 'messages')")
    usage = params.get("usage")
    stop = tuple(params.get("stop") or ())
    max_tokens, temperature = params["max_tokens"], float(params["temperature"])
    frozen = frozenset(params.get("frozen") or ())
    limit = engine.context_length - max_tokens
    base: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "stop": stop}
    if params.get("json_schema") is not None:
        base["response_format"] = {"type": "json_schema", "json_schema": {
            "name": out, "schema": params["json_schema"]}}
    enforced = enforced_by(params["_engine"])
    price = price_of(params["_engine"])
    spent = [0.0]  # this replica's spend in this run (the stage's ``cost`` counter)

    def request(record: Any) -> GenerationRequest:
        text = prompt_text(template, inp, record)
        kw = with_urgency(request_options(base, answering(record, out), frozen), record)
        fmt = kw.get("response_format")
        if fmt is not None and fmt.get("type") not in enforced:
            raise EngineError(f"response_format '{fmt.get('type')}' cannot be enforced by "
                              f"engine '{params['engine']}'; use a llama_cpp or openai engine")
        conv = conversation(record, conv_field, out, chat)
        if conv is not None:
            msgs = chat_messages(system, conv, text, engine.count_tokens, limit)
            return GenerationRequest(messages=msgs, tools=tools_of(record, out), **kw)
        n = engine.count_tokens(text)
        if n > limit:
            raise ContextOverflow(
                f"prompt has {n} tokens; with max_tokens={max_tokens} it exceeds the model "
                f"context of {engine.context_length} tokens; shorten it (e.g. a refine "
                "stage's max_tokens) or lower max_tokens")
        if chat:
            msgs = ({"role": "system", "content": system},) if system else ()
            return GenerationRequest(messages=msgs + ({"role": "user", "content": text},),
                                     **kw)
        return GenerationRequest(prompt=text, **kw)

    def call(records: list, reqs: list, errors: list) -> list:
        streams = [stream_of(r, out) for r in records]
        cancels = [cancel_of(r) for r in records]
        on_token = None
        if any(callable(s) for s in streams) or any(c is not None for c in cancels):
            def on_token(i: int, piece: str) -> bool:
                s = streams[i]
                if callable(s):
                    s(piece)
                c = cancels[i]
                return c is None or not c.is_set()  # False: the engine stops this one
        gens = engine.generate(reqs, on_token)
        result = []
        for rec, q, g in zip(records, reqs, gens, strict=True):
            fmt = q.response_format
            why = fmt and check_answer(g.text, fmt, g.finish_reason, q.max_tokens)
            if why and g.finish_reason == "length" and q.max_tokens >= max_tokens:
                why += (f" (this stage's max_tokens, {max_tokens}, is the ceiling: raise it "
                        "in the pipeline)")
            if why:  # the answer is not the JSON asked for: this record fails
                errors.append((rec, StructuredOutputError(why)))
                continue
            r = {**rec, out: g.text}
            counts: dict[str, Any] = {"prompt_tokens": g.prompt_tokens,
                                      "completion_tokens": g.completion_tokens}
            cost = g.extra.get("cost") if price is None else \
                price.cost(g.prompt_tokens, g.completion_tokens)
            if "large_tokens" in g.extra:  # a collaborative engine: who wrote how much
                x = g.extra
                counts["by_model"] = {x["small_model"]: x["small_tokens"],
                                      x["large_model"]: x["large_tokens"]} \
                    if x["small_model"] != x["large_model"] else \
                    {x["small_model"]: x["small_tokens"] + x["large_tokens"]}
            if cost is not None:
                spent[0] += cost
            if usage is not None:
                r[usage] = dict(counts) if cost is None else {**counts, "cost": cost}
            if answers(r, out):  # it answers a served request
                cached = g.extra.get("cached_tokens")
                if cached:  # prompt tokens whose KV the engine reused (prefix cache)
                    counts["cached_tokens"] = cached
                finish = g.finish_reason
                if q.tools is not None and finish == "stop" and split_calls(g.text)[1]:
                    finish = "tool_calls"  # its answer is a call to a client tool
                report(r, out, finish, counts, cost)
            result.append(r)
        return result

    def batch_fn(batch: list, errors: list) -> list:
        keep, reqs = each_record(batch, errors, request)
        if not keep:
            return []
        try:
            return call(keep, reqs, errors)
        except (ContextOverflow, StructuredOutputError):
            # the chat template tipped one over, or one's schema cannot be enforced:
            # isolate it
            result = []
            for r, q in zip(keep, reqs, strict=True):
                try:
                    result += call([r], [q], errors)
                except (ContextOverflow, StructuredOutputError) as e:
                    errors.append((r, e))
            return result

    # no record_fn: the runtime calls batch_fn([x]) per record and raises its error
    return OpRuntime("map", batch_fn=batch_fn,
                     counters=None if price is None else lambda: {"cost": spent[0]})


def _client_tools(p: dict) -> str | None:
    """Why a generate stage cannot answer client tools (None: it can)."""
    if p.get("json_schema") is not None:
        return "its answer is held to its json_schema"
    if not calls_tools(p["_engine"]):
        return (f"its engine '{p['engine']}' (backend '{p['_engine'].get('backend')}') does "
                "not call tools (llama_cpp and openai engines do)")
    return None


register(OpDef(
    "generate", "map", _build_generate,
    (Param("engine", (str,), required=True, want=ENGINE_HINT),
     *PROMPT_PARAMS,
     Param("output", (str,), default="answer", want="a field name"),
     Param("system", (str,), want="a system message (chat models)"),
     MESSAGES,
     count_param("max_tokens", 64),
     TEMPERATURE,
     Param("stop", (list,), want="a list of stop strings"),
     FROZEN,
     Param("json_schema", (dict,), want="a JSON Schema the answer must match (JSON "
           "output, enforced by the engine: llama_cpp or openai)"),
     count_param("max_batch", 8),
     Param("usage", (str,), want="a field for {prompt_tokens, completion_tokens} (and "
           "cost, when the engine has a price)")),
    batchable=True, blocking=True,
    engine_batches=lambda p: batches_continuously(p["_engine"], "generate"),
    fields=lambda p: (prompt_reads(p), (p["output"],) + ((p["usage"],) if p.get("usage") else ())),
    prepare=_prepare_generate, doc="generate text with an LLM engine",
    answers=Answers(output_tokens=lambda p: int(p["max_tokens"]),
                    max_tokens=lambda p: int(p["max_tokens"]),
                    usage_field=lambda p: p.get("usage"),
                    enforces=lambda p: enforced_by(p["_engine"]), tools=_client_tools)))

