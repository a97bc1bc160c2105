"""``tailrace serve --mcp``: the served pipelines as MCP tools at ``/mcp``, seen through the
official MCP client (streamable HTTP). A real ``tailrace serve`` process with API keys:
the tools are listed and called, a key is needed and a tenant's key makes the call that
tenant's; an in-process server shows a caller who leaves cancels the work; without
``--mcp`` there is no ``/mcp``; ``--runtime ray`` refuses ``--mcp``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

import tailrace as tr
from tailrace.cli.main import main
from tailrace.serving import PipelineService, ServingHub, create_app
from tests.conftest import wait_until
from tests.serving import fakes
from tests.serving.conftest import ROOT
from tests.serving.server import running

KEY, ADMIN = "sk-alpha-000000", "sk-admin-11111"
#: ``tailrace serve`` with the echo engine registered (a process of its own knows no fakes)
LAUNCH = ("import sys; from tailrace.engines import models; models.BACKENDS['echo'] = "
          "('tests.serving.fakes', 'EchoEngine', ('generate',)); "
          "from tailrace.cli.main import main; sys.exit(main(sys.argv[1:]))")
ECHO = f"""\
version: 1
pipeline: echo
description: Says the question back after the name of the tenant asking.
source: {{fields: [question, user]}}
serve: {{tenant: user}}
engines:
  llm: {{backend: echo, model: echo, path: {fakes.__file__}}}
stages:
  - {{id: answer, op: generate, engine: llm, prompt: "{{user}} asked: {{question}}",
     max_tokens: 50}}
"""
LOUD = """\
version: 1
pipeline: loud
source: {fields: [text]}
stages:
  - {id: up, op: map, fn: tests.fixtures.ops.upper, input: text, output: loud}
"""


def mcp_session(url: str, key: str | None, work):
    """``await work(session)`` on an initialized MCP client session to ``url``."""
    async def go():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx2.AsyncClient(headers=headers) as http, \
                streamable_http_client(url, http_client=http) as (read, write), \
                ClientSession(read, write) as session:
            await session.initialize()
            return await work(session)

    return asyncio.run(go())


def leaf(e: BaseException) -> BaseException:
    """The first exception inside (anyio's) exception groups."""
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def wire(result) -> dict:
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A ``tailrace serve --mcp`` process with a tenant key and an admin key: its /mcp URL."""
    d = tmp_path_factory.mktemp("mcp")
    (d / "echo.yaml").write_text(ECHO)
    (d / "loud.yaml").write_text(LOUD)
    (d / "keys.yaml").write_text(f"{KEY}: {{tenant: alpha}}\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "serve", str(d / "echo.yaml"), str(d / "loud.yaml"),
         "--port", "0", "--mcp", "--keys-file", str(d / "keys.yaml"),
         "--api-key-env", "TAILRACE_TEST_KEY"],
        cwd=ROOT, env={**os.environ, "TAILRACE_TEST_KEY": ADMIN}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        assert line.endswith("; MCP tools at /mcp)\n"), line
        root = line.split(" on ")[1].split()[0].removesuffix("/v1")
        wait_until(lambda: httpx.get(root + "/readyz").status_code == 200, 30, "ready")
        yield root + "/mcp"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and err.strip().endswith("tailrace: stopped (interrupted)")


def test_pipelines_are_listed_as_tools_and_a_call_answers(served):
    async def work(s):
        tools = {t["name"]: t for t in wire(await s.list_tools())["tools"]}
        answers = [wire(await s.call_tool("echo", {"question": "hello there"})),
                   wire(await s.call_tool("loud", {"text": "hey"})),
                   wire(await s.call_tool("echo", {"topic": "x"}))]
        return tools, answers

    tools, (echo, loud, bad) = mcp_session(served, KEY, work)
    assert tools["echo"] == {
        "name": "echo",
        "description": "Says the question back after the name of the tenant asking.",
        "inputSchema": {"type": "object", "required": ["question"],
                        "additionalProperties": False, "properties": {"question": {
                            "type": "string",
                            "description": "the question the pipeline answers"}}}}
    assert tools["loud"]["description"] == ("Runs the tailrace pipeline 'loud' on one record "
                                            "(fields: text) and returns its output record "
                                            "as JSON.")
    assert tools["loud"]["inputSchema"]["required"] == ["text"]
    assert echo["content"] == [{"type": "text", "text": "alpha asked: hello there"}]
    assert not echo.get("isError")
    assert json.loads(loud["content"][0]["text"]) == {"text": "hey", "loud": "HEY"}
    assert bad["isError"] and bad["content"][0]["text"] == (
        "tool 'echo': invalid arguments: arguments: missing required property 'question'")


def test_the_key_is_required_and_a_call_runs_as_its_tenant(served):
    for headers in ({}, {"Authorization": "Bearer sk-wrong-000000"}):
        r = httpx.post(served, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                       headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["data"]["status"] == 401
    with pytest.raises(BaseException) as refused:  # the official client says why
        mcp_session(served, None, lambda s: s.list_tools())
    assert str(leaf(refused.value)) == ("missing API key: send the header 'Authorization: "
                                        "Bearer KEY'")

    async def admin(s):  # the server's own key: no tenant, so the tenant field stays unset
        return (wire(await s.call_tool("loud", {"text": "ok"})),
                wire(await s.call_tool("echo", {"question": "who?"})))

    loud, echo = mcp_session(served, ADMIN, admin)
    assert json.loads(loud["content"][0]["text"]) == {"text": "ok", "loud": "OK"}
    assert echo["isError"] and "needs field 'user'" in echo["content"][0]["text"]


@contextlib.contextmanager
def serving_mcp(hub: ServingHub) -> Iterator[str]:
    """``hub`` served with ``/mcp`` on a free loopback port, in a thread: its /mcp URL."""
    with running(hub, drain_s=5.0, mcp=True) as url:
        yield url + "/mcp"


def test_a_caller_that_leaves_cancels_its_work(monkeypatch):
    fakes.register_echo(monkeypatch)
    p = tr.Pipeline("long", engines={"llm": fakes.echo_spec(delay=0.02, repeat=400)})
    (p.source(fields=["question"])
     .apply("generate", engine="llm", input="question", output="answer", max_tokens=500)
     .sink())
    with serving_mcp(ServingHub([PipelineService(p)])) as url:
        fakes.EchoEngine.LOG.clear()
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "long", "arguments": {"question": "w"}}}
        headers = {"Accept": "application/json, text/event-stream",
                   "MCP-Protocol-Version": "2025-11-25"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=call, headers=headers, timeout=0.3)
        wait_until(lambda: fakes.EchoEngine.LOG, 20, "the generation ended")
    [g] = fakes.EchoEngine.LOG
    assert g.finish_reason == "cancelled" and g.completion_tokens < 400  # 8 s of them


def test_without_mcp_there_is_no_mcp_endpoint():
    from starlette.testclient import TestClient

    app = create_app(ServingHub([PipelineService(fakes.shout_pipeline())]))
    assert TestClient(app).post("/mcp", json={}).status_code == 404


def test_mcp_with_the_ray_runtime_is_refused(tmp_path, capsys):
    path = tmp_path / "loud.yaml"
    path.write_text(LOUD)
    t0 = time.monotonic()
    assert main(["serve", str(path), "--mcp", "--runtime", "ray"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --mcp is not available with --runtime ray: the Ray Serve ingress "
        "replicas do not mount /mcp; serve with --runtime local for MCP")
    assert time.monotonic() - t0 < 5  # refused before Ray starts
