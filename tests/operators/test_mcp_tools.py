"""tool_call with MCP servers: the test server (tests/fixtures/mcp_server.py, the official
SDK's MCPServer) over stdio and streamable HTTP, a scripted model (JSON convention). Its
tools are listed and called, their results used; invalid arguments never reach the server
(its call log says so); a timeout, an error result and a crashed server are error records
like a registered tool's; tenants see only their tools; bad YAML fails at compile time."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler import compile_pipeline
from tailrace.engines import BACKENDS, open_engine
from tailrace.errors import PlanError
from tailrace.operators.mcp_tools import open_connections
from tailrace.operators.tool_schema import ToolError
from tailrace.request import REQUEST, Request
from tests.conftest import free_port

ROOT = str(Path(__file__).resolve().parents[2])
SERVER = [sys.executable, "-m", "tests.fixtures.mcp_server"]
MODEL = {"backend": "mcp-scripted", "path": __file__,
         "reply": "tests.operators.test_mcp_tools.bot"}
ASK = {"add 2 and 3": ("add", {"a": 2, "b": 3}),
       "add two and 3": ("add", {"a": "two", "b": 3}),
       "weather in Paris": ("weather", {"city": "Paris"}),
       "echo hi": ("m_echo", {"text": "hi"}),
       "add via prefix": ("m_add", {"a": 1, "b": 1}),
       "explode": ("boom", {"message": "kaput"}),
       "wait": ("slow", {"seconds": 30}),
       "crash": ("crash", {}),
       "who": ("acme_whoami", {})}


def bot(messages: list[dict]) -> str:
    """Calls the tool ``ASK`` names for the question, then answers with its result."""
    last = messages[-1]["content"]
    if last.startswith("Result of "):
        return "Tool said: " + last.split(": ", 1)[1]
    q = next(m["content"] for m in messages if m["role"] == "user")
    name, args = ASK[q]
    return json.dumps({"tool": name, "arguments": args})


@pytest.fixture(autouse=True)
def scripted_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "mcp-scripted",
                        ("tests.operators.test_tools", "ScriptedEngine", ("generate",)))
    yield
    assert open_connections() == []  # every run released its servers, failed or not


@pytest.fixture
def log(tmp_path):
    """The test server's call log: ``calls()`` reads the tools it ran."""
    path = tmp_path / "calls.jsonl"

    class Log:
        env = {"MCP_TEST_LOG": str(path)}

        @staticmethod
        def calls() -> list:
            if not path.exists():
                return []
            return [json.loads(line) for line in path.read_text().splitlines()]

    return Log


def agent(*servers: dict, tools: list | None = None, **kw) -> tr.Pipeline:
    p = tr.Pipeline("mcp-agent", engines={"llm": MODEL})
    params = {"mcp": list(servers), **({"tools": tools} if tools else {}), **kw}
    (p.source(fields=["q"])
     .apply("tool_call", id="agent", engine="llm", prompt="{q}", max_batch=1, **params)
     .sink())
    return p


def stdio(log, **kw) -> dict:
    return {"name": "test", "command": SERVER, "cwd": ROOT, "env": log.env, **kw}


def run(p: tr.Pipeline, *questions: str, tenant: str | None = None):
    records = [{"q": q} if tenant is None else {"q": q, REQUEST: Request(tenant=tenant)}
               for q in questions]
    return tr.run(p, input=records)


def test_tools_are_listed_called_and_their_results_used(log):
    engine = open_engine(MODEL)
    engine.requests.clear()
    result = run(agent(stdio(log)), "add 2 and 3", "weather in Paris")
    assert not result.errors
    out = {r["q"]: r for r in result.outputs}
    assert out["add 2 and 3"]["answer"] == 'Tool said: {"result": 5}'
    assert out["add 2 and 3"]["tool_calls"] == [
        {"round": 1, "tool": "add", "arguments": {"a": 2, "b": 3}, "result": {"result": 5}}]
    assert out["weather in Paris"]["answer"] == \
        'Tool said: {"city": "Paris", "temp": 17, "sky": "sunny"}'
    system = engine.requests[0][0].messages[0]["content"]
    assert "- add: add two integers arguments (JSON schema): {" in system
    assert "- slow: sleeps, then answers" in system
    assert log.calls() == [{"tool": "add", "arguments": {"a": 2, "b": 3}},
                           {"tool": "weather", "arguments": {"city": "Paris"}}]


