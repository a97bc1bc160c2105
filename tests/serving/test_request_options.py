"""Per-request options through a live server and the official ``openai`` client: what
reached the (fake) engine, the YAML's ceiling and frozen options, the engine's finish
reason, and a 400 naming each field tailrace cannot honour."""

from __future__ import annotations

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.serving import fakes
from tests.serving.server import running


def pipeline(name: str, engine: dict | None = None, **stage) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": fakes.echo_spec(**(engine or {}))})
    (p.source(fields=["question"])
     .apply("generate", id="draft", engine="llm", input="question", output="draft",
            max_tokens=8)
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=8, stop=["END"], usage="usage", **stage)
     .sink())
    return p


@pytest.fixture
def url(monkeypatch):
    fakes.register_echo(monkeypatch)
    fakes.EchoEngine.REQUESTS.clear()
    hub = ServingHub([PipelineService(pipeline("opts")),
                      PipelineService(pipeline("frozen", frozen=["temperature", "seed"])),
                      PipelineService(pipeline("stops", {"finish": "stop"}))])
    with running(hub) as u:
        yield u


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


USER = [{"role": "user", "content": "one two three four five"}]


def test_options_reach_the_answering_stage_only(url):
    r = client(url).chat.completions.create(
        model="opts", messages=USER, max_tokens=3, temperature=0.7, top_p=0.9, stop="x",
        seed=7, presence_penalty=0.5, frequency_penalty=-0.25, user="u1",
        metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=True,
        stream_options=None)
    draft, answer = fakes.EchoEngine.REQUESTS[-2:]
    assert (draft.max_tokens, draft.temperature, draft.seed, draft.stop) == (8, 0.0, None, ())
    assert (answer.max_tokens, answer.temperature, answer.top_p, answer.seed) == (3, 0.7, 0.9, 7)
    assert answer.stop == ("END", "x")
    assert (answer.presence_penalty, answer.frequency_penalty) == (0.5, -0.25)
    assert r.choices[0].message.content == "one two three"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_max_tokens_is_capped_by_the_yaml_and_completions_take_options(url):
    c = client(url)
    c.chat.completions.create(model="opts", messages=USER, max_completion_tokens=100)
    assert fakes.EchoEngine.REQUESTS[-1].max_tokens == 8
    r = c.completions.create(model="opts", prompt="a b c d", max_tokens=2, temperature=1.5,
                             seed=3)
    last = fakes.EchoEngine.REQUESTS[-1]
    assert (last.max_tokens, last.temperature, last.seed) == (2, 1.5, 3)
    assert r.choices[0].text == "a b"


def test_without_options_the_yaml_decides(url):
    client(url).chat.completions.create(model="opts", messages=USER)
    last = fakes.EchoEngine.REQUESTS[-1]
    assert (last.max_tokens, last.temperature, last.top_p, last.seed) == (8, 0.0, 1.0, None)


