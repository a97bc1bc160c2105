"""The HTTP face of a ``ServingHub``: OpenAI-compatible endpoints on FastAPI.

``create_app(hub)`` serves ``POST /v1/chat/completions`` and ``/v1/completions``
(``model`` names a pipeline; ``stream: true`` sends SSE chunks as tokens are produced,
ending ``data: [DONE]``), ``POST /v1/embeddings`` (a pipeline's embed stage's engine;
``embeddings.py``), ``GET /v1/models`` (with what each pipeline accepts),
``POST /v1/pipelines/{name}/runs`` (any JSON record in, the output record out;
``?stream=true`` for SSE), ``GET /healthz`` and ``GET /readyz``. A request's priority
and deadline for admission (body fields or ``X-Tailrace-*`` headers) are checked
against its pipeline's ``serve:`` bounds (``urgency.py``).
Errors use OpenAI's ``{"error": {"message", "type", "code"}}``. A client that
disconnects cancels its work: its request's cancel (``tailrace/request.py``) is set and
the answering stage frees its engine sequence at the next token. Everything a request
carries besides its input text (options, urgency, session, conversation, tenant) goes in
its ``Request``; the answering stage's reply comes back in it.

The app does not start or stop the hub; its owner does (``tailrace serve``, tests).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engines.tokens import approx_tokens
from ..request import Request as Envelope
from .embeddings import (
    accepts,
    embed_spec,
    embed_texts,
    embeddings_body,
    engine_specs,
    parse_embeddings,
)
from .errors import RequestFailed, ServiceError, ServiceUnavailable
from .hub import ServingHub
from .openai_wire import (
    SSE_DONE,
    Binding,
    WireError,
    WireRequest,
    answering_ops,
    bind,
    chunk,
    completion_body,
    completions_body,
    dumps,
    error_body,
    finish_reason,
    output_tokens,
    parse_chat,
    parse_completion,
    request_options,
    retry_headers,
    sse,
    usage_of,
)
from .security import KeyCheck, Redactor, hub_redactor
from .service import Cancel, PipelineService
from .sessions import session_of
from .tenants import Tenant, request_fields
from .urgency import bounds, urgency

_END = object()  # end of a request's token stream
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _error_response(e: WireError | ServiceError, redact: Callable[[str], str]) -> Response:
    body = error_body(redact(str(e)), e.status, e.code)
    if isinstance(e, RequestFailed):
        rec = e.record.to_dict()
        body["error"].update(stage=rec["error"]["stage"], attempts=rec["error"]["attempts"])
        body["input"] = rec["input"]
    return Response(dumps(body), status_code=e.status, media_type="application/json",
                    headers=retry_headers(e.retry_after))


def _json(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


async def _read_json(request: Request, limit: int) -> dict:
    """The request body as a JSON object; 413 over ``limit`` bytes, 400 if malformed."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise WireError(f"request body is {int(size)} bytes; the limit is {limit} bytes",
                        status=413, code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise WireError(f"request body exceeds the limit of {limit} bytes",
                            status=413, code="request_too_large")
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


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_gone(request: Request, call: Any, cancel: Cancel) -> Any:
    """Await ``call`` in this task; if the client disconnects first, set ``cancel``, stop
    the call and raise ``_ClientGone``. One watcher task per request, nothing more: the
    call itself runs inline (no task, no ``asyncio.wait``)."""
    task = asyncio.current_task()
    assert task is not None
    gone: list[bool] = []

    def left(watcher: asyncio.Future) -> None:
        if not watcher.cancelled() and watcher.exception() is None:
            gone.append(True)
            cancel.set()
            task.cancel()  # the call stops where it waits

    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(left)
    try:
        return await call
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise _ClientGone from None
    finally:
        watcher.remove_done_callback(left)
        watcher.cancel()


