"""tool_call in OpenAI function-calling format: against a scripted loopback server (wire
format, tool messages, invalid JSON arguments) and end to end against llama-cpp-python's
real OpenAI server running SmolLM2-135M with its ``chatml-function-calling`` handler."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import tailrace as tr

pytest.importorskip("openai")

WEATHER = {"name": "get_weather", "fn": "tests.operators.test_tools.get_weather",
           "description": "Get the current weather in a city",
           "schema": {"type": "object", "required": ["city"],
                      "properties": {"city": {"type": "string"}}}}


def reply(body: dict) -> dict:
    """The scripted server's answer to one chat request."""
    msgs = body["messages"]
    if msgs[-1]["role"] == "tool":
        data = json.loads(msgs[-1]["content"])
        text = f"{data['city']}: {data['temp']} C" if "city" in data else "the tool failed"
        message = {"role": "assistant", "content": text}
    elif "tools" in body:
        args = '{"city": "Paris"' if "broken" in msgs[-1]["content"] else '{"city": "Paris"}'
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]}
    else:
        message = {"role": "assistant", "content": "no tools offered"}
    return {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


@pytest.fixture
def server():
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            data = json.dumps(reply(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", seen
    srv.shutdown()
    srv.server_close()


def agent(base_url: str, **kw) -> tr.Pipeline:
    p = tr.Pipeline("agent", engines={"llm": {"backend": "openai", "base_url": base_url,
                                              "model": "m", "retries": 0}})
    (p.source(fields=["q"])
     .apply("tool_call", id="agent", engine="llm", prompt="{q}", tools=[WEATHER],
            system="You are helpful.", **kw)
     .sink())
    return p


def test_openai_function_calling_wire_format(server):
    url, seen = server
    result = tr.run(agent(url), input=[{"q": "Weather in Paris?"}])
    assert not result.errors
    [rec] = result.outputs
    assert rec["answer"] == "Paris: 17 C"
    assert rec["tool_calls"] == [{"round": 1, "tool": "get_weather",
                                  "arguments": {"city": "Paris"},
                                  "result": {"city": "Paris", "temp": 17, "sky": "sunny"}}]
    first, second = seen
    assert first["tool_choice"] == "auto"
    assert first["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": WEATHER["schema"]}}]
    assert first["messages"] == [{"role": "system", "content": "You are helpful."},
                                 {"role": "user", "content": "Weather in Paris?"}]
    assert second["messages"][2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_7", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert second["messages"][3] == {"role": "tool", "tool_call_id": "call_7", "content":
                                     '{"city": "Paris", "temp": 17, "sky": "sunny"}'}


def test_invalid_json_arguments_and_the_last_round_without_tools(server):
    url, seen = server
    result = tr.run(agent(url), input=[{"q": "broken call"}])
    [err] = result.errors
    assert err.message.startswith("round 1: tool 'get_weather': invalid arguments: not valid "
                                  "JSON (")
    seen.clear()
    [rec] = tr.run(agent(url, max_rounds=1, on_error="model"),
                   input=[{"q": "broken call"}]).outputs
    assert rec["answer"] == "the tool failed"
    assert rec["tool_calls"][0]["error"].startswith("round 1: tool 'get_weather': invalid")
    assert "tools" in seen[0] and "tools" not in seen[1]  # round 2 is the last: no tools


def test_an_unreachable_server_is_an_error_record():
    result = tr.run(agent("http://127.0.0.1:9/v1"), input=[{"q": "hi"}])
    [err] = result.errors
    assert err.error == "EngineError"
    assert err.message.startswith("openai engine at http://127.0.0.1:9/v1 (model 'm'): "
                                  "APIConnectionError")


@pytest.mark.engine
@pytest.mark.slow
def test_real_smollm2_server_calls_the_tool_and_answers():
    """llama-cpp-python's server with --chat_format chatml-function-calling constrains the
    tool call with a grammar; SmolLM2-135M decides to call get_weather for Paris itself."""
    for module in ("llama_cpp", "fastapi"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install 'llama-cpp-python[server]')")
    from tailrace.engines import model_info, model_path
    from tests.engines.llama_server import llama_server

    gguf = model_path(model_info("smollm2-135m-instruct", "llama_cpp"))
    with llama_server(gguf, "--model_alias", "smol", "--chat_format",
                      "chatml-function-calling", n_ctx=2048, n_threads=2) as srv:
        p = tr.Pipeline("agent", engines={"llm": {"backend": "openai", "base_url":
                                                  srv.base_url, "model": "smol"}})
        (p.source(fields=["q"])
         .apply("tool_call", id="agent", engine="llm", prompt="{q}", tools=[WEATHER],
                system="You are a helpful assistant with tools.", max_rounds=1,
                max_tokens=48)
         .sink())
        result = tr.run(p, input=[{"q": "What is the weather in Paris?"}])
    assert not result.errors, result.errors
    [rec] = result.outputs
    assert rec["tool_calls"], rec
    call = rec["tool_calls"][0]
    assert (call["round"], call["tool"]) == (1, "get_weather")
    assert call["arguments"]["city"].strip().lower().endswith("paris")
    assert call["result"]["sky"] == "sunny"  # the registered tool really ran
    assert isinstance(rec["answer"], str) and rec["answer"]
    print(f"\nSmolLM2-135M via llama-cpp-python's server: {rec}")
