"""MCP servers' tools in a ``tool_call`` stage (docs/stateful.md, "MCP servers").

A stage's ``mcp:`` entries name servers: a command spoken to over stdio or a streamable
HTTP ``url``. ``mcp_config.check_servers`` refuses a bad entry when the pipeline
compiles; when a replica is built, ``open_servers`` connects (one ``Connection`` per
distinct server in the process, shared by every stage replica that names it and closed
when the last one closes), lists each server's tools within ``connect_timeout_ms`` and
returns them as ``McpTool``s, which ``ToolRunner`` validates and calls like registered
functions.

A ``Connection`` runs the official SDK's async ``ClientSession`` on an event loop of its
own thread; a stage thread submits calls with ``asyncio.run_coroutine_threadsafe`` and
waits on the returned future with the call's timeout (cancelling the future cancels the
call). A server that exits is started again by the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..registry import Registry
from .tool_schema import ToolError

CONNECT_TIMEOUT_MS = 10_000


class McpCallFailed(ToolError):
    """An MCP tool call failed: ``verb`` says how (``returned an error``: an ``isError``
    result; ``failed``: the connection), ``detail`` the server's text or the cause."""

    def __init__(self, verb: str, detail: str) -> None:
        super().__init__(f"{verb}: {detail}")
        self.verb, self.detail = verb, detail


class _StartFailed(Exception):
    """A server's session could not be opened (the message says why)."""


