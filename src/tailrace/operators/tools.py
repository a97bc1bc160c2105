"""Tool use: ``tool_call`` lets a model call the pipeline's registered Python functions
and the tools of the MCP servers the stage names.

The formats, rounds and failures are in docs/stateful.md (``tool_call``, "MCP servers").
Every round, the records of a micro-batch are generated together; a reply's calls are
checked against the tools its request may use and their JSON schemas, run with a
per-call timeout (``tool_runner.py``), and their results appended to the conversation.
A timed-out function call is abandoned, not killed (Python cannot stop a thread): its
result is discarded; a timed-out MCP call is cancelled. As a served request's
answering stage every round takes the request's options and the answer streams whole
(docs/serving.md, "Which stage answers"); a set cancel ends the conversation.
"""

from __future__ import annotations

import json
import keyword
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..engines import GenerationRequest
from ..engines.models import batches_continuously
from ..engines.tokens import approx_tokens
from ..errors import EngineError
from ..request import request_of
from .common import ENGINE_HINT, FieldError, count_param, each_record, link_engine, positive
from .llm import (
    FROZEN,
    MESSAGES,
    PROMPT_PARAMS,
    TEMPERATURE,
    answering,
    answers,
    cancel_of,
    cancelled,
    chat_messages,
    check_prompt_source,
    conversation,
    prompt_reads,
    prompt_text,
    report,
    request_options,
    stream_of,
)
from .mcp_config import check_servers
from .mcp_tools import open_servers
from .registry import (
    Answers,
    BuildContext,
    LinkContext,
    OpDef,
    OpRuntime,
    Param,
    register,
    resolve,
)
from .tool_runner import ToolRunner
from .tool_schema import ToolError, check_schema, parse_json_call


class Conversation:
    """One record's conversation: messages, the calls made, and how it ended.

    options: the sampling settings of every round (the stage's, with a served request's
             options applied: ``request_options``).
    finish:  the finish reason of the round that answered.
    usage:   ``[prompt_tokens, completion_tokens]`` over all its rounds.
    tools:   the names of the tools its request may see and call (None: all).
    """

    __slots__ = ("record", "messages", "calls", "answer", "error", "options", "finish",
                 "usage", "tools")

    def __init__(self, record: Any, messages: list[dict],
                 options: dict[str, Any] | None = None,
                 tools: tuple[str, ...] | None = None) -> None:
        self.record, self.messages = record, messages
        self.calls: list[dict] = []
        self.answer: str | None = None
        self.error: Exception | None = None
        self.options = options or {}
        self.finish = "stop"
        self.usage = [0, 0]
        self.tools = tools


JSON_CONVENTION = ("You can call these tools:\n{tools}\nTo call a tool, reply with only this "
                   "JSON and nothing else: {{\"tool\": \"NAME\", \"arguments\": {{...}}}}\n"
                   "Otherwise reply with the answer.")
FINAL = "Answer now in plain text, without calling tools."


class JsonChat:
    """Local engines: tool calls by the JSON convention, results as user messages."""

    def __init__(self, engine: Any, params: dict) -> None:
        """Bind a generation engine and the stage's ``max_tokens`` and ``temperature``."""
        self.engine, self.chat = engine, getattr(engine, "chat", True)
        self.max_tokens, self.temperature = params["max_tokens"], float(params["temperature"])

    def _request(self, conv: Conversation, tools_on: bool) -> GenerationRequest:
        msgs = conv.messages + ([] if tools_on else [{"role": "user", "content": FINAL}])
        kw = {"max_tokens": self.max_tokens, "temperature": self.temperature,
              **conv.options}
        if self.chat:
            return GenerationRequest(messages=tuple(msgs), **kw)
        text = "".join(m["content"] + "\n\n" if m["role"] == "system" else
                       f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs)
        kw["stop"] = ("\nUser:", *(kw.get("stop") or ()))
        return GenerationRequest(prompt=text + "Assistant:", **kw)

    def _generate(self, convs: list[Conversation], reqs: list) -> list:
        """The engine's generations; a conversation whose cancel is set stops at its
        next token (nothing streams: a reply is only known not to call a tool when it is
        complete)."""
        if not any(cancel_of(c.record) is not None for c in convs):
            return self.engine.generate(reqs)
        return self.engine.generate(reqs, lambda i, piece: not cancelled(convs[i].record))

    def __call__(self, convs: list[Conversation], tools_on: bool) -> list:
        """Per conversation: ``(text, [(id, name, arguments)], (prompt_tokens,
        completion_tokens, finish_reason))`` or the exception."""
        reqs = [self._request(c, tools_on) for c in convs]
        try:
            gens: list = self._generate(convs, reqs)
        except Exception:  # noqa: BLE001 - isolate the record that failed
            gens = []
            for c, q in zip(convs, reqs, strict=True):
                try:
                    gens += self._generate([c], [q])
                except Exception as e:  # noqa: BLE001
                    gens.append(e)
        out: list = []
        for g in gens:
            if isinstance(g, Exception):
                out.append(g)
                continue
            call = parse_json_call(g.text)
            out.append((g.text.strip(), [(None, *call)] if call else [],
                        (g.prompt_tokens, g.completion_tokens, g.finish_reason)))
        return out

    def assistant(self, text: str, calls: list) -> dict:
        return {"role": "assistant", "content": text}

    def result(self, call_id: Any, name: str, value: Any) -> dict:
        return {"role": "user", "content": f"Result of {name}: "
                                           f"{json.dumps(value, default=str)}"}


