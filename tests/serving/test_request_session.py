"""A request's session id reaches its generation request: the OpenAI ``user`` field or the
``X-Tailrace-Session`` header (``/runs``: the header) -> the record's ``_session`` -> the
generate stage's ``GenerationRequest.session`` (engine pools route by it). Real uvicorn,
the official ``openai`` client, the echo engine recording what it was given."""

from __future__ import annotations

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.serving import fakes
from tests.serving.server import running


@pytest.fixture
def url(monkeypatch):
    fakes.register_echo(monkeypatch)
    fakes.EchoEngine.REQUESTS.clear()
    p = tr.Pipeline("chat", engines={"llm": fakes.echo_spec()})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=8)
     .sink())
    with running(ServingHub([PipelineService(p)])) as u:
        yield u


def sessions() -> list[str | None]:
    out = [r.session for r in fakes.EchoEngine.REQUESTS]
    fakes.EchoEngine.REQUESTS.clear()
    return out


def test_user_field_and_header_become_the_generation_requests_session(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hello there"}]
    c.chat.completions.create(model="chat", messages=msgs, user="conv-1")
    assert sessions() == ["conv-1"]
    c.chat.completions.create(model="chat", messages=msgs, user="conv-1",
                              extra_headers={"X-Tailrace-Session": "conv-2"})
    assert sessions() == ["conv-2"]  # the header wins
    c.completions.create(model="chat", prompt="hello", user="")
    assert sessions() == [None]  # empty: no session
    httpx.post(url + "/v1/pipelines/chat/runs", json={"question": "hi"},
               headers={"X-Tailrace-Session": "conv-3"}).raise_for_status()
    assert sessions() == ["conv-3"]


def test_a_bad_session_is_a_400_naming_the_field(url):
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "chat", "messages": [{"role": "user", "content": "hi"}], "user": 7})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("'user' must be a string of at most 256 "
                                            "characters (a session id), got 7")
    r = httpx.post(url + "/v1/pipelines/chat/runs", json={"question": "hi"},
                   headers={"X-Tailrace-Session": "x" * 257})
    assert r.status_code == 400 and "header X-Tailrace-Session must be a string" in r.text
    assert sessions() == []
