"""tool_call with a scripted engine (JSON convention): a registered tool runs with validated
arguments and its result is used; an unregistered tool, invalid arguments, a tool that
raises and one that times out each give a clear error record while the rest go on."""

from __future__ import annotations

import json
import threading

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler import compile_pipeline
from tailrace.engines import BACKENDS, Generation
from tailrace.errors import PlanError
from tailrace.operators.registry import resolve
from tailrace.operators.tool_schema import ToolError, check_schema, parse_json_call, validate

RELEASE = threading.Event()  # lets the "hung" tool's thread finish when the test ends
CALLS: list = []


# -- tools ---------------------------------------------------------------------------
def get_weather(city: str, unit: str = "C") -> dict:
    CALLS.append(("get_weather", city, unit))
    if city == "Atlantis":
        raise ValueError("no weather station in Atlantis")
    return {"city": city, "temp": 17 if unit == "C" else 63, "sky": "sunny"}


def hang() -> str:
    RELEASE.wait(10)
    return "too late"


WEATHER = {"name": "get_weather", "fn": "tests.operators.test_tools.get_weather",
           "description": "current weather in a city",
           "schema": {"type": "object", "required": ["city"], "additionalProperties": False,
                      "properties": {"city": {"type": "string"},
                                     "unit": {"type": "string", "enum": ["C", "F"]}}}}
HANG = {"name": "hang", "fn": "tests.operators.test_tools.hang", "timeout_ms": 50}


# -- a scripted engine: replies are a function of the conversation ----------------------
def bot(messages: list[dict]) -> str:
    last = messages[-1]["content"]
    q = next(m["content"] for m in messages if m["role"] == "user")
    if q == "loop":  # calls a tool whatever it is told
        return json.dumps({"tool": "get_weather", "arguments": {"city": "Rome"}})
    if last.startswith("Result of get_weather: "):
        r = json.loads(last.split(": ", 1)[1])
        if "error" in r:
            return "Sorry, I could not get the weather."
        return f"It is {r['temp']} degrees and {r['sky']} in {r['city']}."
    call = {"weather in Paris?": ("get_weather", {"city": "Paris"}),
            "weather in Oslo in F?": ("get_weather", {"city": "Oslo", "unit": "F"}),
            "delete everything": ("rm_rf", {"path": "/"}),
            "weather in 5?": ("get_weather", {"city": 5}),
            "weather in Kelvin?": ("get_weather", {"city": "Oslo", "unit": "K"}),
            "weather in Atlantis?": ("get_weather", {"city": "Atlantis"}),
            "wait forever": ("hang", {})}.get(q)
    if call and not last.startswith("Result of"):
        return "```json\n" + json.dumps({"tool": call[0], "arguments": call[1]}) + "\n```"
    return "I can answer that without tools."


class ScriptedEngine:
    """A generation engine whose reply is ``reply(messages)``; it records every request."""

    chat = True
    context_length = 4096

    def __init__(self, path: str, reply: str, model: str = "scripted") -> None:
        self.reply, self.model, self.requests = resolve(reply), model, []

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, requests, on_token=None):
        self.requests.append(list(requests))
        return [Generation(self.reply(list(r.messages)), 3, 5, "stop") for r in requests]

    def close(self) -> None:
        pass


@pytest.fixture(params=[True, False], ids=["local-fused", "local-unfused"])
def run(request):
    """Local executors only: the scripted engine is registered in this process; a Ray host actor
    would not know the 'scripted' backend."""
    return lambda p, **kw: tr.run(p, runtime="local", fuse=request.param, **kw)


SCRIPTED = {"backend": "scripted", "path": __file__, "reply": "tests.operators.test_tools.bot"}


@pytest.fixture(autouse=True)
def scripted_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "scripted",
                        ("tests.operators.test_tools", "ScriptedEngine", ("generate",)))
    CALLS.clear()
    RELEASE.clear()
    yield
    RELEASE.set()


def agent(tools=(WEATHER, HANG), **kw) -> tr.Pipeline:
    p = tr.Pipeline("agent", engines={"llm": SCRIPTED})
    (p.source(fields=["q"])
     .apply("tool_call", id="agent", engine="llm", prompt="{q}", tools=list(tools), **kw)
     .sink())
    return p


def test_a_registered_tool_runs_with_validated_arguments_and_its_result_is_used(run):
    result = run(agent(), input=[{"q": "weather in Paris?"}, {"q": "weather in Oslo in F?"},
                                 {"q": "hello"}])
    assert not result.errors
    out = {r["q"]: r for r in result.outputs}
    assert out["weather in Paris?"]["answer"] == "It is 17 degrees and sunny in Paris."
    assert out["weather in Oslo in F?"]["answer"] == "It is 63 degrees and sunny in Oslo."
    assert out["weather in Paris?"]["tool_calls"] == [
        {"round": 1, "tool": "get_weather", "arguments": {"city": "Paris"},
         "result": {"city": "Paris", "temp": 17, "sky": "sunny"}}]
    assert out["hello"] == {"q": "hello", "answer": "I can answer that without tools.",
                            "tool_calls": []}
    assert sorted(CALLS) == [("get_weather", "Oslo", "F"), ("get_weather", "Paris", "C")]