class OpenAIChat:
    """``openai`` engines: OpenAI function calling (``tools`` in, ``tool_calls`` out)."""

    def __init__(self, spec: dict, runner: ToolRunner, params: dict) -> None:
        """Create a client for the server of the openai engine ``spec`` (base_url or
        endpoints, model, api_key[_env]...): the engine class has no tools API. ``runner``:
        the stage's tools; ``params``: its ``max_tokens`` and ``temperature``."""
        import os

        import openai

        env = spec.get("api_key_env")
        key = spec.get("api_key") or (os.environ.get(env) if env else None) or "not-needed"
        self.base_url = spec.get("base_url") or spec["endpoints"][0]
        self.model = spec["model"]
        self.client: Any = openai.OpenAI(base_url=self.base_url, api_key=key,
                                    timeout=float(spec.get("timeout_s", 60)),
                                    max_retries=int(spec.get("retries", 2)))
        self.pool = ThreadPoolExecutor(int(spec.get("concurrency", 8)),
                                       thread_name_prefix="tailrace-toolchat")
        self.runner = runner
        self.kw = {"max_tokens": params["max_tokens"], "temperature": float(params["temperature"])}

    def _one(self, conv: Conversation, tools_on: bool) -> Any:
        kw: dict[str, Any] = {**self.kw, **conv.options}
        if kw.get("stop"):
            kw["stop"] = list(kw["stop"])
        else:
            kw.pop("stop", None)
        try:
            tools = self.runner.openai_tools(conv.tools) if tools_on else None
            if tools:
                kw = {**kw, "tools": tools, "tool_choice": "auto"}
            resp = self.client.chat.completions.create(model=self.model,
                                                       messages=conv.messages, **kw)
        except Exception as e:  # noqa: BLE001 - becomes this record's error
            return EngineError(f"openai engine at {self.base_url} (model '{self.model}'): "
                               f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        msg = resp.choices[0].message
        u = getattr(resp, "usage", None)
        spent = (int(getattr(u, "prompt_tokens", 0) or 0),
                 int(getattr(u, "completion_tokens", 0) or 0),
                 resp.choices[0].finish_reason or "stop")
        calls = []
        for tc in msg.tool_calls or []:
            try:
                args: Any = json.loads(tc.function.arguments or "{}")
            except ValueError as e:
                args = ToolError(f"not valid JSON ({e}): {tc.function.arguments[:80]!r}")
            calls.append((tc.id, tc.function.name, args))
        return (msg.content or "").strip(), calls, spent

    def __call__(self, convs: list[Conversation], tools_on: bool) -> list:
        """Per conversation: ``(text, [(id, name, arguments)], (prompt_tokens,
        completion_tokens, finish_reason))`` or the exception."""
        return list(self.pool.map(lambda c: self._one(c, tools_on), convs))

    def assistant(self, text: str, calls: list) -> dict:
        return {"role": "assistant", "content": text, "tool_calls": [
            {"id": i, "type": "function", "function": {
                "name": n, "arguments": json.dumps(a if isinstance(a, dict) else {})}}
            for i, n, a in calls]}

    def result(self, call_id: Any, name: str, value: Any) -> dict:
        return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(value, default=str)}