def _quiet(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


def piece_budget(plan: Any) -> int:
    """Most text pieces one request may stream: twice the token budget of the plan's
    generate, route and tool_call stages (``max_tokens`` per attempt, ``1 + retries``
    attempts), since an engine sends a piece per token (the slack covers servers that
    split a token's text).

    plan: the compiled plan.
    """
    tokens = sum(o.op.answers.stream_pieces(o.params) * (1 + o.contract.retries)
                 for o in answering_ops(plan))
    return 2 * tokens + 16


class _Relay:
    """One submitted request whose text pieces arrive on a queue, then ``_END``.

    The queue holds at most ``budget`` pieces (plus ``_END``): pieces wait there only
    while the client reads slower than the engine writes, and a conforming pipeline
    sends fewer than ``piece_budget`` pieces in all, so only an engine writing past its
    ``max_tokens`` to a slow client can fill it. A piece past the bound stops the
    generation (the request's cancel) and the stream ends with an error event.
    """

    def __init__(self, service: PipelineService, record: dict, budget: int,
                 env: Envelope | None = None) -> None:
        self.pieces: asyncio.Queue = asyncio.Queue(maxsize=budget + 1)  # +1: _END
        self.budget = budget
        self.overflowed = False
        self.cancel = Cancel()
        self.task = asyncio.ensure_future(
            service.submit(record, on_token=self._piece, cancel=self.cancel, request=env))
        self.task.add_done_callback(_quiet)
        self.task.add_done_callback(lambda _: self.pieces.put_nowait(_END))

    def _piece(self, piece: str) -> None:
        if self.overflowed:
            return
        if self.pieces.qsize() >= self.budget:
            self.overflowed = True
            self.cancel.set()  # the engine stops this sequence at its next token
            return
        self.pieces.put_nowait(piece)

    def result(self) -> Any:
        """The output record; raises the request's ``ServiceError``, or one saying the
        stream was cut at its bound."""
        out = self.task.result()
        if self.overflowed:
            raise ServiceError(f"more than {self.budget} streamed text pieces waited for "
                               "the client (twice the generate stages' max_tokens: the engine "
                               "wrote past max_tokens); the stream was cut",
                               code="stream_overflow")
        return out

    async def first(self, request: Request) -> Any:
        """The first piece (or ``_END``); a failure before any piece raises, so it gets
        its own HTTP status instead of an error inside a 200 stream."""
        try:
            item = await _unless_gone(request, self.pieces.get(), self.cancel)
        except _ClientGone:
            self.abandon()
            raise
        if item is _END and self.task.exception() is not None:
            raise self.task.exception()  # type: ignore[misc]
        return item

    async def texts(self, first: Any) -> AsyncIterator[str]:
        """Pieces as they come, joined when several are already waiting."""
        item = first
        while item is not _END:
            parts = [item]
            item = None
            while not self.pieces.empty():
                nxt = self.pieces.get_nowait()
                if nxt is _END:
                    item = _END
                    break
                parts.append(nxt)
            yield "".join(parts)
            if item is None:
                item = await self.pieces.get()

    def abandon(self) -> None:
        if not self.task.done():
            self.cancel.set()
            self.task.cancel()


def create_app(hub: ServingHub) -> FastAPI:
    """The FastAPI app serving ``hub``'s pipelines (see the module docstring).

    hub: the services, shared gate, API key and body limit.
    """
    app = FastAPI(title="tailrace", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hub = hub
    bindings = {name: bind(s.plan) for name, s in hub.services.items()}
    embed_specs = {name: embed_spec(s.plan) for name, s in hub.services.items()}
    meta = {name: accepts(s.plan, bindings[name]) for name, s in hub.services.items()}
    engines = {name: spec for name, spec in engine_specs(
        [s.plan for s in hub.services.values()]).items() if name not in hub.services}
    limit = hub.max_body_bytes
    started = int(time.time())
    tenants: Any = getattr(hub, "tenants", None)
    keys = KeyCheck(hub.api_key, metrics_public=hub.metrics_public,
                    operator_only=tenants is not None)
    redact = hub_redactor(hub)
    serves = {name: getattr(getattr(s.plan, "pipeline", None), "serve", None)
              for name, s in hub.services.items()}
    for name in meta:
        meta[name].update(bounds(serves[name]))
    reserve = {name: output_tokens(s.plan) for name, s in hub.services.items()}

    @app.exception_handler(WireError)
    async def _wire_error(request: Request, e: WireError) -> Response:
        return _error_response(e, redact)

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, e: ServiceError) -> Response:
        return _error_response(e, redact)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        where = "; ".join(f"{'.'.join(map(str, err.get('loc', ())))}: {err.get('msg')}"
                          for err in e.errors())
        return _json(error_body(f"{request.url.path}: {where}", 400, "invalid_parameter"),
                     400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return _json(error_body(msg, e.status_code, "not_found" if e.status_code == 404
                                else "http_error"), e.status_code)

    def check_key(request: Request) -> Tenant | None:
        """The caller's tenant (a ``--keys-file`` key), None for the hub's own key or
        no key; 401 when a key is needed and missing or wrong."""
        if tenants is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            bearer = scheme.lower() == "bearer" and bool(token)
            tenant = tenants.tenant_of(token) if bearer else None
            if tenant is not None:
                return tenant
            if not keys.enabled:
                if not bearer:
                    raise WireError("missing API key: send the header 'Authorization: "
                                    "Bearer KEY'", status=401, code="missing_api_key")
                raise WireError("invalid API key", status=401, code="invalid_api_key")
        refused = keys.bearer(request.headers)
        if refused is not None:
            raise refused
        return None

    def who(name: str, record: dict, body: dict, request: Request, tenant: Tenant | None,
            text: str, n: int = 1) -> None:
        """Set the pipeline's ``serve:`` fields in ``record`` (the tenant's last: the
        caller cannot choose it) and charge the tenant's limits (one request of ``n``
        records whose texts are ``text``)."""
        serve = serves[name]
        if serve is not None:
            record.update(request_fields(serve, body, request.headers))
        if tenant is not None:
            if serve is not None and serve.tenant:
                record[serve.tenant] = tenant.name
            tenants.admit(tenant, approx_tokens(text) + n * reserve[name])

    def service_of(name: str) -> PipelineService:
        service = hub.services.get(name)
        if service is None:
            served = ", ".join(sorted(hub.services)) or "none"
            raise WireError(f"pipeline '{name}' is not served here; served: {served}",
                            status=404, code="model_not_found")
        return service

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        pipes = {}
        for name, s in hub.services.items():
            f = s.failure
            pipes[name] = {"ready": s.ready, "error": redact(f"{type(f).__name__}: {f}")
                           if f is not None else None}
        ready = all(p["ready"] for p in pipes.values())
        return _json({"ready": ready, "pipelines": pipes}, 200 if ready else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_key(request)  # no limits: listing models costs nothing
        return _json({"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "tailrace",
             "metadata": meta[name]} for name in hub.services] + [
            {"id": name, "object": "model", "created": started, "owned_by": "tailrace",
             "metadata": {"endpoints": ["embeddings"], "engine": spec.get("model")}}
            for name, spec in engines.items()]})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        tenant = check_key(request)
        body = await _read_json(request, limit)
        req = parse_embeddings(body)
        spec = engines.get(req.model)
        if spec is None:
            service = service_of(req.model)
        if tenant is not None:
            tenants.admit(tenant, approx_tokens(dumps(body.get("input")).decode()))
        if spec is None:
            spec = embed_specs[req.model]
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
        return _json(embeddings_body(req, vecs, tokens))

    async def openai_call(request: Request, chat: bool) -> Response:
        tenant = check_key(request)
        body = await _read_json(request, limit)
        req = parse_chat(body) if chat else parse_completion(body)
        service = service_of(req.model)
        b = bindings[req.model]
        if b.problem is not None:
            raise WireError(b.problem, code="pipeline_not_chat")
        record: dict[Any, Any] = {b.input_field: req.text}
        # engine pools route a session's requests together (``session``)
        env = Envelope(options=request_options(b, req, req.model), answers=b.answer_field,
                       asked=urgency(serves[req.model], req.model, body, request.headers),
                       session=session_of(body, request.headers),
                       messages=list(req.messages) if req.messages is not None else None,
                       tenant=tenant.name if tenant is not None else None)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.prompts:
            who(req.model, record, body, request, tenant, "".join(req.prompts),
                len(req.prompts))
            return await _several(request, service, b, req, record, env, rid, created)
        who(req.model, record, body, request, tenant, req.text)
        if req.stream:
            return await _stream_openai(request, service, b, req, record, env, rid,
                                        created, redact)
        cancel = Cancel()
        try:
            out = await _unless_gone(
                request, service.submit(record, cancel=cancel, request=env), cancel)
        except _ClientGone:
            return Response(status_code=499)
        answer = _answer(b, out)
        usage = usage_of(b, out, env.reply, req.text, answer)
        return _json(completion_body(req, rid, created, answer,
                                     finish_reason(b, usage, env.reply), usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_call(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_call(request, False)

    async def runs(request: Request) -> Response:
        # a plain Starlette route: no dependency solving per request (the hot path)
        tenant = check_key(request)
        service = service_of(request.path_params["name"])
        stream = _flag(request, "stream")
        record = await _read_json(request, limit)
        bad = [k for k in record if k.startswith("_")]
        if bad:
            raise WireError(f"record fields starting with '_' are reserved (transient); "
                            f"got {', '.join(bad)}", code="reserved_field")
        env = Envelope(asked=urgency(serves[service.name], service.name, None,
                                     request.headers),
                       session=session_of(None, request.headers),
                       tenant=tenant.name if tenant is not None else None)
        if tenant is not None or serves[service.name] is not None:
            who(service.name, record, dict(record), request, tenant,
                dumps(record).decode() if tenant is not None else "")
        if stream:
            return await _stream_runs(request, service, record, env, redact)
        cancel = Cancel()
        try:
            out = await _unless_gone(
                request, service.submit(record, cancel=cancel, request=env), cancel)
        except _ClientGone:
            return Response(status_code=499)
        return _json(out)

    app.router.add_route("/v1/pipelines/{name}/runs", runs, methods=["POST"])

    from .observe import install_observability

    install_observability(app, hub, keys)
    return app


async def _several(request: Request, service: PipelineService, b: Binding,
                   req: WireRequest, record: dict, env: Envelope, rid: str,
                   created: int) -> Response:
    """A completion request with a list of prompts: one record per prompt, submitted
    together (they share the pipeline's micro-batches); the first failure fails the
    request and cancels the others' work."""
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

    try:
        outs = await _unless_gone(request, every(), cancel)
    except _ClientGone:
        return Response(status_code=499)
    answers = []
    for p, out, e in zip(req.prompts, outs, envs, strict=True):
        answer = _answer(b, out)
        usage = usage_of(b, out, e.reply, p, answer)
        answers.append((answer, finish_reason(b, usage, e.reply), usage))
    return _json(completions_body(req, rid, created, answers))


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


def _flag(request: Request, name: str) -> bool:
    """A boolean query parameter (``?stream=true``); 400 for a value that is not one."""
    raw = request.query_params.get(name)
    if raw is None or raw.lower() in _FALSE:
        return False
    if raw.lower() in _TRUE:
        return True
    raise WireError(f"{request.url.path}: query.{name}: not a boolean ({raw!r}); use true or "
                    "false", code="invalid_parameter")


def _answer(b: Binding, out: dict) -> str:
    answer = out.get(b.answer_field) if b.answer_field else None
    if not isinstance(answer, str):
        raise ServiceError(f"the output record has no text field '{b.answer_field}' (a later "
                           "stage dropped or replaced it)", code="no_answer")
    return answer


async def _stream(request: Request, service: PipelineService, record: dict, env: Envelope,
                  events: Callable[[_Relay, Any], AsyncIterator[bytes]]) -> Response:
    """Stream ``events(relay, first piece)`` as server-sent events, then ``[DONE]``. A
    failure before the first piece gets its own HTTP status; a client that goes away
    stops the generation for it."""
    relay = _Relay(service, record, piece_budget(service.plan), env)
    try:
        first = await relay.first(request)
    except _ClientGone:
        return Response(status_code=499)

    async def guarded() -> AsyncIterator[bytes]:
        finished = False
        try:
            async for event in events(relay, first):
                yield event
            yield SSE_DONE
            finished = True
        finally:
            if not finished:
                relay.abandon()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=_SSE_HEADERS)


async def _stream_openai(request: Request, service: PipelineService, b: Binding,
                         req: WireRequest, record: dict, env: Envelope, rid: str,
                         created: int, redact: Redactor) -> Response:
    async def events(relay: _Relay, first: Any) -> AsyncIterator[bytes]:
        if req.chat:
            yield chunk(req, rid, created, "", role=True)
        sent: list[str] = []
        async for text in relay.texts(first):
            sent.append(text)
            yield chunk(req, rid, created, text)
        try:
            out = relay.result()
            answer = _answer(b, out)
        except ServiceError as e:
            yield sse(error_body(redact(str(e)), e.status, e.code))
            return
        streamed = "".join(sent)
        if len(answer) > len(streamed) and answer.startswith(streamed):
            # pieces that had not arrived when the output did (on Ray, the pieces and the
            # output reach the driver from different actors): the rest of the answer
            yield chunk(req, rid, created, answer[len(streamed):])
        usage = usage_of(b, out, env.reply, req.text, answer)
        yield chunk(req, rid, created, None if req.chat else "",
                    finish_reason(b, usage, env.reply))
        if req.include_usage:
            yield chunk(req, rid, created, None, usage=usage)

    return await _stream(request, service, record, env, events)


async def _stream_runs(request: Request, service: PipelineService, record: dict,
                       env: Envelope, redact: Redactor) -> Response:
    async def events(relay: _Relay, first: Any) -> AsyncIterator[bytes]:
        async for text in relay.texts(first):
            yield sse({"token": text})
        try:
            yield sse({"output": relay.result()})
        except ServiceError as e:
            body = error_body(redact(str(e)), e.status, e.code)
            if isinstance(e, RequestFailed):
                body["error"]["stage"] = e.record.stage
            yield sse(body)

    return await _stream(request, service, record, env, events)
