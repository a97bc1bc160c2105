"""``tailrace serve --mcp``: every served pipeline as an MCP tool at ``/mcp`` (docs/mcp.md).

The official SDK's low-level ``Server`` behind its ``StreamableHTTPSessionManager``,
stateless with JSON responses (each call is one POST: no session to keep, no stream
left open to hold up a shutdown), mounted on the app ``create_app`` makes; the
manager's ``run()`` is entered in the app's lifespan (``McpEndpoint.lifespan``).

A pipeline's tool takes its input field (``Binding.input_field``) as a required string
and answers with its answer text; a pipeline that cannot answer chat takes a record (its
``source: fields``) and answers with the output record as JSON. A call goes the way of
``POST /v1/pipelines/{name}/runs``: ``request_record`` (serve fields, the tenant's
limits), ``PipelineService.submit`` under ``unless_gone`` (admission; a caller that
closes the connection cancels its record's work). With API keys, ``/mcp`` needs the same
``Authorization: Bearer`` key and a call runs as that key's tenant.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..operators.tool_schema import ToolError, validate
from .app_state import AppState
from .binding import answer_of
from .errors import ServiceError
from .handlers import request_record
from .openai_wire import WireError, dumps, retry_headers
from .relay import ClientGone, unless_gone
from .service import Cancel

PATH = "/mcp"
#: the JSON-RPC error code of a request refused before MCP reads it (no or a wrong key)
REFUSED = -32001


def tool_spec(state: AppState, name: str) -> dict[str, Any]:
    """Pipeline ``name`` as an MCP tool, in wire form (``name``, ``description``,
    ``inputSchema``)."""
    plan = state.hub.services[name].plan
    b = state.bindings[name]
    source = next(o for s in plan.stages for o in s.ops if o.op.kind == "source")
    fields = list(source.params.get("fields") or ())
    serve = state.serves[name]
    if state.tenants is not None and serve is not None and serve.tenant:
        fields = [f for f in fields if f != serve.tenant]  # the key's tenant, never the caller's
    if b.problem is None and b.input_field:
        props: dict[str, Any] = {b.input_field: {
            "type": "string", "description": f"the {b.input_field} the pipeline answers"}}
        props.update((f, {"description": f"record field '{f}'"})
                     for f in fields if f != b.input_field)
        schema = {"type": "object", "properties": props, "required": [b.input_field],
                  "additionalProperties": False}
        what = (f"Runs the tailrace pipeline '{name}' on a {b.input_field} and returns its "
                "answer.")
    else:
        schema = {"type": "object", "properties": {
            f: {"description": f"record field '{f}'"} for f in fields}, "required": fields}
        what = (f"Runs the tailrace pipeline '{name}' on one record"
                f"{' (fields: ' + ', '.join(fields) + ')' if fields else ''} and returns "
                "its output record as JSON.")
    return {"name": name, "description": plan.pipeline.description or what,
            "inputSchema": schema}


class McpEndpoint:
    """The ASGI app at ``/mcp`` serving ``state``'s pipelines as MCP tools."""

    def __init__(self, state: AppState) -> None:
        from mcp.server.lowlevel import Server
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        self.state = state
        self.tools = {name: tool_spec(state, name) for name in state.hub.services}
        self.server: Any = Server("tailrace", on_list_tools=self._list,
                                  on_call_tool=self._call)
        self.manager = StreamableHTTPSessionManager(self.server, json_response=True,
                                                    stateless=True)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """The app's lifespan: the session manager runs while the app does."""
        async with self.manager.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:  # the key is checked before the MCP layer reads anything
                self.state.tenant_of(Request(scope))
            except WireError as e:  # a JSON-RPC error: MCP clients show its message
                body = {"jsonrpc": "2.0", "id": None, "error": {
                    "code": REFUSED, "message": self.state.redact(str(e)),
                    "data": {"status": e.status, "code": e.code}}}
                headers = {**retry_headers(e.retry_after),
                           **({"WWW-Authenticate": "Bearer"} if e.status == 401 else {})}
                await Response(dumps(body), e.status, headers,
                               media_type="application/json")(scope, receive, send)
                return
        await self.manager.handle_request(scope, receive, send)

    async def _list(self, ctx: Any, params: Any) -> Any:
        from mcp.types import ListToolsResult

        return ListToolsResult.model_validate({"tools": list(self.tools.values())})

    async def _call(self, ctx: Any, params: Any) -> Any:
        from mcp.types import CallToolResult

        try:
            text = await self._run(ctx.request, params.name, params.arguments or {})
        except ClientGone:  # the caller closed the connection: its work was cancelled
            return CallToolResult.model_validate(
                {"content": [{"type": "text", "text": "cancelled"}], "isError": True})
        except (WireError, ServiceError, ToolError) as e:
            retry = getattr(e, "retry_after", None)
            why = self.state.redact(str(e)) + (f" (retry after {retry:g} s)" if retry else "")
            return CallToolResult.model_validate(
                {"content": [{"type": "text", "text": why}], "isError": True})
        return CallToolResult.model_validate({"content": [{"type": "text", "text": text}]})

    async def _run(self, request: Request, name: str, args: dict[str, Any]) -> str:
        """Submit a record of ``args`` to pipeline ``name``; its answer as text."""
        state = self.state
        tool = self.tools.get(name)
        if tool is None:
            raise ToolError(f"no tool '{name}' here; the served pipelines are: "
                            f"{', '.join(self.tools)}")
        tenant = state.tenant_of(request)
        service = state.service(name)
        bad = [k for k in args if k.startswith("_")]
        if bad:
            raise ToolError(f"record fields starting with '_' are reserved; got "
                            f"{', '.join(bad)}")
        try:
            validate(args, tool["inputSchema"])
        except ToolError as e:
            raise ToolError(f"tool '{name}': invalid arguments: {e}") from None
        record, env = request_record(state, name, dict(args), request, tenant,
                                     text=dumps(args).decode() if tenant is not None else "")
        cancel = Cancel()  # set if the call is cancelled or its connection closes
        out = await unless_gone(request, service.submit(record, cancel=cancel, request=env),
                                cancel)
        b = state.bindings[name]
        if b.problem is None and b.answer_field:
            return answer_of(b, out)
        return dumps(out).decode()