def _build_tool_call(params: dict, ctx: BuildContext) -> OpRuntime:
    tools, timeout_ms = params.get("tools") or [], params["tool_timeout_ms"]
    # the MCP servers' tools: their connections are this replica's until ``close``
    remote, close = open_servers(params.get("mcp") or [], timeout_ms,
                                 {t["name"]: t for t in tools})
    try:
        batch_fn = _conversations(params, ctx, ToolRunner(tools, timeout_ms / 1000, remote))
    except BaseException:
        close()
        raise
    return OpRuntime("map", batch_fn=batch_fn, close=close)


def _conversations(params: dict, ctx: BuildContext, runner: ToolRunner) -> Any:
    """The stage's ``batch_fn``: each record's conversation with the model and ``runner``."""
    spec = params["_engine"]
    fmt = params["format"]
    if fmt == "auto":
        fmt = "openai" if spec.get("backend") == "openai" else "json"
    chat: Any = (OpenAIChat(spec, runner, params) if fmt == "openai"
                 else JsonChat(ctx.open_engine(spec), params))
    template, inp, out = params.get("prompt"), params.get("input"), params["output"]
    calls_field, max_rounds, on_error = params["calls"], params["max_rounds"], params["on_error"]
    conv_field, frozen = params.get("messages"), frozenset(params.get("frozen") or ())
    base = {"max_tokens": params["max_tokens"], "temperature": float(params["temperature"]),
            "stop": ()}
    head = params.get("system") or ""
    systems: dict[tuple[str, ...], str] = {}  # by the tools a request may see

    def system_of(names: tuple[str, ...]) -> str:
        if names not in systems:
            systems[names] = head if fmt != "json" else (
                (head + "\n\n" if head else "")
                + JSON_CONVENTION.format(tools=runner.describe(names)))
        return systems[names]

    chat_model = fmt == "openai" or bool(getattr(chat, "chat", True))
    if fmt == "json":
        count, limit = chat.engine.count_tokens, chat.engine.context_length - base["max_tokens"]
        if conv_field not in (None, False) and not chat.chat:
            raise ValueError(f"tool_call: 'messages: {conv_field}' needs a chat model; engine "
                             f"'{chat.engine.model}' takes a raw prompt (drop 'messages')")
    else:  # no tokenizer for a remote model: the shared estimate, its declared context
        count, limit = approx_tokens, int(spec.get("context_length") or 1 << 30)

    def start(r: Any) -> Conversation:
        text = prompt_text(template, inp, r)
        opts = request_options(base, answering(r, out), frozen)
        q = request_of(r)
        names = runner.visible(q.tenant if q is not None else None)
        system = system_of(names)
        conv = conversation(r, conv_field, out, chat_model)
        if conv is not None:
            return Conversation(r, list(chat_messages(system or None, conv, text, count,
                                                      limit)), opts, names)
        msgs = [{"role": "system", "content": system}] if system else []
        return Conversation(r, msgs + [{"role": "user", "content": text}], opts, names)

    def batch_fn(batch: list, errors: list) -> list:
        convs: list[Conversation] = each_record(batch, errors, start, FieldError)[1]
        active = convs
        for rnd in range(1, max_rounds + 2):
            final = rnd > max_rounds
            for conv in active:
                if cancelled(conv.record):  # its caller gave up: no further round
                    conv.answer, conv.finish = "", "cancelled"
            active = [c for c in active if c.answer is None]
            if not active:
                break
            replies = chat(active, not final)
            pending = []
            for conv, reply in zip(active, replies, strict=True):
                if isinstance(reply, Exception):
                    conv.error = reply
                    continue
                text, calls, (p_tokens, c_tokens, finish) = reply
                conv.usage[0] += p_tokens
                conv.usage[1] += c_tokens
                if cancelled(conv.record):  # its caller gave up: no further round
                    conv.answer, conv.finish = text, "cancelled"
                elif not calls:
                    conv.answer, conv.finish = text, finish
                    s = stream_of(conv.record, out)
                    if s is not None and text:
                        s(text)  # the answer, whole: only now is it known not to be a call
                elif final:
                    conv.error = ToolError(f"no answer after max_rounds={max_rounds} rounds of "
                                           "tool calls: the model still calls tools")
                else:
                    conv.messages.append(chat.assistant(text, calls))
                    pending += [(conv, c) for c in calls]
            running = [(conv, c, *runner.start(c[1], c[2], rnd, conv.tools))
                       for conv, c in pending]
            for conv, (call_id, name, args), fut, deadline, err in running:
                result = None
                if fut is not None:
                    result, err = runner.finish(name, fut, deadline, rnd)
                conv.calls.append({"round": rnd, "tool": name, "arguments": args,
                                   **({"error": err} if err else {"result": result})})
                if err and on_error == "record":
                    conv.error = conv.error or ToolError(err)
                conv.messages.append(chat.result(call_id, name, {"error": err} if err else result))
            active = [c for c in active if c.answer is None and c.error is None]
            if not active:
                break
        result = []
        for conv in convs:
            if conv.error is not None:
                errors.append((conv.record, conv.error))
            else:
                r = {**conv.record, out: conv.answer, calls_field: conv.calls}
                if answers(r, out):  # it answers a served request
                    report(r, out, conv.finish, {"prompt_tokens": conv.usage[0],
                                                 "completion_tokens": conv.usage[1]})
                result.append(r)
        return result

    return batch_fn