def test_a_prefix_and_a_tool_subset(log):
    result = run(agent(stdio(log, prefix="m_", tools=["add", "echo"])),
                 "add via prefix", "echo hi", "add 2 and 3")
    out = {r["q"]: r["answer"] for r in result.outputs}
    assert out == {"add via prefix": 'Tool said: {"result": 2}',
                   "echo hi": 'Tool said: {"result": "hi"}'}
    [err] = result.errors
    assert err.message == ("round 1: the model called tool 'add', which is not registered "
                           "(registered: m_add, m_echo)")


@pytest.mark.parametrize("question,message", [
    ("add two and 3", "round 1: tool 'add': invalid arguments: arguments.a: expected "
                      'integer, got string "two"'),
    ("explode", "round 1: tool 'boom' returned an error (MCP server 'test'): Error "
                "executing tool boom"),
    ("wait", "round 1: tool 'slow' timed out after 300 ms"),
])
def test_each_failure_is_an_error_record_and_the_rest_go_on(log, question, message):
    # two entries, one server process: 'slow' has a timeout of its own
    p = agent(stdio(log, tools=["add", "boom"]),
              stdio(log, name="slowpoke", tools=["slow"], timeout_ms=300))
    result = run(p, question, "add 2 and 3")
    [err] = result.errors
    assert (err.stage, err.error, err.message) == ("agent", "ToolError", message)
    [ok] = result.outputs
    assert ok["answer"] == 'Tool said: {"result": 5}'
    called = [c["tool"] for c in log.calls()]
    if question == "add two and 3":  # refused before the call: the server never saw it
        assert called == ["add"] and log.calls()[0]["arguments"] == {"a": 2, "b": 3}


def test_on_error_model_sends_the_error_result_back(log):
    [rec] = run(agent(stdio(log), on_error="model"), "explode").outputs
    assert rec["answer"] == ('Tool said: {"error": "round 1: tool \'boom\' returned an error '
                             '(MCP server \'test\'): Error executing tool boom"}')


def test_a_crashed_server_fails_its_call_and_the_next_call_starts_it_again(log):
    result = run(agent(stdio(log, timeout_ms=30_000)), "crash", "add 2 and 3")
    [err] = result.errors
    assert err.message == ("round 1: tool 'crash' failed (MCP server 'test'): the "
                           "connection closed (did the server exit?)")
    [ok] = result.outputs
    assert ok["answer"] == 'Tool said: {"result": 5}'
    assert [c["tool"] for c in log.calls()] == ["crash", "add"]


def test_a_tenants_server_is_seen_and_called_by_its_tenants_only(log):
    engine = open_engine(MODEL)
    p = agent(stdio(log, tools=["add"]),
              stdio(log, name="acme", prefix="acme_", tools=["whoami"], tenants=["acme"]))
    engine.requests.clear()
    [ok] = run(p, "who", tenant="acme").outputs
    assert ok["answer"] == 'Tool said: {"result": "test"}'
    assert "- acme_whoami: " in engine.requests[0][0].messages[0]["content"]
    for tenant in ("other", None):
        engine.requests.clear()
        result = run(p, "who", tenant=tenant)
        [err] = result.errors
        assert err.message == ("round 1: the model called tool 'acme_whoami', which is not "
                               "registered (registered: add)")
        system = engine.requests[0][0].messages[0]["content"]
        assert "- add: " in system and "acme_whoami" not in system
    assert [c["tool"] for c in log.calls()] == ["whoami"]  # acme's call only


def test_a_name_used_twice_fails_when_the_stage_starts(log):
    mine = {"name": "add", "fn": "json.dumps"}
    with pytest.raises(ToolError, match=r"tool name 'add' is used twice: by the registered "
                                        r"tool 'add' \(fn json.dumps\) and by the tool 'add' "
                                        r"of MCP server 'test'; give the server a prefix"):
        run(agent(stdio(log), tools=[mine]), "add 2 and 3")
    with pytest.raises(ToolError, match="MCP server 'test' has no tool 'nope' "):
        run(agent(stdio(log, tools=["add", "nope"])), "add 2 and 3")


