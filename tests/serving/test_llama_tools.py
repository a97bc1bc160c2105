"""Client tools on the embedded llama.cpp model (SmolLM2-135M) through a live server and
the official ``openai`` client: a grammar holds ``required`` and named calls to the
schema, ``none`` answers in text, streamed deltas reassemble to the plain answer, and a
second server whose stage is on the ``openai`` backend passes the tools through."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.rag_fixtures import LLM
from tests.serving.server import running

pytestmark = pytest.mark.engine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def pipeline(name: str, engine: dict) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": engine})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=48)
     .sink())
    return p


@pytest.fixture(scope="module")
def urls():
    hub = ServingHub([PipelineService(pipeline("chat", LLM))])
    with running(hub) as url:
        remote = {"backend": "openai", "base_url": url + "/v1", "model": "chat",
                  "context_length": 2048}
        with running(ServingHub([PipelineService(pipeline("relay", remote))])) as front:
            yield url, front


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def schema_of(name: str) -> dict:
    return next(t for t in (WEATHER, ADD) if t["function"]["name"] == name)[
        "function"]["parameters"]


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "Add 2 and 3.",
                                      "Tell me a joke."])
def test_required_always_gives_a_valid_call(urls, question):
    r = client(urls[0]).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": question}], tools=[WEATHER, ADD],
        tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


def test_a_named_function_is_the_one_called(urls):
    r = client(urls[0]).chat.completions.create(
        model="chat", messages=ASK, tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("add"))


def test_none_answers_in_text(urls):
    r = client(urls[0]).chat.completions.create(model="chat", messages=ASK, tools=[WEATHER],
                                                tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streamed_deltas_reassemble_to_the_plain_answer(urls):
    c = client(urls[0])
    kw = {"model": "chat", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    plain = c.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [ch for ch in c.chat.completions.create(**kw, stream=True) if ch.choices]
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or ()]
    head, rest = deltas[0], deltas[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None
                        for d in rest)
    args = "".join(d.function.arguments for d in rest)
    assert json.loads(args) == json.loads(plain.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(ch.choices[0].delta.content in (None, "") for ch in chunks)
    # the client's own reassembly gives the same call
    with c.chat.completions.stream(**kw) as s:
        done = s.get_final_completion()
    got = done.choices[0].message.tool_calls[0]
    assert got.function.name == "get_weather"
    assert json.loads(got.function.arguments) == json.loads(plain.function.arguments)


def test_a_tool_result_in_the_history_is_answered(urls):
    c = client(urls[0])
    first = c.chat.completions.create(model="chat", messages=ASK, tools=[WEATHER],
                                      tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}]
    second = c.chat.completions.create(model="chat", messages=history, tools=[WEATHER],
                                       tool_choice="none")
    assert second.choices[0].message.content
    alone = c.chat.completions.create(model="chat", messages=ASK, tools=[WEATHER],
                                      tool_choice="none")
    # the call and its result reached the model: the prompt grew by at least their text
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 10


def test_the_openai_backend_passes_tools_through(urls):
    c = client(urls[1])  # relay -> (openai backend) -> chat on llama.cpp
    kw = {"model": "relay", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    r = c.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schema_of("get_weather"))
    with c.chat.completions.stream(**kw) as s:
        streamed = s.get_final_completion().choices[0].message.tool_calls[0]
    assert json.loads(streamed.function.arguments) == json.loads(call.function.arguments)
    text = c.chat.completions.create(model="relay", messages=ASK, tools=[WEATHER],
                                     tool_choice="none")
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