def _prepare_tool_call(params: dict, ctx: LinkContext) -> dict:
    check_prompt_source(params, "tool_call")
    tools = params["tools"]
    if params.get("mcp") is not None:
        params["mcp"] = check_servers(params["mcp"])
    elif tools is None:
        raise ValueError("needs 'tools' (registered functions: {name, fn, schema}) or "
                         "'mcp' (MCP servers: {name, command | url})")
    if tools is not None and not tools and not params.get("mcp"):
        raise ValueError("'tools' is empty; register at least one {name, fn, schema}")
    tools = tools or []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or set(t) - {"name", "fn", "schema", "description",
                                                "timeout_ms"}:
            raise ValueError(f"{where} must be a mapping with name, fn, schema (optional: "
                             f"description, timeout_ms), got {t!r}")
        name = t.get("name")
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"{where}.name must be an identifier like get_weather, got "
                             f"{name!r}")
        if name in seen:
            raise ValueError(f"{where}: tool '{name}' is registered twice")
        seen.add(name)
        try:
            resolve(t.get("fn"))
        except ValueError as e:
            raise ValueError(f"{where}.fn: {e}") from None
        check_schema(t.get("schema", {"type": "object"}), f"{where}.schema")
        ms = t.get("timeout_ms")
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or ms <= 0):
            raise ValueError(f"{where}.timeout_ms must be a positive number, got {ms!r}")
    params = link_engine(params, ctx, "generate")
    backend = params["_engine"].get("backend")
    if params["format"] == "openai" and backend != "openai":
        raise ValueError(f"format 'openai' needs an openai engine; engine "
                         f"'{params['engine']}' is {backend} (use format: json)")
    return params


register(OpDef(
    "tool_call", "map", _build_tool_call,
    (Param("engine", (str,), required=True, want=ENGINE_HINT),
     Param("tools", (list,), want="a list of {name, fn, schema} mappings"),
     Param("mcp", (list,), want="a list of MCP servers: {name, command: [...]} or "
           "{name, url: http://.../mcp}"),
     *PROMPT_PARAMS,
     Param("system", (str,), want="a system message"),
     MESSAGES,
     Param("output", (str,), default="answer", want="a field name"),
     Param("calls", (str,), default="tool_calls", want="a field for the calls made"),
     Param("format", (str,), default="auto", want="auto, openai or json",
           check=lambda v: v in ("auto", "openai", "json")),
     count_param("max_rounds", 3),
     Param("tool_timeout_ms", (int, float), default=5000, want="a positive number",
           check=positive),
     Param("on_error", (str,), default="record", want="record or model",
           check=lambda v: v in ("record", "model")),
     count_param("max_tokens", 128),
     TEMPERATURE,
     FROZEN,
     count_param("max_batch", 8)),
    batchable=True, blocking=True, fusable=False,
    engine_batches=lambda p: batches_continuously(p["_engine"], "generate"),
    fields=lambda p: (prompt_reads(p), (p["output"], p["calls"])),
    prepare=_prepare_tool_call,
    doc="let a model call registered tools and MCP servers' tools, then answer",
    answers=Answers(output_tokens=lambda p: int(p["max_tokens"]) * (int(p["max_rounds"]) + 1),
                    max_tokens=lambda p: int(p["max_tokens"]),
                    tools=lambda p: "it is a tool_call stage that calls the pipeline's own "
                    "tools; client tools would compete with them (send the request without "
                    "'tools', or serve a pipeline that answers with a generate stage)")))
