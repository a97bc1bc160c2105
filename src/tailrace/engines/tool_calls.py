"""Client tools (OpenAI function calling), engine-neutral: the checked tool set a request
offers, the one text form every engine answers a call in, and its parsers.

A call travels as text, so it streams and crosses processes like any answer:
``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, one block per call (the
form Qwen and SmolLM2 were trained on). llama.cpp writes it under a grammar
(``llama_cpp.grammar.tool_grammar``); the ``openai`` backend writes the remote server's
calls in it. ``CallStream`` turns the text, piece by piece, into OpenAI's deltas (the
name first, then the arguments as they come); ``split_calls`` does the same for a whole
answer. docs/serving.md ("Tools") has the rules.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from .structured import check_schema

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolSpec:
    """The function tools a request offers and how the model may use them.

    functions: ``{"name", "description", "parameters"}`` each (parameters: a JSON Schema
               of an object).
    choice:    ``auto`` (answer or call), ``required`` (call), ``none`` (answer in text)
               or a function's name (call that one).
    parallel:  whether one answer may hold several calls.
    """

    functions: tuple[dict[str, Any], ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def offered(self) -> tuple[dict[str, Any], ...]:
        """The functions the model may call now."""
        if self.choice == "none":
            return ()
        if self.choice in CHOICES:
            return self.functions
        return tuple(f for f in self.functions if f["name"] == self.choice)

    @property
    def must_call(self) -> bool:
        return self.choice not in ("auto", "none")


def check_tools(tools: Any, choice: Any, parallel: Any, *, flat: bool = False
                ) -> ToolSpec | None:
    """The checked ``ToolSpec`` of a request's ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` (None: no tools); ValueError naming the bad field.
    ``flat``: the Responses API's forms (``{"type": "function", "name": ...}``)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ValueError(f"'parallel_tool_calls' must be true or false, got {parallel!r}")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ValueError("'tool_choice' needs 'tools': there is no function to call")
        return None
    if not isinstance(tools, list):
        raise ValueError("'tools' must be a list of function tools")
    functions: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ValueError(f"{where}.type: '{kind}' tools are not supported (function "
                             "tools only)")
        fn: Any = t if flat else t.get("function")
        if not flat:
            where += ".function"
            if not isinstance(fn, dict):
                raise ValueError(f"{where} must be an object with a 'name'")
            extra = set(t) - {"type", "function"}
        else:
            extra = set()
        allowed = {"name", "description", "parameters", "strict"} | ({"type"} if flat else set())
        extra |= set(fn) - allowed
        if extra:
            raise ValueError(f"{where}: unknown field '{sorted(extra)[0]}' (a function tool "
                             "has name, description, parameters and strict)")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.name must be 1-64 letters, digits, '_' or '-', got "
                             f"{name!r}")
        if any(f["name"] == name for f in functions):
            raise ValueError(f"{where}.name: '{name}' is offered twice")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"{where}.parameters must be a JSON Schema of an object")
        _check_parameters(json.dumps(params, sort_keys=True, default=repr), f"{where}.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"{where}.description must be a string")
        if fn.get("strict") not in (None, True, False):
            raise ValueError(f"{where}.strict must be true or false")
        functions.append({"name": name, "description": desc or "", "parameters": params})
    return ToolSpec(tuple(functions), _choice(choice, functions, flat),
                    True if parallel is None else parallel)


@functools.lru_cache(maxsize=256)
def _check_parameters(text: str, where: str) -> None:
    """ValueError naming ``where`` unless the JSON Schema ``text`` is valid (cached: an
    agent sends the same tools every turn, and a meta-schema check takes ~0.4 ms)."""
    check_schema(json.loads(text), where)


def _choice(choice: Any, functions: list[dict[str, Any]], flat: bool) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"'tool_choice' must be none, auto, required or "
                             f"{{\"type\": \"function\", ...}}, got {choice!r}")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and not flat else choice
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(name, str):
        form = '{"type": "function", "name": NAME}' if flat else \
            '{"type": "function", "function": {"name": NAME}}'
        raise ValueError(f"'tool_choice' must be none, auto, required or {form}, got "
                         f"{choice!r}")
    if name in CHOICES or not any(f["name"] == name for f in functions):
        raise ValueError(f"'tool_choice' names function '{name}', which 'tools' does not "
                         f"offer (offered: {', '.join(f['name'] for f in functions)})")
    return name


def format_call(name: str, arguments: str) -> str:
    """One call in the text form (``arguments``: JSON text)."""
    args = arguments or "{}"
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {args}}}{CALL_CLOSE}'


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*" + re.escape(CALL_CLOSE) + r"\s*")


