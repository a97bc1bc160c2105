"""Structured output from the embedded SmolLM2-135M over HTTP with the official ``openai``
client: ``response_format`` json_schema answers (plain and streamed) that validate, a
pipeline whose stage declares the schema, and a schema llama.cpp cannot enforce (a 400,
or a compile error for a stage's schema)."""

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

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country",
                                                                      "population"],
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "country": {"type": "string", "maxLength": 30},
                       "population": {"type": "integer"},
                       "size": {"enum": ["small", "medium", "large"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                 "strict": True}}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]


def pipeline(name: str, **stage) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": LLM})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=96, **stage)
     .sink())
    return p


@pytest.fixture(scope="module")
def client():
    hub = ServingHub([PipelineService(pipeline("chat")),
                      PipelineService(pipeline("cities", json_schema=CITY))])
    with running(hub) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_a_json_schema_answer_validates(client):
    r = client.chat.completions.create(model="chat", messages=ASK, response_format=FORMAT)
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    assert r.choices[0].finish_reason == "stop"


def test_a_streamed_json_schema_answer_validates(client):
    stream = client.chat.completions.create(model="chat", messages=ASK, stream=True,
                                            response_format=FORMAT)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3  # token by token
    jsonschema.validate(json.loads("".join(pieces)), CITY)


def test_json_object_and_a_stage_declared_schema(client):
    r = client.chat.completions.create(model="chat", messages=[
        {"role": "user", "content": "Is Paris in France? Answer in JSON."}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="cities", messages=ASK)  # the YAML's schema
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_a_schema_llama_cpp_cannot_enforce_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "not": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="chat", messages=ASK, response_format=bad)
    assert e.value.body["message"].startswith(
        "response_format.json_schema.schema: llama.cpp cannot build a grammar from it "
        "(AssertionError: Unrecognized schema")
    assert e.value.body["code"] == "unsupported_schema"


def test_a_stage_schema_llama_cpp_cannot_enforce_fails_at_compile_time():
    with pytest.raises(tr.PlanError, match=r"generate: json_schema: response_format.json_schema"
                                           r".schema: llama.cpp cannot build a grammar from it"):
        tr.compile_pipeline(pipeline("bad", json_schema={"not": {"type": "string"}}))


def test_the_docs_example_runs(client, capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
              if "response_format" in b]
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    exec(code.replace("http://127.0.0.1:8000/v1", str(client.base_url)), {})  # noqa: S102
    assert capsys.readouterr().out.strip() == "Paris"
