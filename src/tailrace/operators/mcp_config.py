"""The ``mcp:`` entries of a ``tool_call`` stage, checked when the pipeline compiles
(docs/stateful.md, "MCP servers"); ``mcp_tools.py`` connects to them when it runs."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from ..api.pipeline import did_you_mean

KEYS = ("name", "command", "env", "cwd", "url", "headers", "headers_env", "tools", "prefix",
        "timeout_ms", "connect_timeout_ms", "tenants")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _strings(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, str) and x for x in v)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                       for k, x in v.items())


def _ms(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def check_servers(raw: Any) -> list[dict[str, Any]]:
    """The stage's ``mcp:`` list, checked (ValueError naming ``mcp[i].key``); a stdio
    server's executable must be on PATH (or an existing file)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("'mcp' must be a non-empty list of servers like {name: files, "
                         "command: [python, -m, mypkg.server]} or {name: s, url: "
                         "http://host:port/mcp}")
    names: set[str] = set()
    out = []
    for i, s in enumerate(raw):
        where = f"mcp[{i}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where} must be a mapping with name and command or url, got {s!r}")
        for k in s:
            if k not in KEYS:
                raise ValueError(f"{where}: unknown key '{k}'{did_you_mean(k, KEYS)} "
                                 f"(allowed: {', '.join(KEYS)})")
        name = s.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.name must name the server (letters, digits, _ . -), "
                             f"got {name!r}")
        if name in names:
            raise ValueError(f"{where}: server '{name}' is listed twice")
        names.add(name)
        where = f"mcp[{i}] ('{name}')"
        if ("command" in s) == ("url" in s):
            raise ValueError(f"{where}: give exactly one of command (stdio) or url "
                             "(streamable HTTP)")
        stdio_only, http_only = ("env", "cwd"), ("headers", "headers_env")
        for k in stdio_only if "url" in s else http_only:
            if k in s:
                raise ValueError(f"{where}: '{k}' is for a "
                                 f"{'command (stdio)' if k in stdio_only else 'url'} server")
        checks: list[tuple[str, Callable[[Any], bool], str]] = [
            ("command", _strings, "a list like [python, -m, mypkg.server]"),
            ("env", _str_map, "a mapping of NAME: 'value' (quote numbers)"),
            ("cwd", lambda v: isinstance(v, str) and bool(v), "a directory"),
            ("url", lambda v: isinstance(v, str) and v.startswith(("http://", "https://")),
             "an http:// or https:// URL"),
            ("headers", _str_map, "a mapping of Header: 'value'"),
            ("headers_env", _str_map, "a mapping of Header: ENV_VAR (the value is read "
             "from the variable when the stage starts)"),
            ("tools", _strings, "a list of the server's tool names"),
            ("prefix", lambda v: isinstance(v, str) and bool(_NAME.match(v)),
             "letters, digits, _ . - (prepended to its tool names)"),
            ("timeout_ms", _ms, "a positive number"),
            ("connect_timeout_ms", _ms, "a positive number"),
            ("tenants", _strings, "a list of tenant names")]
        for key, ok, want in checks:
            if key in s and not ok(s[key]):
                raise ValueError(f"{where}.{key} must be {want}, got {s[key]!r}")
        if "command" in s:
            exe = s["command"][0]
            found = (os.path.isfile(os.path.join(s.get("cwd") or "", exe)) if os.sep in exe
                     else shutil.which(exe) is not None)
            if not found:
                raise ValueError(f"{where}.command: '{exe}' is not "
                                 f"{'a file' if os.sep in exe else 'on PATH'}; give the "
                                 "server's executable (e.g. a full path)")
            if "cwd" in s and not os.path.isdir(s["cwd"]):
                raise ValueError(f"{where}.cwd: no such directory '{s['cwd']}'")
        out.append(dict(s))
    return out
