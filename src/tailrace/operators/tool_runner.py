"""The tools of one ``tool_call`` stage: look-up (per tenant), validation, timed calls.

A stage's tools are its registered Python functions (``tools:``) and the tools its MCP
servers list (``mcp:``, ``mcp_tools.py``). Both are called the same way: the arguments
are validated against the tool's JSON schema first (an invalid call never runs), then
the call runs with a timeout, a function on a worker thread, an MCP tool on its
server's connection. An MCP server's tools may be limited to some tenants: a request of
another tenant is not shown them, and a call to one is refused as not registered.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from time import monotonic
from typing import Any

from .mcp_tools import McpCallFailed, McpTool
from .registry import resolve
from .tool_schema import ToolError, validate

_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="tailrace-tool")


class ToolRunner:
    """The tools of one stage (registered functions first, then MCP tools)."""

    def __init__(self, tools: list[dict], timeout_s: float,
                 remote: list[McpTool] | tuple[McpTool, ...] = ()) -> None:
        """Resolve the function of each ``{name, fn, schema, description, timeout_ms}``
        (checked at compile time) and take the ``remote`` MCP tools (names checked
        unique by ``open_servers``); ``timeout_s``: the default per-call timeout."""
        self.tools = {t["name"]: t for t in tools}
        self.fns = {t["name"]: resolve(t["fn"]) for t in tools}
        self.remote = {r.entry["name"]: r for r in remote}
        self.tools.update((n, r.entry) for n, r in self.remote.items())
        self.timeout_s = timeout_s
        self.names = tuple(self.tools)
        self.limited = {n: r.tenants for n, r in self.remote.items() if r.tenants is not None}
        self._described: dict[tuple[str, ...], str] = {}
        self._openai: dict[tuple[str, ...], list[dict]] = {}

    def visible(self, tenant: str | None) -> tuple[str, ...]:
        """The names of the tools a request of ``tenant`` (None: none) may see and call."""
        if not self.limited:
            return self.names
        return tuple(n for n in self.names
                     if n not in self.limited or tenant in self.limited[n])

    def start(self, name: str, args: Any, rnd: int, names: tuple[str, ...] | None = None
              ) -> tuple[Future | None, float, str]:
        """Submit one call of a tool among ``names`` (default: all); returns (future or
        None, deadline, error message)."""
        names = self.names if names is None else names
        if name not in self.tools or name not in names:
            return None, 0.0, (f"round {rnd}: the model called tool '{name}', which is not "
                               f"registered (registered: {', '.join(names) or 'none'})")
        tool = self.tools[name]
        try:
            if isinstance(args, ToolError):
                raise args
            if not isinstance(args, dict):
                raise ToolError(f"arguments: expected object, got {type(args).__name__}")
            validate(args, tool.get("schema") or {"type": "object"})
        except ToolError as e:
            return None, 0.0, f"round {rnd}: tool '{name}': invalid arguments: {e}"
        timeout = tool.get("timeout_ms", self.timeout_s * 1000) / 1000
        remote = self.remote.get(name)
        fut = remote.submit(args) if remote is not None else _POOL.submit(self.fns[name], **args)
        return fut, monotonic() + timeout, ""

    def finish(self, name: str, fut: Future, deadline: float, rnd: int) -> tuple[Any, str]:
        """(result, "") or (None, error message) of a submitted call."""
        try:
            return fut.result(timeout=max(0.0, deadline - monotonic())), ""
        except FutureTimeout:
            fut.cancel()  # an MCP call is cancelled; a function's thread is abandoned
            ms = self.tools[name].get("timeout_ms", self.timeout_s * 1000)
            return None, f"round {rnd}: tool '{name}' timed out after {ms:g} ms"
        except McpCallFailed as e:
            return None, (f"round {rnd}: tool '{name}' {e.verb} (MCP server "
                          f"'{self.tools[name].get('server')}'): {e.detail}")
        except Exception as e:  # noqa: BLE001 - the tool's own failure
            return None, f"round {rnd}: tool '{name}' raised {type(e).__name__}: {e}"

    def describe(self, names: tuple[str, ...] | None = None) -> str:
        """The tool list (of ``names``, default all) for the JSON convention's system
        message."""
        names = self.names if names is None else names
        text = self._described.get(names)
        if text is None:
            text = self._described[names] = "\n".join(
                f"- {n}: {self.tools[n].get('description', '')} arguments (JSON schema): "
                f"{json.dumps(self.tools[n].get('schema') or {'type': 'object'})}"
                for n in names)
        return text

    def openai_tools(self, names: tuple[str, ...] | None = None) -> list[dict]:
        """The tools (of ``names``, default all) in OpenAI function-calling form."""
        names = self.names if names is None else names
        listed = self._openai.get(names)
        if listed is None:
            listed = self._openai[names] = [{"type": "function", "function": {
                "name": n, "description": self.tools[n].get("description", ""),
                "parameters": self.tools[n].get("schema") or {"type": "object",
                                                              "properties": {}}}}
                for n in names]
        return listed
