"""The ``/v1/responses`` routes (docs/responses.md): create (plain or streamed), retrieve,
delete and list a response's input items.

A create goes the chat path: the request is parsed (``responses.py``) into a chat
``WireRequest``, checked against the pipeline's binding (``check_conversation``,
``request_options``), made a record with ``request_record`` (tenants, urgency, session)
and submitted through ``relay.py`` (disconnects cancel it, admission tickets come back);
its answer is shaped by ``responses_output.py``. Stored responses live in the app's
``ResponseLog`` under the caller's tenant.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

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
from .errors import ServiceError
from .handlers import json_response, read_json, request_record
from .openai_wire import WireError, WireRequest
from .relay import Relay, sse_response, unless_gone
from .responses import ResponsesRequest, parse_responses
from .responses_output import EventStream, complete, new_id, output_items, turn_of
from .responses_store import tenant_key
from .service import Cancel, PipelineService


def not_found(rid: str, where: str = "response") -> WireError:
    return WireError(f"{where} '{rid}' not found: no such response is stored for this caller "
                     "(never stored, sent with 'store': false, deleted, or expired)",
                     status=404, code="response_not_found")


def _stored(resp: dict[str, Any], history: list[dict[str, Any]],
            req: ResponsesRequest) -> dict[str, Any]:
    """What the log keeps of a response: the object, the conversation a later request
    continues (without ``instructions``, which are not carried over) and its input
    items."""
    return {"response": resp, "items": list(req.items),
            "messages": [*history, *req.own, turn_of(resp["output"])]}


async def create(state: AppState, request: Request) -> Response:
    """``POST /v1/responses``."""
    tenant = state.tenant_of(request)
    body = await read_json(request, state.limit)
    req = parse_responses(body)
    service = state.service(req.model)
    b = state.bindings[req.model]
    if b.problem is not None:
        raise WireError(b.problem, code="pipeline_not_chat")
    user = tenant_key(tenant)
    history: list[dict[str, Any]] = []
    if req.previous is not None:
        prev = await state.responses.get(user, req.previous)
        if prev is None:
            raise not_found(req.previous, "previous_response_id: response")
        history = prev["messages"]
    wire = req.wire(history)
    check_conversation(b, wire, req.model)
    record, env = request_record(
        state, req.model, {b.input_field: wire.text}, request, tenant, body=body,
        text=wire.text, options=request_options(b, wire, req.model),
        answers=b.answer_field, messages=wire.messages, tools=wire.tools)
    shell = req.shell(new_id("resp"), int(time.time()))
    if req.stream:
        return await _stream(state, request, service, b, req, wire, record, env, shell,
                             history, user)
    cancel = Cancel()
    out = await unless_gone(request, service.submit(record, cancel=cancel, request=env),
                            cancel)
    answer = answer_of(b, out)
    usage = usage_of(b, out, env.reply, wire.text, answer)
    resp = complete(shell, output_items(answer, wire.tools), usage,
                    finish_reason(b, usage, env.reply))
    if req.store:
        await state.responses.put(user, resp["id"], _stored(resp, history, req))
    return json_response(resp)


async def _stream(state: AppState, request: Request, service: PipelineService, b: Binding,
                  req: ResponsesRequest, wire: WireRequest, record: dict, env: Envelope,
                  shell: dict[str, Any], history: list[dict[str, Any]], user: str
                  ) -> Response:
    stream = EventStream(shell, wire.tools is not None)

    async def events(relay: Relay, first: Any) -> AsyncIterator[bytes]:
        for e in stream.start():
            yield e
        sent: list[str] = []
        async for text in relay.texts(first):
            sent.append(text)
            for e in stream.feed(text):
                yield e
        try:
            out = relay.result()
            answer = answer_of(b, out)
            streamed = "".join(sent)
            if len(answer) > len(streamed) and answer.startswith(streamed):
                # pieces that had not arrived when the output did (on Ray): the rest
                for e in stream.feed(answer[len(streamed):]):
                    yield e
            usage = usage_of(b, out, env.reply, wire.text, answer)
            last = stream.finish(usage, finish_reason(b, usage, env.reply))
            if req.store:  # kept before the client hears it is done: it may chain at once
                assert stream.response is not None
                await state.responses.put(user, shell["id"],
                                          _stored(stream.response, history, req))
        except ServiceError as err:
            for e in stream.error(state.redact(str(err)), err.code):
                yield e
            return
        for e in last:
            yield e

    return await sse_response(request, service, record, state.pieces[req.model], events, env)


async def _stored_of(state: AppState, request: Request) -> tuple[str, dict[str, Any]]:
    rid = request.path_params["rid"]
    stored = await state.responses.get(tenant_key(state.tenant_of(request)), rid)
    if stored is None:
        raise not_found(rid)
    return rid, stored


async def retrieve(state: AppState, request: Request) -> Response:
    """``GET /v1/responses/{rid}``."""
    return json_response((await _stored_of(state, request))[1]["response"])


async def delete(state: AppState, request: Request) -> Response:
    """``DELETE /v1/responses/{rid}``."""
    rid = request.path_params["rid"]
    if not await state.responses.delete(tenant_key(state.tenant_of(request)), rid):
        raise not_found(rid)
    return json_response({"id": rid, "object": "response", "deleted": True})


async def input_items(state: AppState, request: Request) -> Response:
    """``GET /v1/responses/{rid}/input_items`` (``order``: desc by default, ``limit``:
    1-100, 20 by default, ``after``: an item id)."""
    _, stored = await _stored_of(state, request)
    q = request.query_params
    order, limit, after = q.get("order", "desc"), q.get("limit", "20"), q.get("after")
    if order not in ("asc", "desc"):
        raise WireError(f"query.order: must be asc or desc, got {order!r}",
                        code="invalid_parameter")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise WireError(f"query.limit: must be 1 to 100, got {limit!r}",
                        code="invalid_parameter")
    items = stored["items"][::-1] if order == "desc" else stored["items"]
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise WireError(f"query.after: no input item '{after}' in this response",
                            code="invalid_parameter")
        items = items[ids.index(after) + 1:]
    page = items[:int(limit)]
    return json_response({"object": "list", "data": page,
                          "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None,
                          "has_more": len(items) > len(page)})
