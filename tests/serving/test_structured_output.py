"""``response_format`` through a live server over fake engines: the 400s for malformed
shapes and engines that cannot enforce it, the constraint reaching the engine, the
answer checked against the schema (plain and streamed), the ``openai`` backend passing
it on, and a YAML stage's ``json_schema``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.engines import Generation, GenerationRequest
from tailrace.errors import PlanError
from tailrace.serving import PipelineService, ServingHub
from tests.serving import fakes
from tests.serving.server import running

PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                 "strict": True}}


class JsonEcho(fakes.EchoEngine):
    """The echo engine, enforcing JSON the easy way: a constrained request's answer is
    its user text when that is JSON, else ``{"name": TEXT, "age": 7}``."""

    response_formats = frozenset({"json_object", "json_schema"})

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Any = None) -> list[Generation]:
        out = []
        for i, r in enumerate(requests):
            if r.response_format is None:
                out += fakes.EchoEngine.generate(self, [r])
                continue
            fakes.EchoEngine.REQUESTS.append(r)
            text = r.messages[-1]["content"] if r.messages else r.prompt or ""
            try:
                json.loads(text)
                answer = text
            except ValueError:
                answer = json.dumps({"name": text, "age": 7})
            pieces = [answer[j:j + 4] for j in range(0, len(answer), 4)][:r.max_tokens]
            for p in pieces if on_token is not None else ():
                on_token(i, p)
            out.append(Generation("".join(pieces), 3, len(pieces),
                                  "length" if len(pieces) == r.max_tokens else "stop"))
        return out


def json_spec() -> dict[str, Any]:
    return {"backend": "jsonecho", "model": "jsonecho", "path": __file__}


def answering(name: str, spec: dict, **stage: Any) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": spec})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=64, usage="usage", **stage)
     .sink())
    return p


@pytest.fixture
def jsonecho(monkeypatch):
    from tailrace.engines import models as registry

    fakes.register_echo(monkeypatch)
    monkeypatch.setitem(registry.BACKENDS, "jsonecho", (__name__, "JsonEcho", ("generate",)))
    fakes.EchoEngine.REQUESTS.clear()


@pytest.fixture
def url(jsonecho):
    hub = ServingHub([PipelineService(answering("echo", fakes.echo_spec())),
                      PipelineService(answering("json", json_spec())),
                      PipelineService(answering("frozen", json_spec(),
                                                frozen=["response_format"])),
                      PipelineService(answering("people", json_spec(), json_schema=PERSON))])
    with running(hub) as u:
        yield u


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(url: str, text: str = "Ada", model: str = "json", **kw: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": text}], **kw})


@pytest.mark.parametrize(("fmt", "message"), [
    ("json", "response_format must be an object like {\"type\": \"json_object\"}, got str"),
    ({"type": "xml"}, "response_format.type must be 'text', 'json_object' or 'json_schema', "
                      "got 'xml'"),
    ({"type": "json_object", "schema": {}}, "response_format: unknown field 'schema' for type "
                                            "'json_object'"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object like"),
    ({"type": "json_schema", "json_schema": {"name": "p"}},
     "response_format.json_schema.schema is required"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}},
     "response_format.json_schema.schema must be an object (a JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "person"}}},
     "response_format.json_schema.schema is not a valid JSON Schema: ['type']: 'person' is "
     "not valid under any of the given schemas"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
     "response_format.json_schema.strict must be true or false, got 'yes'"),
    ({"type": "json_schema", "json_schema": {"name": "", "schema": PERSON}},
     "response_format.json_schema.name must be a non-empty string"),
])
def test_a_malformed_response_format_is_a_400_naming_the_field(url, fmt, message):
    r = ask(url, response_format=fmt)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message), r.json()
    assert r.json()["error"]["code"] == "invalid_response_format"
    assert fakes.EchoEngine.REQUESTS == []


def test_an_engine_that_cannot_enforce_it_is_a_400_naming_response_format(url):
    for fmt in ({"type": "json_object"}, FORMAT):
        r = ask(url, model="echo", response_format=fmt)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(
            f"'response_format' ({fmt['type']}) cannot be enforced by pipeline 'echo'")
        assert r.json()["error"]["code"] == "unsupported_response_format"
    assert fakes.EchoEngine.REQUESTS == []
    assert ask(url, model="echo", response_format={"type": "text"}).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"model": "json", "prompt": "Ada",
                                                  "response_format": FORMAT})
    assert r.status_code == 400 and "'response_format' is not a field tailrace accepts on " \
        "this endpoint" in r.json()["error"]["message"]


def test_the_engines_that_cannot_enforce_it_refuse_if_called_anyway(jsonecho):
    from tailrace.errors import EngineError

    with pytest.raises(EngineError, match=r"engine 'echo' \(EchoEngine\) cannot enforce "
                                          r"response_format 'json_object'"):
        fakes.EchoEngine().generate([GenerationRequest(
            prompt="a", response_format={"type": "json_object"})])


def test_the_constraint_reaches_the_engine_and_the_answer_validates(url):
    c = client(url)
    r = c.chat.completions.create(model="json", messages=[{"role": "user", "content": "Ada"}],
                                  response_format=FORMAT)
    assert json.loads(r.choices[0].message.content) == {"name": "Ada", "age": 7}
    assert fakes.EchoEngine.REQUESTS[-1].response_format == FORMAT
    stream = c.chat.completions.create(
        model="json", messages=[{"role": "user", "content": "Bob"}], stream=True,
        response_format={"type": "json_object"})
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert json.loads("".join(pieces)) == {"name": "Bob", "age": 7}
    assert fakes.EchoEngine.REQUESTS[-1].response_format == {"type": "json_object"}


def test_an_answer_that_fails_the_schema_is_an_error_plain_and_streamed(url):
    bad = '{"name": "Ada", "age": "old"}'
    r = ask(url, bad, response_format=FORMAT)
    assert r.status_code == 500, r.text
    assert r.json()["error"] == {
        "message": "stage 'answer': StructuredOutputError: the answer does not match the "
                   "json_schema 'person' at age: 'old' is not of type 'integer'",
        "type": "api_error", "code": "StructuredOutputError", "stage": "answer",
        "attempts": 1}
    r = ask(url, "[1, 2]", response_format={"type": "json_object"})
    assert "the answer is JSON but not an object" in r.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="does not match the json_schema 'person'"):
        list(client(url).chat.completions.create(
            model="json", messages=[{"role": "user", "content": bad}], stream=True,
            response_format=FORMAT))


def test_an_answer_cut_by_max_tokens_says_to_raise_it(url):
    r = ask(url, "Ada", response_format=FORMAT, max_tokens=3)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == (
        "stage 'answer': StructuredOutputError: the answer was cut at max_tokens=3 before "
        "its JSON was complete; raise max_tokens")


def test_an_answer_cut_at_the_stages_ceiling_says_where_to_raise_it(url):
    r = ask(url, "A" * 300, response_format=FORMAT)  # 4 characters a piece: over 64 pieces
    assert r.status_code == 500
    assert r.json()["error"]["message"].endswith(
        "cut at max_tokens=64 before its JSON was complete; raise max_tokens (this stage's "
        "max_tokens, 64, is the ceiling: raise it in the pipeline)")


def test_a_pipeline_may_freeze_response_format(url):
    r = ask(url, model="frozen", response_format=FORMAT)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("'response_format' is fixed by pipeline "
                                                   "'frozen'")


def test_the_openai_backend_passes_response_format_on(url):
    """A tailrace server over the JSON echo engine is the recording OpenAI server."""
    from tailrace.engines.openai import OpenAIEngine

    eng = OpenAIEngine(url + "/v1", "json", retries=0)
    try:
        [g] = eng.generate([GenerationRequest(
            messages=({"role": "user", "content": "Cy"},), max_tokens=32,
            response_format=FORMAT)])
        with pytest.raises(Exception, match="response_format is passed on with chat "
                                            "requests only"):
            eng.generate([GenerationRequest(prompt="Cy", response_format=FORMAT)])
    finally:
        eng.close()
    assert fakes.EchoEngine.REQUESTS[-1].response_format == FORMAT
    assert json.loads(g.text) == {"name": "Cy", "age": 7}


def test_a_yaml_stage_declares_a_json_schema(jsonecho, tmp_path):
    path = tmp_path / "people.yaml"
    path.write_text(f"""