def test_finish_reason_is_the_engines(url):
    # 8 words with max_tokens 8: counting tokens would say "length"; the engine says stop
    r = client(url).chat.completions.create(
        model="stops", messages=[{"role": "user", "content": "a b c d e f g h"}])
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "stop"
    chunks = list(client(url).chat.completions.create(
        model="stops", messages=[{"role": "user", "content": "a b c d e f g h"}],
        stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_frozen_option_is_a_400_naming_it(url):
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="frozen", messages=USER, temperature=1.0)
    assert "'temperature' is fixed by pipeline 'frozen'" in str(e.value)
    c.chat.completions.create(model="frozen", messages=USER, top_p=0.5)  # not frozen
    assert fakes.EchoEngine.REQUESTS[-1].top_p == 0.5


@pytest.mark.parametrize(("extra", "field"), [
    ({"n": 2}, "'n'"), ({"logprobs": True}, "'logprobs'"), ({"top_logprobs": 2}, "'top_logprobs'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools'"),
    ({"tool_choice": "required"}, "'tool_choice'"), ({"functions": [{"name": "f"}]}, "'functions'"),
    ({"response_format": {"type": "json_object"}}, "'response_format'"),
    ({"logit_bias": {"50256": -100}}, "'logit_bias'"), ({"reasoning_effort": "low"},
                                                          "'reasoning_effort'"),
    ({"temperature": 3}, "'temperature'"), ({"max_tokens": 0}, "'max_tokens'"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "'stop'"), ({"seed": "x"}, "'seed'"),
    ({"top_p": 0}, "'top_p'"), ({"presence_penalty": 5}, "'presence_penalty'"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(url, extra, field):
    r = httpx.post(url + "/v1/chat/completions",
                   json={"model": "opts", "messages": USER, **extra})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_accepted_defaults_of_common_clients(url):
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "opts", "messages": USER, "n": 1, "logprobs": False, "stream": False,
        "response_format": {"type": "text"}, "tool_choice": "none", "temperature": 0.7,
        "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", json={
        "model": "opts", "prompt": "a b", "echo": False, "logprobs": None, "best_of": 1,
        "max_completion_tokens": 2})
    assert r.status_code == 400 and "'max_completion_tokens'" in r.json()["error"]["message"]


def test_the_openai_backend_passes_the_options_on(url):
    """A tailrace server over the echo engine is the recording OpenAI-compatible server:
    the ``openai`` backend's requests reach its engine with every option."""
    from tailrace.engines import GenerationRequest
    from tailrace.engines.openai import OpenAIEngine

    eng = OpenAIEngine(url + "/v1", "opts", retries=0)
    try:
        [g] = eng.generate([GenerationRequest(
            messages=({"role": "user", "content": "a b c d"},), max_tokens=2,
            temperature=0.5, top_p=0.8, stop=("zz",), seed=11, presence_penalty=0.1,
            frequency_penalty=0.2)])
    finally:
        eng.close()
    got = fakes.EchoEngine.REQUESTS[-1]
    assert (got.max_tokens, got.temperature, got.top_p, got.seed) == (2, 0.5, 0.8, 11)
    assert (got.presence_penalty, got.frequency_penalty, got.stop) == (0.1, 0.2, ("END", "zz"))
    assert g.text.endswith("a b") and g.finish_reason == "length"  # (the draft streams too)


def test_the_docs_table_lists_every_request_field_the_server_knows():
    import re
    from pathlib import Path

    from tailrace.serving import openai_wire as w
    from tailrace.serving import responses as rs

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    chat, responses = section.split("\n### `/v1/responses`", 1)

    def listed(table: str) -> set[str]:
        return {f for row in table.splitlines() if row.startswith("| `")
                for f in re.findall(r"`([a-z_]+)`", row.split("|")[1])}

    known = w._HANDLED | w.IGNORED | w.CHAT_ONLY | w.COMPLETION_ONLY
    assert known <= listed(chat) and listed(chat) <= known | {"messages"}
    known = rs.HANDLED | rs.IGNORED | set(rs.OFF_ONLY)
    assert listed(responses) == known


def test_completions_take_a_list_of_prompts_one_choice_each(url):
    r = client(url).completions.create(model="opts", prompt=["a b c", "d e", "f"],
                                       max_tokens=2, seed=5)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [
        (0, "a b", "length"), (1, "d e", "length"), (2, "f", "stop")]
    answers = [q for q in fakes.EchoEngine.REQUESTS[-6:] if q.stop == ("END",)]
    assert sorted(q.prompt or q.messages[-1]["content"] for q in answers) == [
        "a b c", "d e", "f"]
    assert all((q.max_tokens, q.seed) == (2, 5) for q in answers)
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    one = client(url).completions.create(model="opts", prompt=["a b c"], max_tokens=2)
    assert [c.text for c in one.choices] == ["a b"]


@pytest.mark.parametrize(("body", "code"), [
    ({"prompt": ["a", "b"], "stream": True}, "unsupported_parameter"),
    ({"prompt": [1, 2, 3]}, "unsupported_prompt"),
    ({"prompt": [[1, 2], [3]]}, "unsupported_prompt"),
    ({"prompt": ["a"] * 65}, "too_many_prompts"),
    ({"prompt": ["a", 3]}, "invalid_prompt"),
    ({"prompt": []}, "invalid_prompt"),
])
def test_bad_prompt_lists_are_a_400(url, body, code):
    r = httpx.post(url + "/v1/completions", json={"model": "opts", **body})
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert "'prompt'" in r.json()["error"]["message"] or "'stream'" in r.text


def test_one_failing_prompt_fails_the_request_and_the_server_goes_on(url):
    long = " ".join(["w"] * 5000)  # over the echo engine's 4096-token context
    r = httpx.post(url + "/v1/completions",
                   json={"model": "opts", "prompt": ["a b", long, "c"]})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    ok = client(url).completions.create(model="opts", prompt=["x y", "z"])
    assert [c.text for c in ok.choices] == ["x y", "z"]


def test_a_stream_missing_its_last_pieces_still_ends_with_the_whole_answer(url, monkeypatch):
    """On Ray the output can reach the server before the last streamed pieces (they come
    from different actors); the stream then sends the rest of the answer before its end."""
    real = fakes.EchoEngine.generate

    def first_piece_only(self, requests, on_token=None):
        seen: set[int] = set()

        def one(i, piece):
            if i not in seen:
                seen.add(i)
                return on_token(i, piece)
            return True

        return real(self, requests, one if on_token is not None else None)

    monkeypatch.setattr(fakes.EchoEngine, "generate", first_piece_only)
    chunks = list(client(url).chat.completions.create(
        model="opts", messages=[{"role": "user", "content": "a b c d"}], stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices
             and c.choices[0].delta.content]
    assert texts == ["a", " b c d"]
    assert chunks[-1].choices[0].finish_reason == "stop"
