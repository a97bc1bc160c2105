"""The HTTP request handlers: each takes the app's state (``AppState``) and the request.

``request_record`` is the one place an HTTP request becomes what its pipeline runs: the
record (user fields and the pipeline's ``serve:`` fields) and its typed ``Request``
(``tailrace/request.py``: options, urgency, session, conversation, tenant);
the handlers parse (``openai_wire.py``, ``embeddings.py``), bind (``binding.py``),
submit through ``relay.py`` (disconnects, streams) and shape the response.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from ..engines.tokens import approx_tokens
from ..engines.tool_calls import CallStream
from ..request import Request as Envelope
from .app_state import AppState
from .binding import (
    Binding,
    answer_of,
    check_conversation,
    finish_reason,
    request_options,
    usage_of,
)
from .embeddings import embed_texts, embeddings_body, parse_embeddings
from .errors import RequestFailed, ServiceError, ServiceUnavailable
from .openai_wire import (
    WireError,
    WireRequest,
    call_delta,
    chunk,
    completion_body,
    dumps,
    error_body,
    parse_chat,
    parse_completion,
    sse,
)
from .relay import Relay, sse_response, unless_gone
from .service import Cancel, PipelineService
from .sessions import session_of
from .tenants import Tenant, request_fields
from .urgency import budget, urgency


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


async def read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object; 413 over ``limit`` bytes, 400 if malformed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise WireError(f"request body is {int(declared)} bytes; the limit is {limit} bytes",
                        status=413, code="request_too_large")
    # the ASGI messages read directly (Starlette's ``stream()`` is an async generator:
    # a few microseconds per request on the hot path); a body mostly comes in one
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await request.receive()
        if message["type"] != "http.request":  # http.disconnect: the client left
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > limit:
            raise WireError(f"request body exceeds the limit of {limit} bytes",
                            status=413, code="request_too_large")
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if not body:
        raise WireError("request body is empty; send a JSON object", code="empty_body")
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise WireError(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise WireError(f"request body must be a JSON object, got {type(obj).__name__}",
                        code="invalid_body")
    return obj


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


def flag(request: Request, name: str) -> bool:
    """A boolean query parameter (``?stream=true``); 400 for a value that is not one."""
    if not request.scope.get("query_string"):
        return False  # no query: nothing to parse (the hot path)
    raw = request.query_params.get(name)
    if raw is None or raw.lower() in _FALSE:
        return False
    if raw.lower() in _TRUE:
        return True
    raise WireError(f"{request.url.path}: query.{name}: not a boolean ({raw!r}); use true or "
                    "false", code="invalid_parameter")


def request_record(state: AppState, name: str, fields: dict[Any, Any], request: Request,
                   tenant: Tenant | None, *, body: dict | None = None, text: str = "",
                   n: int = 1, options: dict[str, Any] | None = None,
                   answers: str | None = None,
                   messages: tuple[dict[str, Any], ...] | None = None,
                   tools: Any = None) -> tuple[dict[Any, Any], Envelope]:
    """What an HTTP request submits to pipeline ``name``: the record, ``fields``
    (updated in place) with the pipeline's ``serve:`` fields (the tenant's last: the
    caller cannot choose it), and its ``Request``. Checks them (400 naming a bad one),
    then charges the tenant for ``text`` and ``n`` records' output tokens (429 over).
    ``body``: the OpenAI request's JSON object; None for ``/runs`` (headers only)."""
    serve = state.serves[name]
    headers = request.headers
    urgent = urgency(serve, name, body, headers)
    spend = budget(state.bindings[name].budget, name, body, headers)
    session = session_of(body, headers)
    if serve is not None:
        fields.update(request_fields(serve, fields if body is None else body, headers))
    if tenant is not None:
        if serve is not None and serve.tenant:
            fields[serve.tenant] = tenant.name
        state.tenants.admit(tenant, approx_tokens(text) + n * state.reserve[name])
    # engine pools route a session's requests together (``session``)
    return fields, Envelope(options=options, answers=answers, asked=urgent, session=session,
                            messages=list(messages) if messages is not None else None,
                            tools=tools,
                            tenant=tenant.name if tenant is not None else None,
                            budget=spend)


