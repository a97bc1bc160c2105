"""Fakes for fast serving tests: an echo generation engine and blocking map functions."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import tailrace as tr
from tailrace.engines import Generation, GenerationRequest
from tailrace.engines.structured import refuse


class EchoEngine:
    """Generates the prompt's words back, one piece per word, ``delay`` seconds apart.

    Honours the cancellation protocol: ``on_token`` returning False stops a sequence
    with finish_reason "cancelled". Every finished generation is appended to ``LOG``.
    """

    LOG: list[Generation] = []
    REQUESTS: list[GenerationRequest] = []  # every request it was given
    chat = True
    context_length = 4096

    def __init__(self, model: str = "echo", path: str | None = None, delay: float = 0.0,
                 repeat: int = 1, context: int = 4096, finish: str | None = None):
        self.model = model
        self.finish = finish  # reported instead of the real finish reason
        self.context_length = context
        self.delay = delay
        self.repeat = repeat

    def count_tokens(self, text: str) -> int:
        return len(text.split()) + 1  # like a BOS token

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Any = None) -> list[Generation]:
        refuse(self, requests)  # no JSON constraint here (no ``response_formats``)
        out = []
        EchoEngine.REQUESTS.extend(requests)
        for i, r in enumerate(requests):
            text = r.messages[-1]["content"] if r.messages else r.prompt or ""
            words = (text.split() * self.repeat)[:r.max_tokens]
            done, reason = [], "length" if len(words) == r.max_tokens else "stop"
            for w in words:
                if self.delay:
                    time.sleep(self.delay)
                piece = w if not done else " " + w
                done.append(piece)
                if on_token is not None and on_token(i, piece) is False:
                    reason = "cancelled"
                    break
            g = Generation("".join(done), len(text.split()), len(done),
                           self.finish if self.finish and reason != "cancelled" else reason)
            EchoEngine.LOG.append(g)
            out.append(g)
        return out

    def close(self) -> None:
        pass


def echo_spec(**kw: Any) -> dict[str, Any]:
    """An engine spec for ``EchoEngine`` (``register_echo`` must have run)."""
    return {"backend": "echo", "model": "echo", "path": __file__, **kw}


def register_echo(monkeypatch: Any) -> None:
    """Make ``backend: echo`` known to the engine registry for one test."""
    from tailrace.engines import models as registry

    monkeypatch.setitem(registry.BACKENDS, "echo",
                        ("tests.serving.fakes", "EchoEngine", ("generate",)))


GATE = threading.Event()  # set: ``held`` returns
ENTERED = threading.Event()  # set by ``held`` when a record arrives


def held(record: dict) -> dict:
    """Blocks until ``GATE`` is set (run it as a blocking stage)."""
    ENTERED.set()
    if not GATE.wait(10):
        raise TimeoutError("test gate never opened")
    return {**record, "held": True}


def shout(record: dict) -> dict:
    """Upper-cases ``text``; fails on 'boom'."""
    if record["text"] == "boom":
        raise ValueError("no boom allowed")
    return {**record, "loud": record["text"].upper()}


RECORDED: list[dict] = []  # what ``remember`` saw


def remember(record: dict) -> dict:
    """Appends the record's answer and usage to ``RECORDED`` (after a generate stage)."""
    RECORDED.append({"answer": record.get("answer"), "usage": record.get("usage")})
    return record



class Broken(tr.Operator):
    """An operator whose model fails to load when a run builds it."""

    def __init__(self) -> None:
        raise RuntimeError("model file vanished")

    def process(self, record: dict) -> dict:
        return record


def echo_pipeline(name: str = "echo", **engine: Any) -> tr.Pipeline:
    """``question`` -> ``generate`` over the EchoEngine -> ``answer`` (+ ``usage``)."""
    p = tr.Pipeline(name, engines={"llm": echo_spec(**engine)})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=8, usage="usage")
     .sink())
    return p


def shout_pipeline(name: str = "shout") -> tr.Pipeline:
    """``text`` -> ``shout`` (a map) -> ``loud``."""
    p = tr.Pipeline(name)
    p.source(fields=["text"]).map(shout, id="shout").sink()
    return p


class ToolEngine(EchoEngine):
    """An engine that calls client tools by script: offered tools and no tool result
    after the last user message yet, it calls the first offered function (or the one
    ``tool_choice`` names) with ``ARGS`` (string values ``repeat`` times over) in the
    call form (``engines/tool_calls.py``), streamed in pieces ``delay`` seconds apart;
    once a tool result follows the last user message, it answers ``"The tool said:
    <result>"``. Without tools it echoes like ``EchoEngine``."""

    tool_calls = True
    ARGS: dict[str, Any] = {"city": "Paris"}

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Any = None) -> list[Generation]:
        from tailrace.engines.tool_calls import format_call

        out: list[Generation] = []
        for i, r in enumerate(requests):
            EchoEngine.REQUESTS.append(r)
            msgs = list(r.messages or ())
            last_user = max((j for j, m in enumerate(msgs) if m["role"] == "user"), default=-1)
            results = [m for m in msgs[last_user + 1:] if m["role"] == "tool"]
            spec = r.tools
            if results:
                text = "The tool said: " + results[-1]["content"]
            elif spec is not None and spec.offered:
                import json

                args = {k: v * self.repeat if isinstance(v, str) else v
                        for k, v in self.ARGS.items()}  # ``repeat``: a longer call
                text = format_call(spec.offered[0]["name"], json.dumps(args))
            else:
                out.extend(super().generate([r], None if on_token is None else
                                            (lambda _, p, i=i: on_token(i, p))))
                continue
            pieces = [text[k:k + 7] for k in range(0, len(text), 7)]
            finish = "stop"
            for p in pieces:
                if self.delay:
                    time.sleep(self.delay)
                if on_token is not None and on_token(i, p) is False:
                    finish = "cancelled"
                    break
            g = Generation(text, sum(len(str(m.get("content", "")).split()) for m in msgs),
                           len(pieces), finish)
            EchoEngine.LOG.append(g)
            out.append(g)
        return out


def register_tools(monkeypatch: Any) -> None:
    """Make ``backend: tools`` (``ToolEngine``) known to the engine registry for one test."""
    from tailrace.engines import models as registry

    monkeypatch.setitem(registry.BACKENDS, "tools",
                        ("tests.serving.fakes", "ToolEngine", ("generate",)))
