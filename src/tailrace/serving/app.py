"""The HTTP face of a ``ServingHub``: OpenAI-compatible endpoints on FastAPI.

``create_app(hub)`` serves ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/models``, ``/v1/pipelines/{name}/runs``, ``/healthz`` and
``/readyz`` (docs/serving.md) and ``/v1/responses`` (docs/responses.md), errors as
OpenAI's ``{"error": {...}}``, each a handler (``handlers.py``,
``responses_routes.py``) over the state read once from the hub (``app_state.py``); with
``mcp=True`` also ``/mcp``: the pipelines as MCP tools (``mcp_server.py``, docs/mcp.md).
The app does not start or stop the hub; its owner does (``tailrace serve``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import handlers, responses_routes
from .app_state import AppState
from .errors import RequestFailed, ServiceError
from .hub import ServingHub
from .openai_wire import WireError, dumps, error_body, retry_headers
from .relay import ClientGone

Handler = Callable[[AppState, Request], Awaitable[Response]]


def error_response(e: WireError | ServiceError, redact: Callable[[str], str] = str) -> Response:
    """The OpenAI error response for ``e`` (its message through ``redact``)."""
    body = error_body(redact(str(e)), e.status, e.code)
    if isinstance(e, RequestFailed):
        rec = e.record.to_dict()
        body["error"].update(stage=rec["error"]["stage"], attempts=rec["error"]["attempts"])
        body["input"] = rec["input"]
    return Response(dumps(body), status_code=e.status, media_type="application/json",
                    headers=retry_headers(e.retry_after))


async def _validation_error(request: Request, e: RequestValidationError) -> Response:
    where = "; ".join(f"{'.'.join(map(str, err.get('loc', ())))}: {err.get('msg')}"
                      for err in e.errors())
    return handlers.json_response(
        error_body(f"{request.url.path}: {where}", 400, "invalid_parameter"), 400)


async def _client_gone(request: Request, e: ClientGone) -> Response:
    return Response(status_code=499)  # the client left: its work was cancelled


async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    msg = f"{request.method} {request.url.path}: {e.detail}"
    return handlers.json_response(error_body(msg, e.status_code, "not_found"
                                             if e.status_code == 404 else "http_error"),
                                  e.status_code)


def _over(state: AppState, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` as an endpoint: the request in, ``handler(state, request)`` out."""
    async def endpoint(request: Request) -> Response:
        return await handler(state, request)

    return endpoint


def create_app(hub: ServingHub, *, mcp: bool = False) -> FastAPI:
    """The FastAPI app serving ``hub``'s pipelines (see the module docstring); ``mcp``:
    as MCP tools at ``/mcp`` too (then the app's lifespan must run: uvicorn's
    ``lifespan="on"``)."""
    app = FastAPI(title="tailrace", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hub = hub
    state = AppState.of(hub)

    async def refused(request: Request, e: WireError | ServiceError) -> Response:
        return error_response(e, state.redact)

    for error, handle in ((WireError, refused), (ServiceError, refused),
                          (RequestValidationError, _validation_error),
                          (ClientGone, _client_gone), (StarletteHTTPException, _http_error)):
        app.exception_handler(error)(handle)
    # first (the router tries routes in order) and a plain Starlette route: no
    # dependency solving per request (the hot path)
    app.router.add_route("/v1/pipelines/{name}/runs", _over(state, handlers.runs),
                         methods=["POST"])
    for path, method, handler in (
            ("/healthz", "GET", handlers.healthz), ("/readyz", "GET", handlers.readyz),
            ("/v1/models", "GET", handlers.models),
            ("/v1/embeddings", "POST", handlers.embeddings),
            ("/v1/chat/completions", "POST", partial(handlers.completions, chat=True)),
            ("/v1/completions", "POST", partial(handlers.completions, chat=False)),
            ("/v1/responses", "POST", responses_routes.create),
            ("/v1/responses/{rid}", "GET", responses_routes.retrieve),
            ("/v1/responses/{rid}", "DELETE", responses_routes.delete),
            ("/v1/responses/{rid}/input_items", "GET", responses_routes.input_items)):
        app.add_api_route(path, _over(state, handler), methods=[method])

    from .observe import install_observability

    install_observability(app, hub, state.keys)
    if mcp:
        from starlette.routing import Route

        from .mcp_server import PATH, McpEndpoint

        endpoint = McpEndpoint(state)
        app.router.routes.append(Route(PATH, endpoint=endpoint))
        app.router.lifespan_context = endpoint.lifespan
    return app