version: 1
pipeline: people
engines:
  llm: {json.dumps(json_spec())}
source: {{fields: [question]}}
stages:
  - {{id: answer, op: generate, engine: llm, input: question, output: person,
     max_tokens: 64, json_schema: {json.dumps(PERSON)}}}
""")
    out = tr.run(tr.Pipeline.from_yaml(str(path)), input=[{"question": "Ada"},
                                                           {"question": '{"name": 1, "age": 2}'}])
    assert [json.loads(r["person"]) for r in out.outputs] == [{"name": "Ada", "age": 7}]
    [err] = out.errors
    assert err.error == "StructuredOutputError" and "at name: 1 is not of type 'string'" \
        in err.message
    assert fakes.EchoEngine.REQUESTS[0].response_format == {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.mark.parametrize(("engine", "schema", "message"), [
    ("json", {"type": 5}, "generate: json_schema is not a valid JSON Schema: ['type']: 5 is "
                          "not valid"),
    ("echo", PERSON, "generate: json_schema needs an engine that enforces it (llama_cpp or "
                     "openai); engine 'llm' (backend 'echo') cannot"),
])
def test_a_yaml_json_schema_is_checked_at_compile_time(jsonecho, engine, schema, message):
    spec = json_spec() if engine == "json" else fakes.echo_spec()
    with pytest.raises(PlanError, match=None) as e:
        tr.compile_pipeline(answering("p", spec, json_schema=schema))
    assert message in str(e.value)


def test_a_stage_schema_applies_unless_the_request_brings_its_own(url):
    stage = {"type": "json_schema", "json_schema": {"name": "answer", "schema": PERSON}}
    for fmt in (None, {"type": "text"}):
        r = ask(url, model="people", **({"response_format": fmt} if fmt else {}))
        assert r.status_code == 200 and json.loads(
            r.json()["choices"][0]["message"]["content"]) == {"name": "Ada", "age": 7}
        assert fakes.EchoEngine.REQUESTS[-1].response_format == stage
    assert ask(url, model="people", response_format={"type": "json_object"}).status_code == 200
    assert fakes.EchoEngine.REQUESTS[-1].response_format == {"type": "json_object"}


def test_the_latency_model_server_refuses_response_format():
    """The benchmark's OpenAI-compatible latency server writes no real text: it says so
    (a 400) rather than answering unconstrained; the openai engine reports it."""
    import importlib.util
    import sys
    from pathlib import Path

    from tailrace.engines.openai import OpenAIEngine
    from tailrace.errors import EngineError

    path = Path(__file__).resolve().parents[2] / "bench" / "latency_server.py"
    ls = sys.modules.get("latency_server")
    if ls is None:
        spec = importlib.util.spec_from_file_location("latency_server", path)
        ls = importlib.util.module_from_spec(spec)
        sys.modules["latency_server"] = ls
        spec.loader.exec_module(ls)
    with ls.start_server() as srv:
        eng = OpenAIEngine(srv.url, "m", retries=0)
        try:
            with pytest.raises(EngineError, match="'response_format' cannot be enforced: "
                                                  "this latency-model server"):
                eng.generate([GenerationRequest(messages=({"role": "user", "content": "x"},),
                                                max_tokens=2, response_format=FORMAT)])
            [g] = eng.generate([GenerationRequest(
                messages=({"role": "user", "content": "x"},), max_tokens=2)])
        finally:
            eng.close()
    assert g.completion_tokens == 2


def test_validating_an_answer_never_fetches_a_schema_ref():
    """A client's schema with a ``$ref`` URL must not make the server fetch it."""
    import http.server
    import threading

    from tailrace.engines.structured import check_answer, check_response_format

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server hook
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        fmt = check_response_format({"type": "json_schema", "json_schema": {"name": "r", "schema": {
            "$ref": f"http://127.0.0.1:{srv.server_port}/s.json"}}})
        why = check_answer("{}", fmt, "stop", 8)
    finally:
        srv.shutdown()
        srv.server_close()
    assert why.startswith("the answer could not be checked against the json_schema 'r': ")
    assert "Unresolvable" in why and hits == []
