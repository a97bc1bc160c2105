"""The Responses API's output (``POST /v1/responses``; docs/responses.md): an answer's
output items (``output_items``; an answer in the call form of ``engines/tool_calls.py``
is function_call items), the finished response object (``complete``), the assistant turn
a later request's conversation carries (``turn_of``), and the server-sent events of a
streamed answer (``EventStream``), as OpenAI sends them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..engines.tool_calls import CallStream, ToolSpec, split_calls
from .openai_wire import call_id, dumps


def new_id(prefix: str) -> str:
    """A new object id (``resp_...``, ``msg_...``, ``fc_...``): 32 random hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message output item holding ``text``."""
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(name: str, arguments: str, cid: str | None = None,
              iid: str | None = None) -> dict[str, Any]:
    """A function_call output item (``cid``: its call id, a new one if None)."""
    return {"id": iid or new_id("fc"), "type": "function_call", "call_id": cid or call_id(),
            "name": name, "arguments": arguments, "status": "completed"}


def output_items(answer: str, tools: ToolSpec | None) -> list[dict[str, Any]]:
    """A whole answer's output items: its text as a message, its calls (an answer in the
    call form, when the request offered tools) as function_call items."""
    text, calls = split_calls(answer) if tools is not None else (answer, [])
    items = [message_item(text)] if text.strip() or not calls else []
    return items + [call_item(name, args) for name, args in calls]


def usage_body(u: dict[str, Any]) -> dict[str, Any]:
    """A chat usage (``binding.usage_of``) in the Responses form."""
    out: dict[str, Any] = {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {})
                                 .get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0, **u.get("completion_tokens_details",
                                                                 {})},
        "total_tokens": u["total_tokens"]}
    if "cost" in u:
        out["cost"] = u["cost"]
    return out


#: finish reasons that leave a response incomplete -> ``incomplete_details.reason``
CUT = {"length": "max_output_tokens", "content_filter": "content_filter"}


def complete(shell: dict[str, Any], output: list[dict[str, Any]], usage: dict[str, Any],
             finish: str) -> dict[str, Any]:
    """The finished response object: ``completed``, or ``incomplete`` (its last item
    too) when the answer was cut by ``max_output_tokens`` or a content filter."""
    reason = CUT.get(finish)
    if reason is not None and output:
        output[-1]["status"] = "incomplete"
    return {**shell, "status": "completed" if reason is None else "incomplete",
            "completed_at": int(time.time()) if reason is None else None,
            "incomplete_details": None if reason is None else {"reason": reason},
            "output": output, "usage": usage_body(usage)}


def turn_of(output: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items as the assistant message a later request's conversation carries."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for it in output:
        if it["type"] == "message":
            msg["content"] += "".join(p["text"] for p in it["content"])
        else:
            msg.setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function",
                 "function": {"name": it["name"], "arguments": it["arguments"]}})
    return msg


class EventStream:
    """The server-sent events of one streamed response, as OpenAI sends them (an
    ``event:`` line, ``type`` and ``sequence_number`` in each): ``start``, then ``feed``
    each text piece (through a ``CallStream`` when tools were offered: text becomes a
    message item's deltas, a call a function_call item's), then ``finish`` (or
    ``error``). ``output``: the items so far; ``response``: the finished object."""

    def __init__(self, shell: dict[str, Any], tools: bool) -> None:
        self.shell = shell
        self.seq = 0
        self.calls = CallStream() if tools else None
        self.output: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None  # the item being written

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.shell),
                self._event("response.in_progress", response=self.shell)]

    def feed(self, text: str) -> list[bytes]:
        events = self.calls.feed(text) if self.calls is not None else [("text", text)]
        return self._on(events)

    def _on(self, events: list[tuple]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if e[0] == "text" and e[1]:
                out += self._text(e[1])
            elif e[0] == "call":
                out += self._close()
                self._open = {**call_item(e[2], ""), "status": "in_progress"}
                self.output.append(self._open)
                out.append(self._event("response.output_item.added",
                                       output_index=len(self.output) - 1, item=self._open))
            elif e[0] == "args" and self._open is not None:
                self._open["arguments"] += e[2]
                out.append(self._event("response.function_call_arguments.delta",
                                       **self._where(), delta=e[2]))
        return out

    def _message(self) -> list[bytes]:
        out = self._close()
        self._open = {**message_item("", "in_progress"), "content": []}
        self.output.append(self._open)
        out.append(self._event("response.output_item.added",
                               output_index=len(self.output) - 1, item=self._open))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out.append(self._event("response.content_part.added", **self._where(),
                               content_index=0, part=part))
        self._open["content"].append(part)
        return out

    def _text(self, text: str) -> list[bytes]:
        out = self._message() if self._open is None or self._open["type"] != "message" else []
        assert self._open is not None
        self._open["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                               delta=text, logprobs=[]))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        self._open = None
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [self._event("response.output_text.done", **where, content_index=0,
                               text=part["text"], logprobs=[]),
                   self._event("response.content_part.done", **where, content_index=0,
                               part=part)]
        else:
            out = [self._event("response.function_call_arguments.done", **where,
                               name=item["name"], arguments=item["arguments"])]
        return out + [self._event("response.output_item.done",
                                  output_index=where["output_index"], item=item)]

    def finish(self, usage: dict[str, Any], finish: str) -> list[bytes]:
        """The last events: the open item done, then ``response.completed`` (or
        ``response.incomplete``) with the whole response (kept in ``response``)."""
        out = self._on(self.calls.close()) if self.calls is not None else []
        if not self.output:
            out += self._message()  # an empty answer is an empty message
        out += self._close("incomplete" if finish in CUT else "completed")
        last = complete(self.shell, self.output, usage, finish)
        self.response = last
        return out + [self._event(f"response.{last['status']}", response=last)]

    def error(self, message: str, code: str) -> list[bytes]:
        """A failure mid-stream: an ``error`` event (the stream then ends)."""
        return [self._event("error", code=code, message=message, param=None)]