def test_a_server_that_does_not_start_is_a_clear_error():
    exits = {"name": "dud", "command": [sys.executable, "-c", "pass"],
             "connect_timeout_ms": 5000}
    with pytest.raises(ToolError, match=r"MCP server 'dud' \(.* -c pass\) failed to start: "
                                        "MCPError: Connection closed"):
        run(agent(exits), "add 2 and 3")
    mute = {"name": "mute", "command": [sys.executable, "-c", "import sys; sys.stdin.read()"],
            "connect_timeout_ms": 300}  # never answers
    with pytest.raises(ToolError, match=r"MCP server 'mute' \(.*\) did not list its tools "
                                        r"within 300 ms \(connect_timeout_ms\)"):
        run(agent(mute), "add 2 and 3")


def _compile(mcp: str) -> None:
    compile_pipeline(loads_pipeline(
        "version: 1\npipeline: p\nengines: {llm: {backend: llama_cpp, model: "
        "smollm2-135m-instruct}}\nstages:\n"
        f"  - {{id: a, op: tool_call, engine: llm, prompt: '{{q}}', mcp: {mcp}}}\n", "p.yaml"))


@pytest.mark.parametrize("mcp,message", [
    ("[{name: s, comand: [python]}]",
     r"p\.yaml:5: stage 'a': mcp\[0\]: unknown key 'comand'; did you mean 'command'\? "
     r"\(allowed: name, command, env, cwd, url, "),
    ("[{name: s, command: [no-such-mcp-server-here]}]",
     r"mcp\[0\] \('s'\)\.command: 'no-such-mcp-server-here' is not on PATH; give the "
     r"server's executable"),
    ("[{name: s, command: [python], url: 'http://x/mcp'}]",
     r"mcp\[0\] \('s'\): give exactly one of command \(stdio\) or url"),
    ("[{name: s, url: 'http://x/mcp', env: {A: b}}]",
     r"mcp\[0\] \('s'\): 'env' is for a command \(stdio\) server"),
    ("[{name: s, url: 'http://x/mcp', tenants: acme}]",
     r"mcp\[0\] \('s'\)\.tenants must be a list of tenant names, got 'acme'"),
    ("[{name: s, url: 'http://x/mcp', timeout_ms: 0}]",
     r"mcp\[0\] \('s'\)\.timeout_ms must be a positive number"),
    ("[{name: s, url: 'ftp://x'}]", r"mcp\[0\] \('s'\)\.url must be an http:// or https://"),
    ("[{name: s, url: 'http://x/mcp'}, {name: s, url: 'http://y/mcp'}]",
     r"mcp\[1\]: server 's' is listed twice"),
    ("[]", "'mcp' must be a non-empty list of servers"),
])
def test_bad_mcp_yaml_fails_at_compile_time_in_one_line(mcp, message):
    with pytest.raises(PlanError, match=message) as e:
        _compile(mcp)
    assert "\n" not in str(e.value)


def test_streamable_http_transport(log, tmp_path):
    port = free_port()
    proc = subprocess.Popen([*SERVER, "--http", str(port)], cwd=ROOT, text=True,
                            env={**os.environ, **log.env},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert select.select([proc.stdout], [], [], 30)[0], "the HTTP server did not start"
        assert proc.stdout.readline().strip() == "listening"
        server = {"name": "web", "url": f"http://127.0.0.1:{port}/mcp",
                  "headers": {"X-Test": "1"}, "tools": ["add", "weather"]}
        result = run(agent(server), "add 2 and 3", "weather in Paris")
        assert not result.errors
        assert sorted(r["answer"] for r in result.outputs) == [
            'Tool said: {"city": "Paris", "temp": 17, "sky": "sunny"}',
            'Tool said: {"result": 5}']
        assert [c["tool"] for c in log.calls()] == ["add", "weather"]
    finally:
        proc.terminate()
        proc.wait(10)