def test_the_model_sees_the_tools_and_the_rounds_share_batched_calls(run):
    from tailrace.engines import open_engine

    engine = open_engine(SCRIPTED)
    engine.requests.clear()
    run(agent(), input=[{"q": "weather in Paris?"}, {"q": "hello"}])
    first = engine.requests[0]
    assert len(first) == 2  # both records generated in one engine call
    system = first[0].messages[0]["content"]
    assert first[0].messages[0]["role"] == "system"
    assert '- get_weather: current weather in a city arguments (JSON schema): {"type": ' \
        '"object"' in system and '{"tool": "NAME", "arguments": {...}}' in system
    assert [len(batch) for batch in engine.requests] == [2, 1]  # round 2: only Paris


@pytest.mark.parametrize("question,message", [
    ("delete everything", "round 1: the model called tool 'rm_rf', which is not registered "
                          "(registered: get_weather, hang)"),
    ("weather in 5?", "round 1: tool 'get_weather': invalid arguments: arguments.city: "
                      "expected string, got integer 5"),
    ("weather in Kelvin?", "round 1: tool 'get_weather': invalid arguments: arguments.unit: "
                           '"K" is not one of ["C", "F"]'),
    ("weather in Atlantis?", "round 1: tool 'get_weather' raised ValueError: no weather "
                             "station in Atlantis"),
    ("wait forever", "round 1: tool 'hang' timed out after 50 ms"),
    ("loop", "no answer after max_rounds=2 rounds of tool calls: the model still calls tools"),
])
def test_each_failure_is_a_clear_error_record_and_the_pipeline_goes_on(run, question,
                                                                        message):
    result = run(agent(max_rounds=2), input=[{"q": question}, {"q": "weather in Paris?"}])
    [err] = result.errors
    assert (err.stage, err.error, err.message) == ("agent", "ToolError", message)
    assert err.input == {"q": question}
    [ok] = result.outputs
    assert ok["answer"] == "It is 17 degrees and sunny in Paris."
    if question in ("weather in 5?", "delete everything"):
        assert ("get_weather", 5, "C") not in CALLS  # an invalid call never runs


def test_on_error_model_sends_the_failure_back_and_the_model_recovers(run):
    [rec] = run(agent(on_error="model"), input=[{"q": "weather in Atlantis?"}]).outputs
    assert rec["answer"] == "Sorry, I could not get the weather."
    assert rec["tool_calls"][0]["error"] == ("round 1: tool 'get_weather' raised ValueError: "
                                             "no weather station in Atlantis")


def test_yaml_tools_are_checked_at_compile_time():
    def plan(tools: str, extra: str = "") -> None:
        compile_pipeline(loads_pipeline(
            "version: 1\npipeline: p\nengines: {llm: {backend: llama_cpp, model: "
            "smollm2-135m-instruct}}\nstages:\n"
            f"  - {{id: a, op: tool_call, engine: llm, prompt: '{{q}}', tools: {tools}"
            f"{extra}}}\n", "p.yaml"))

    with pytest.raises(PlanError, match=r"p\.yaml:5: stage 'a': tools\[0\]\.fn: cannot "
                                        r"import module 'no\.such' "):
        plan("[{name: x, fn: no.such.fn}]")
    with pytest.raises(PlanError, match=r"tools\[0\]\.schema\.properties\.a: unsupported "
                                        "JSON-schema keyword\\(s\\) pattern"):
        plan("[{name: x, fn: json.dumps, schema: {type: object, properties: "
             "{a: {type: string, pattern: '^a'}}}}]")
    with pytest.raises(PlanError, match=r"tools\[1\]: tool 'x' is registered twice"):
        plan("[{name: x, fn: json.dumps}, {name: x, fn: json.loads}]")
    with pytest.raises(PlanError, match=r"tools\[0\]\.name must be an identifier"):
        plan("[{name: 'a b', fn: json.dumps}]")
    with pytest.raises(PlanError, match=r"tools\[0\]\.timeout_ms must be a positive number"):
        plan("[{name: x, fn: json.dumps, timeout_ms: 0}]")
    with pytest.raises(PlanError, match="format 'openai' needs an openai engine; engine 'llm' "
                                        "is llama_cpp"):
        plan("[{name: x, fn: json.dumps}]", ", format: openai")
    with pytest.raises(PlanError, match="'tools' is empty"):
        plan("[]")


def test_the_schema_validator():
    s = {"type": "object", "required": ["n"],
         "properties": {"n": {"type": "integer"}, "xs": {"type": "array",
                                                         "items": {"type": "number"}},
                        "flag": {"type": ["boolean", "null"]}}}
    validate({"n": 3, "xs": [1, 2.5], "flag": None}, s)
    validate({"n": 3.0}, s)  # 3.0 is an integer in JSON
    for value, msg in [({"n": True}, "arguments.n: expected integer, got boolean true"),
                       ({"n": 1.5}, "arguments.n: expected integer, got number 1.5"),
                       ({}, "arguments: missing required property 'n'"),
                       ({"n": 1, "xs": [1, "a"]}, r'arguments.xs\[1\]: expected number, got '
                                                  'string "a"'),
                       ({"n": 1, "flag": 0}, "arguments.flag: expected boolean or null, got "
                                             "integer 0")]:
        with pytest.raises(ToolError, match=msg):
            validate(value, s)
    with pytest.raises(ValueError, match=r"schema\.type: unknown type 'int'"):
        check_schema({"type": "int"})
    with pytest.raises(ValueError, match=r"schema\.required must be a list"):
        check_schema({"type": "object", "required": "n"})


def test_json_convention_parsing():
    assert parse_json_call('{"tool": "f", "arguments": {"x": [1]}} trailing') == ("f", {"x": [1]})
    assert parse_json_call('Sure! {"tool": "f"}') == ("f", {})
    assert parse_json_call('{"answer": 4}') is None
    assert parse_json_call('{"tool": "f", "arguments": {') is None