# -- one server connection --------------------------------------------------------------------
def _leaf(e: BaseException) -> BaseException:
    """The first non-group exception inside ``e`` (anyio raises exception groups)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _why(e: BaseException) -> str:
    e = _leaf(e)
    if isinstance(e, _StartFailed):
        return str(e)
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _wire(model: Any) -> dict[str, Any]:
    """An SDK result as its JSON wire form (camelCase keys)."""
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def _result_value(result: dict[str, Any]) -> Any:
    """What the model sees of a ``tools/call`` result: its structured content if any,
    else its text parts joined (other parts named)."""
    if result.get("structuredContent") is not None:
        return result["structuredContent"]
    parts = []
    for c in result.get("content") or []:
        if c.get("type") == "text":
            parts.append(c.get("text", ""))
        elif c.get("type") == "resource" and "text" in (c.get("resource") or {}):
            parts.append(c["resource"]["text"])
        else:
            parts.append(f"[{c.get('type', 'unknown')} content: "
                         f"{c.get('mimeType') or c.get('uri') or 'not shown'}]")
    return "\n".join(parts)


class Connection:
    """One MCP server: an SDK ``ClientSession`` on this object's own event-loop thread.

    spec: a checked ``mcp:`` entry (``check_servers``). ``users`` counts the stage
    replicas holding it (the module's registry closes it at 0).
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.name = spec, spec["name"]
        self.users = 0
        self.listed: list[dict[str, Any]] | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name=f"tailrace-mcp-{self.name}")
        self.thread.start()
        self._live: tuple[asyncio.Task, asyncio.Event, asyncio.Future] | None = None
        self._dead = False  # the session failed: the next call connects again
        self._lock: asyncio.Lock | None = None  # made on the loop

    def _transport(self) -> Any:
        s = self.spec
        if "command" in s:
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            return stdio_client(StdioServerParameters(
                command=s["command"][0], args=s["command"][1:], env=s.get("env"),
                cwd=s.get("cwd")))
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        headers = dict(s.get("headers") or {})
        for header, var in (s.get("headers_env") or {}).items():
            value = os.environ.get(var)
            if not value:
                raise _StartFailed(f"headers_env.{header}: the environment variable {var} "
                                   "is not set or empty")
            headers[header] = value
        client = httpx2.AsyncClient(headers=headers,
                                    timeout=httpx2.Timeout(30.0, read=300.0))

        @contextlib.asynccontextmanager
        async def both() -> Any:
            async with client, streamable_http_client(s["url"], http_client=client) as t:
                yield t

        return both()

    async def _run(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """Open the transport and session, hand the session to ``ready``, hold both
        until ``stop``; any failure marks the connection dead."""
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport())
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                ready.set_result(session)
                await stop.wait()
        except BaseException as e:  # noqa: BLE001 - the connection's end, however it came
            self._dead = True
            if not ready.done():
                ready.set_exception(_StartFailed(_why(e)))
            if isinstance(e, asyncio.CancelledError):
                raise

    def where(self) -> str:
        s = self.spec
        return " ".join(s["command"]) if "command" in s else s["url"]

    async def _session(self) -> Any:
        """The live session, (re)connecting if there is none or it failed."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            live = self._live
            if live is None or self._dead:
                if live is not None:
                    live[1].set()
                ready: asyncio.Future = self.loop.create_future()
                stop = asyncio.Event()
                self._dead = False
                self._live = live = (asyncio.ensure_future(self._run(ready, stop)), stop, ready)
        return await asyncio.shield(live[2])

    async def _list(self) -> list[dict[str, Any]]:
        from mcp.types import PaginatedRequestParams

        session = await self._session()
        tools: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = _wire(await session.list_tools(
                params=PaginatedRequestParams(cursor=cursor) if cursor else None))
            tools += page.get("tools") or []
            cursor = page.get("nextCursor")
            if not cursor:
                return tools

    async def _call(self, name: str, args: dict[str, Any]) -> Any:
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED

        try:
            session = await self._session()
        except _StartFailed as e:
            raise McpCallFailed("failed", f"the server did not start again: {e}") from None
        try:
            result = _wire(await session.call_tool(name, args))
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                self._dead = True
                raise McpCallFailed("failed", "the connection closed (did the server exit?)"
                                    ) from None
            raise McpCallFailed("failed", _why(e)) from None
        except (OSError, EOFError) as e:
            self._dead = True
            raise McpCallFailed("failed", _why(e)) from None
        if result.get("isError"):
            text = _result_value({"content": result.get("content")})
            raise McpCallFailed("returned an error", " ".join(str(text).split())[:500])
        return _result_value(result)

    def tools(self, timeout_s: float, name: str) -> list[dict[str, Any]]:
        """The server's tools (listed once per connection), as wire JSON; ``name``: the
        server's in errors."""
        if self.listed is None:
            fut = asyncio.run_coroutine_threadsafe(self._list(), self.loop)
            try:
                self.listed = fut.result(timeout_s)
            except TimeoutError:
                fut.cancel()
                raise ToolError(f"MCP server '{name}' ({self.where()}) did not list its "
                                f"tools within {timeout_s * 1000:g} ms (connect_timeout_ms)"
                                ) from None
            except _StartFailed as e:
                raise ToolError(f"MCP server '{name}' ({self.where()}) failed to start: {e}"
                                ) from None
        return self.listed

    def submit(self, name: str, args: dict[str, Any]) -> Future:
        """Start calling tool ``name``: a future of its result value (``McpCallFailed``
        for an error result or a failed connection); cancel it to cancel the call."""
        return asyncio.run_coroutine_threadsafe(self._call(name, args), self.loop)

    def close(self) -> None:
        """End the session (a stdio server is stopped) and the loop's thread."""
        async def stop() -> None:
            if self._live is not None:
                task, ev, ready = self._live
                ev.set()
                if not ready.done():  # still starting: no need to wait for that
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(task, 10)
            for t in asyncio.all_tasks():  # calls still running (an interrupted run)
                if t is not asyncio.current_task():
                    t.cancel()

        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(15)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


def _key(spec: dict[str, Any]) -> str:
    """Entries that start the same server share its connection."""
    return json.dumps({k: spec.get(k) for k in ("command", "env", "cwd", "url", "headers",
                                                "headers_env")}, sort_keys=True)