class CallStream:
    """Text pieces of an answer in, events out: ``("text", s)``, ``("call", i, name)``
    (call ``i`` starts) and ``("args", i, s)`` (more of its arguments' JSON text).

    An answer whose first non-space text is not ``<tool_call>`` is text, streamed as it
    comes; a call's name is sent once known and its arguments as they are written. A
    call in another layout (arguments before name) is sent whole once it closes.
    ``calls``: ``[name, arguments]`` of each call; ``broken``: a call did not close
    (cut by ``max_tokens``) or did not parse.
    """

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.text: list[str] = []
        self.broken = False
        self._buf = ""
        self._state = "start"  # start | text | head | args | tail
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._began = False

    def feed(self, piece: str) -> list[tuple]:
        if self._state == "text":
            self.text.append(piece)
            return [("text", piece)]
        self._buf += piece
        out: list[tuple] = []
        while self._buf and self._step(out):
            pass
        return out

    def _step(self, out: list[tuple]) -> bool:
        """Advance on the buffer; False: it needs more text."""
        buf = self._buf
        if self._state == "start":
            s = buf.lstrip()
            if not s:
                return False
            if s.startswith(CALL_OPEN):
                self._buf, self._state = s[len(CALL_OPEN):], "head"
                return True
            if CALL_OPEN.startswith(s):
                return False
            if self.calls:  # text after the calls: kept as text
                self.broken = self.broken or bool(s.strip())
            self._state, self._buf = "text", ""
            self.text.append(buf)
            out.append(("text", buf))
            return False
        if self._state == "head":
            m = _HEAD.match(buf)
            if m is None:
                return self._whole(out)
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                self.broken = True
                return False
            self.calls.append([name, ""])
            out.append(("call", len(self.calls) - 1, name))
            self._buf, self._state = buf[m.end():], "args"
            self._depth, self._in_str, self._esc, self._began = 0, False, False, False
            return True
        if self._state == "args":
            if not self._began:  # the space before the arguments is not theirs
                buf = buf.lstrip()
                if not buf:
                    self._buf = ""
                    return False
            end = self._scan(buf)
            part = buf if end < 0 else buf[:end]
            if part:
                self.calls[-1][1] += part
                out.append(("args", len(self.calls) - 1, part))
            self._buf = "" if end < 0 else buf[end:]
            if end >= 0:
                self._state = "tail"
                return True
            return False
        # tail: '}' and '</tool_call>' close the call
        m = _TAIL.match(buf)
        if m is None:
            if CALL_CLOSE in buf or len(buf) > 64:  # not the form's close
                self.broken = True
                self._state, self._buf = "text", ""
            return False
        self._buf, self._state = buf[m.end():], "start"
        return True

    def _whole(self, out: list[tuple]) -> bool:
        """A call in an unexpected layout: parse it once its block closes."""
        end = self._buf.find(CALL_CLOSE)
        if end < 0:
            return False
        block, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE):]
        try:
            obj = json.loads(block)
            name, args = obj["name"], obj["arguments"]
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            self.broken = True
            self._state = "text"
            return False
        text = json.dumps(args, ensure_ascii=False)
        self.calls.append([name, text])
        out += [("call", len(self.calls) - 1, name), ("args", len(self.calls) - 1, text)]
        self._state = "start"
        return True

    def _scan(self, s: str) -> int:
        """Where the arguments' JSON value ends in ``s`` (-1: not yet)."""
        for i, c in enumerate(s):
            if not self._began:
                if c.isspace():
                    continue
                self._began = True
                if c not in "{[":
                    self.broken = True  # arguments must be an object
                    return i
                self._depth = 1
                continue
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return -1

    def close(self) -> list[tuple]:
        """The end of the answer: what the buffer still holds, as text if no call began."""
        out: list[tuple] = []
        if self._state == "start" and self._buf and not self.calls:
            self.text.append(self._buf)
            out.append(("text", self._buf))
        elif self._state in ("head", "args", "tail") or self._buf.strip():
            self.broken = True  # a call that did not close
        self._buf = ""
        return out


def split_calls(text: str) -> tuple[str, list[list[str]]]:
    """A whole answer as (text, ``[name, arguments]`` of each call); an answer whose call
    did not close or parse is all text, with no calls."""
    s = CallStream()
    s.feed(text)
    s.close()
    if s.broken or not s.calls:
        return text, []
    return "".join(s.text), s.calls


# -- prompts for engines that read tools as text (llama.cpp) -----------------------------
_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_HOW = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def tool_prompt(messages: Any, spec: ToolSpec | None) -> tuple[dict[str, str], ...]:
    """Chat messages with tools as text, for a model's own chat template: the offered
    functions described in the system message, an assistant's calls in the call form
    and tool results as ``<tool_response>`` user turns."""
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            calls = "".join(format_call(c["function"]["name"], c["function"]["arguments"])
                            for c in m["tool_calls"])
            out.append({"role": "assistant", "content": content + calls})
        else:
            out.append({"role": role, "content": content})
    fns = spec.offered if spec is not None else ()
    if fns:
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                           for f in fns)
        block = _TOOLS_INTRO + listed + _TOOLS_HOW
        if spec is not None and spec.must_call:
            block += "\n\nAnswer with a function call."
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return tuple(out)


def call_schema(spec: ToolSpec) -> dict[str, Any]:
    """The JSON Schema of one call to an offered function (``{"name", "arguments"}``)."""
    one = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                             "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}
           for f in spec.offered]
    return one[0] if len(one) == 1 else {"anyOf": one}