async def _submit(request: Request, service: PipelineService, record: dict,
                  env: Envelope) -> Any:
    """The output record; ``ClientGone`` (499) when the client left first."""
    cancel = Cancel()
    return await unless_gone(request, service.submit(record, cancel=cancel, request=env),
                             cancel)


# -- routes ------------------------------------------------------------------------------
async def healthz(state: AppState, request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(state: AppState, request: Request) -> Response:
    pipes = {}
    for name, s in state.hub.services.items():
        f = s.failure
        pipes[name] = {"ready": s.ready, "error": state.redact(f"{type(f).__name__}: {f}")
                       if f is not None else None}
    ready = all(p["ready"] for p in pipes.values())
    return json_response({"ready": ready, "pipelines": pipes}, 200 if ready else 503)


async def models(state: AppState, request: Request) -> Response:
    state.tenant_of(request)  # no limits: listing models costs nothing
    listed = {**state.meta, **{name: {"endpoints": ["embeddings"], "engine": spec.get("model")}
                               for name, spec in state.engines.items()}}
    return json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": state.started, "owned_by": "tailrace",
         "metadata": meta} for name, meta in listed.items()]})


async def embeddings(state: AppState, request: Request) -> Response:
    tenant = state.tenant_of(request)
    body = await read_json(request, state.limit)
    req = parse_embeddings(body)
    spec = state.engines.get(req.model)
    if spec is None:
        service = state.service(req.model)
    if tenant is not None:
        state.tenants.admit(tenant, approx_tokens(dumps(body.get("input")).decode()))
    if spec is None:
        spec = state.embed_specs[req.model]
        if spec is None:
            raise WireError(f"pipeline '{req.model}' has no embed stage to embed with; "
                            "serve one with an embed stage for /v1/embeddings",
                            code="pipeline_not_embedding")
        if not service.ready:
            raise ServiceUnavailable(f"pipeline '{req.model}' is not running (loading, "
                                     "stopped or failed; GET /readyz says which)")
    try:
        vecs, tokens = await asyncio.to_thread(embed_texts, spec, req)
    except (WireError, ServiceError):
        raise
    except Exception as e:  # noqa: BLE001 - the engine failed: a 500 naming it
        raise ServiceError(f"embedding engine '{spec.get('_name', 'engine')}': "
                           f"{type(e).__name__}: {e}", code="embedding_failed") from None
    return json_response(embeddings_body(req, vecs, tokens))