_CONNECTIONS: Registry[Connection] = Registry("mcp servers", at_exit=True)


def open_connections() -> list[str]:
    """The names of the MCP servers this process holds a connection to."""
    return sorted(c.name for _, c in _CONNECTIONS.items())


def _acquire(spec: dict[str, Any]) -> Connection:
    with _CONNECTIONS.lock:
        conn = _CONNECTIONS.get(_key(spec), lambda: Connection(spec))
        conn.users += 1
        return conn


def _release(conn: Connection) -> None:
    with _CONNECTIONS.lock:
        conn.users -= 1
        last = conn.users <= 0 and _CONNECTIONS.peek(_key(conn.spec)) is conn
        if last:
            _CONNECTIONS.pop(_key(conn.spec))
    if last:
        conn.close()


# -- a stage's MCP tools ------------------------------------------------------------------------
class McpTool:
    """One MCP tool as a stage offers it: ``entry`` is its ``{name, description, schema,
    timeout_ms}`` (the name with the server's prefix), ``tenants`` who may see it (None:
    everyone), ``remote`` its name on the server."""

    __slots__ = ("entry", "tenants", "remote", "conn")

    def __init__(self, entry: dict[str, Any], tenants: frozenset[str] | None, remote: str,
                 conn: Connection) -> None:
        self.entry, self.tenants, self.remote, self.conn = entry, tenants, remote, conn

    def submit(self, args: dict[str, Any]) -> Future:
        return self.conn.submit(self.remote, args)


def _tools_of(spec: dict[str, Any], conn: Connection, timeout_ms: float) -> list[McpTool]:
    listed = {t["name"]: t for t in conn.tools(
        spec.get("connect_timeout_ms", CONNECT_TIMEOUT_MS) / 1000, spec["name"])}
    wanted = spec.get("tools") or list(listed)
    missing = [t for t in wanted if t not in listed]
    if missing:
        raise ToolError(f"MCP server '{spec['name']}' has no tool "
                        f"{', '.join(repr(m) for m in missing)} (it has: "
                        f"{', '.join(listed) or 'none'}); fix mcp.tools")
    tenants = frozenset(spec["tenants"]) if spec.get("tenants") else None
    out = []
    for remote in wanted:
        t = listed[remote]
        schema = t.get("inputSchema")
        out.append(McpTool({"name": spec.get("prefix", "") + remote,
                            "description": t.get("description") or "",
                            "schema": schema if isinstance(schema, dict) else {"type": "object"},
                            "timeout_ms": spec.get("timeout_ms", timeout_ms),
                            "server": spec["name"]}, tenants, remote, conn))
    return out


def open_servers(specs: list[dict[str, Any]], timeout_ms: float,
                 registered: dict[str, Any]) -> tuple[list[McpTool], Callable[[], None]]:
    """Connect to the stage's servers and list their tools: ``(tools, close)``; ``close``
    releases the connections. ``registered``: the stage's own tools by name (a name
    used twice fails naming both). ``timeout_ms``: the stage's default call timeout."""
    held: list[Connection] = []
    closed = False

    def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            for c in held:
                _release(c)

    tools: list[McpTool] = []
    owner = {n: f"the registered tool '{n}' (fn {t.get('fn')})" for n, t in registered.items()}
    try:
        for spec in specs:
            conn = _acquire(spec)
            held.append(conn)
            for tool in _tools_of(spec, conn, timeout_ms):
                name = tool.entry["name"]
                mine = f"tool '{tool.remote}' of MCP server '{spec['name']}'"
                if name in owner:
                    raise ToolError(f"tool name '{name}' is used twice: by {owner[name]} and "
                                    f"by the {mine}; give the server a prefix (mcp.prefix) or "
                                    "pick its tools (mcp.tools)")
                owner[name] = f"the {mine}"
                tools.append(tool)
    except BaseException:
        close()
        raise
    return tools, close
