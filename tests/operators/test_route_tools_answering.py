"""route and tool_call as the answering stage of a served request, run locally with the
transient fields the server sets: a route batch that fails after streaming is not
answered twice; a tool_call whose caller gave up starts no further round."""

from __future__ import annotations

import json
import threading

import pytest

import tailrace as tr
from tailrace.engines import BACKENDS, Generation
from tailrace.errors import EngineError
from tailrace.request import REQUEST, Cancel, Request

CALLS: list[int] = []  # the batch size of each engine call


class Flaky:
    """Streams each request's first word, then fails a batch of more than one; alone,
    a request is answered (its words back)."""

    chat, context_length = True, 512

    def __init__(self, path: str, model: str) -> None:
        self.model = model

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, requests, on_token=None):
        CALLS.append(len(requests))
        for i, r in enumerate(requests):
            if on_token is not None:
                on_token(i, r.messages[-1]["content"].split()[0])
        if len(requests) > 1:
            raise EngineError("the batch failed")
        text = r.messages[-1]["content"]
        return [Generation(text, 1, len(text.split()), "stop")]

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def flaky_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "flaky", ("tests.operators.test_route_tools_answering",
                                            "Flaky", ("generate",)))
    CALLS.clear()


def test_a_route_answer_that_streamed_before_its_batch_failed_is_not_sent_twice():
    p = tr.Pipeline("routed", engines={"a": {"backend": "flaky", "path": __file__,
                                             "model": "a"}})
    p.source(fields=["q"]).apply("route", rules=[], default="a", input="q",
                                 max_batch=8, batch={"max_size": 2, "max_wait_ms": 1000}
                                 ).sink()
    pieces: list[str] = []
    streamed = {"q": "streamed words",
                REQUEST: Request(options={}, answers="answer", sink=pieces.append)}
    quiet = {"q": "quiet words", REQUEST: Request(options={}, answers="answer")}
    result = tr.run(p, runtime="local", input=[streamed, quiet])
    assert CALLS == [2, 1]  # the batch, then the quiet one alone
    assert pieces == ["streamed"]  # its first piece went out once; no second answer
    [err] = result.errors
    assert err.input["q"] == "streamed words" and "the batch failed" in err.message
    [out] = result.outputs
    assert out["answer"] == "quiet words"


GONE = threading.Event()  # what the record's request's cancel reads in the tool_call test
LEFT: list[str] = []


def leave() -> str:
    """A tool during which the caller goes away."""
    LEFT.append("called")
    GONE.set()
    return "ok"


class Caller:
    """Calls the ``leave`` tool first, then answers; records each request."""

    chat, context_length = True, 512
    REQUESTS: list = []

    def __init__(self, path: str, model: str) -> None:
        self.model = model

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, requests, on_token=None):
        Caller.REQUESTS.extend(requests)
        out = []
        for r in requests:
            done = r.messages[-1]["content"].startswith("Result of leave")
            out.append(Generation("the answer" if done else
                                  json.dumps({"tool": "leave", "arguments": {}}), 4, 2, "stop"))
        return out

    def close(self) -> None:
        pass


def test_a_tool_call_whose_caller_left_starts_no_further_round(monkeypatch):
    monkeypatch.setitem(BACKENDS, "caller", ("tests.operators.test_route_tools_answering",
                                             "Caller", ("generate",)))
    p = tr.Pipeline("agent", engines={"c": {"backend": "caller", "path": __file__,
                                            "model": "c"}})
    p.source(fields=["q"]).apply("tool_call", engine="c", input="q", tools=[{
        "name": "leave", "fn": "tests.operators.test_route_tools_answering.leave"}]).sink()
    GONE.clear()
    Caller.REQUESTS.clear()
    pieces: list[str] = []
    result = tr.run(p, runtime="local", input=[
        {"q": "go", REQUEST: Request(options={}, answers="answer", sink=pieces.append,
                                     cancel=Cancel(GONE))}])
    assert not result.errors, result.errors
    assert LEFT == ["called"] and len(Caller.REQUESTS) == 1  # no round after it left
    assert pieces == []  # the tool call was never streamed
    assert result.outputs[0]["answer"] == ""