async def completions(state: AppState, request: Request, chat: bool) -> Response:
    """``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    tenant = state.tenant_of(request)
    body = await read_json(request, state.limit)
    req = parse_chat(body) if chat else parse_completion(body)
    service = state.service(req.model)
    b = state.bindings[req.model]
    if b.problem is not None:
        raise WireError(b.problem, code="pipeline_not_chat")
    check_conversation(b, req, req.model)
    record, env = request_record(
        state, req.model, {b.input_field: req.text}, request, tenant, body=body,
        text="".join(req.prompts) if req.prompts else req.text, n=len(req.prompts) or 1,
        options=request_options(b, req, req.model), answers=b.answer_field,
        messages=req.messages, tools=req.tools)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if req.prompts:
        return await _several(request, service, b, req, record, env, rid, created)
    if req.stream:
        return await _stream_openai(state, request, service, b, req, record, env, rid, created)
    out = await _submit(request, service, record, env)
    return json_response(completion_body(req, rid, created,
                                         [_answered(b, out, env.reply, req.text)]))


async def runs(state: AppState, request: Request) -> Response:
    tenant = state.tenant_of(request)
    service = state.service(request.path_params["name"])
    stream = flag(request, "stream")
    record = await read_json(request, state.limit)
    bad = [k for k in record if k.startswith("_")]
    if bad:
        raise WireError(f"record fields starting with '_' are reserved (transient); "
                        f"got {', '.join(bad)}", code="reserved_field")
    record, env = request_record(state, service.name, record, request, tenant,
                                 text=dumps(record).decode() if tenant is not None else "")
    if stream:
        return await _stream_runs(state, request, service, record, env)
    return json_response(await _submit(request, service, record, env))


# -- answers -----------------------------------------------------------------------------
async def _several(request: Request, service: PipelineService, b: Binding,
                   req: WireRequest, record: dict, env: Envelope, rid: str,
                   created: int) -> Response:
    """A completion request with a list of prompts: one record (and request) per prompt,
    submitted together (they share the pipeline's micro-batches); the first failure
    fails the request and cancels the others' work."""
    cancel = Cancel()
    records = [{**record, b.input_field: p} for p in req.prompts]
    envs = [env.fork() for _ in records]

    async def every() -> list[dict]:
        tasks = [asyncio.ensure_future(service.submit(r, cancel=cancel, request=e))
                 for r, e in zip(records, envs, strict=True)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            cancel.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    outs = await unless_gone(request, every(), cancel)
    return json_response(completion_body(req, rid, created, [
        _answered(b, out, e.reply, p) for p, out, e in zip(req.prompts, outs, envs, strict=True)]))


def _answered(b: Binding, out: dict, reply: Any, text: str) -> tuple[str, str, dict[str, Any]]:
    """An output record's answer, finish reason and usage (``text``: its input)."""
    answer = answer_of(b, out)
    usage = usage_of(b, out, reply, text, answer)
    return answer, finish_reason(b, usage, reply), usage


async def _stream_openai(state: AppState, request: Request, service: PipelineService,
                         b: Binding, req: WireRequest, record: dict, env: Envelope,
                         rid: str, created: int) -> Response:
    calls = CallStream() if req.tools is not None else None
    rolled = [calls is None]  # the role went out (with tools: in the first delta)

    def pieces(text: str) -> list[bytes]:
        """The chunks of a piece of the answer (through ``calls``: content or tool calls;
        the first carries the role)."""
        if calls is None:
            return [chunk(req, rid, created, text)]
        out = []
        for e in calls.feed(text):
            role, rolled[0] = not rolled[0], True
            out.append(chunk(req, rid, created, e[1], role=role) if e[0] == "text" else
                       chunk(req, rid, created, None, role=role, tool_calls=call_delta(e)))
        return out

    async def events(relay: Relay, first: Any) -> AsyncIterator[bytes]:
        if req.chat and calls is None:
            yield chunk(req, rid, created, "", role=True)
        sent: list[str] = []
        async for text in relay.texts(first):
            sent.append(text)
            for c in pieces(text):
                yield c
        try:
            out = relay.result()
            answer = answer_of(b, out)
        except ServiceError as e:
            yield sse(error_body(state.redact(str(e)), e.status, e.code))
            return
        streamed = "".join(sent)
        if len(answer) > len(streamed) and answer.startswith(streamed):
            # pieces that had not arrived when the output did (on Ray, the pieces and the
            # output reach the driver from different actors): the rest of the answer
            for c in pieces(answer[len(streamed):]):
                yield c
        usage = usage_of(b, out, env.reply, req.text, answer)
        finish = finish_reason(b, usage, env.reply)
        if calls is not None:
            for ev in calls.close():
                yield chunk(req, rid, created, ev[1], role=not rolled[0])
                rolled[0] = True
            if not rolled[0]:  # nothing was said
                yield chunk(req, rid, created, "", role=True)
            if calls.calls and not calls.broken and finish == "stop":
                finish = "tool_calls"
        yield chunk(req, rid, created, None if req.chat else "", finish)
        if req.include_usage:
            yield chunk(req, rid, created, None, usage=usage)

    return await sse_response(request, service, record, state.pieces[req.model], events, env)


async def _stream_runs(state: AppState, request: Request, service: PipelineService,
                       record: dict, env: Envelope) -> Response:
    async def events(relay: Relay, first: Any) -> AsyncIterator[bytes]:
        async for text in relay.texts(first):
            yield sse({"token": text})
        try:
            yield sse({"output": relay.result()})
        except ServiceError as e:
            body = error_body(state.redact(str(e)), e.status, e.code)
            if isinstance(e, RequestFailed):
                body["error"]["stage"] = e.record.stage
            yield sse(body)

    return await sse_response(request, service, record, state.pieces[service.name], events,
                              env)
