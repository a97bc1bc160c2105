"""``/v1/responses`` (the OpenAI Responses API) over a real uvicorn server with the
official ``openai`` client: text answers, instructions and input items reaching the
model, a full function-tool loop (call, output with ``previous_response_id``, answer),
streamed events field by field against what the client's stream helpers accumulate,
every 400, 404s (unknown, deleted, another tenant's), ``store: false``, expiry with an
injected clock, and a client that leaves mid-stream giving its admission ticket back.
Fake engines (``fakes.EchoEngine``, ``fakes.ToolEngine``); the real SmolLM2 tests are
marked ``engine``."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

import tailrace as tr
from tailrace.cli.main import main
from tailrace.control import AdmissionGate, make_policy
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.responses_store import Retention
from tailrace.serving.tenants import Tenant, TenantKeys
from tailrace.stores.memory import check_store_spec, open_store
from tests.serving import fakes
from tests.serving.server import running

ALPHA, BETA, ADMIN = "sk-alpha-0000000", "sk-beta-11111111", "sk-admin-2222222"
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TIME = {"type": "function", "name": "local_time",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def explode(record: dict) -> dict:
    raise ValueError("kaboom")


def generate(name: str, backend: str = "echo", after=None, max_tokens: int = 8,
             **engine) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": {"backend": backend, "model": backend,
                                           "path": fakes.__file__, **engine}})
    s = (p.source(fields=["question"])
         .apply("generate", id="answer", engine="llm", input="question", output="answer",
                max_tokens=max_tokens))
    if after is not None:
        s = s.map(after, id="after")
    s.sink()
    return p


def idle(gate: AdmissionGate) -> bool:
    st = gate.statistics()
    return st.in_flight == 0 and st.queued == 0


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"{what}: not reached within {timeout_s:g} s"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module: echo, tools (and slower ones), a long echo, one whose stage
    after the answer fails and one that cannot chat, behind one fcfs gate and tenant
    keys (alpha, beta) plus the operator's key."""
    with pytest.MonkeyPatch.context() as mp:
        fakes.register_echo(mp)
        fakes.register_tools(mp)
        gate = AdmissionGate(make_policy("fcfs", max_in_flight=4, max_queue=8))
        pipes = [generate("echo"), generate("tools", "tools", max_tokens=64),
                 generate("slow_tools", "tools", max_tokens=64, delay=0.03),
                 generate("slow", delay=0.03), generate("fails", after=explode),
                 generate("long", delay=0.02, repeat=100, max_tokens=500),
                 fakes.shout_pipeline("loud")]
        db = tmp_path_factory.mktemp("responses") / "memory.sqlite"
        hub = ServingHub([PipelineService(p, admission=gate, timeout_s=60) for p in pipes],
                         gate=gate, api_key=ADMIN,
                         tenants=TenantKeys({ALPHA: Tenant("alpha"), BETA: Tenant("beta")}),
                         responses=Retention(store={"backend": "sqlite", "path": str(db)}))
        with running(hub) as url:
            yield url, gate


def client_of(url: str, key: str = ALPHA) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


@pytest.fixture
def url(server):
    return server[0]


@pytest.fixture
def client(url):
    return client_of(url)


def sse(url: str, body: dict, key: str = ALPHA) -> list[dict]:
    """The events of a streamed response as sent (each ``event:`` line checked against
    its data's ``type``)."""
    events, name = [], None
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line == "data: [DONE]":
                break
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def kinds(events: list[dict]) -> list[str]:
    """Event types with repeats of one type in a row shown once."""
    out: list[str] = []
    for e in events:
        if not out or out[-1] != e["type"]:
            out.append(e["type"])
    return out


# -- answers -----------------------------------------------------------------------------
def test_a_text_answer(client):
    r = client.responses.create(model="echo", input="hello there world")
    assert r.output_text == "hello there world"
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "echo"
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_") and msg.content[0].annotations == []
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (3, 3, 6)
    assert u.input_tokens_details.cached_tokens == 0
    assert u.output_tokens_details.reasoning_tokens == 0
    assert r.store is True and r.tools == [] and r.tool_choice == "auto"
    assert r.text.format.type == "text" and r.previous_response_id is None


def test_instructions_and_input_items_reach_the_model(client):
    r = client.responses.create(model="echo", instructions="Be brief.", input=[
        {"role": "developer", "content": "Use French."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "bonjour"}, {"type": "input_text", "text": " toi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "salut"}]},
        {"role": "user", "content": "ca va"}], temperature=0.5, top_p=0.9,
        max_output_tokens=5, metadata={"k": "v"}, user="u1")
    seen = fakes.EchoEngine.REQUESTS[-1]
    assert list(seen.messages) == [  # instructions first (the stage joins system turns)
        {"role": "system", "content": "Be brief.\n\nUse French."},
        {"role": "user", "content": "bonjour toi"}, {"role": "assistant", "content": "salut"},
        {"role": "user", "content": "ca va"}]
    assert (seen.temperature, seen.top_p, seen.max_tokens) == (0.5, 0.9, 5)
    assert r.output_text == "ca va" and r.instructions == "Be brief."
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.5, 0.9, 5)
    assert r.metadata == {"k": "v"} and r.user == "u1"


def test_a_cut_answer_is_incomplete(client):
    r = client.responses.create(model="echo", input="a b c d e", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "a b" and r.output[0].status == "incomplete"
    assert r.completed_at is None


def test_a_function_tool_loop(client):
    first = client.responses.create(model="tools", input="Weather in Paris?",
                                    tools=[WEATHER, TIME])
    [call] = first.output
    assert call.type == "function_call" and call.name == "weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.status == "completed" and first.output_text == ""
    assert [t.name for t in first.tools] == ["weather", "local_time"]
    second = client.responses.create(model="tools", previous_response_id=first.id,
                                     tools=[WEATHER, TIME], input=[
                                         {"type": "function_call_output",
                                          "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == "The tool said: sunny"
    assert second.previous_response_id == first.id
    seen = fakes.EchoEngine.REQUESTS[-1].messages  # the conversation the model was given
    assert [m["role"] for m in seen] == ["user", "assistant", "tool"]
    assert seen[1]["tool_calls"] == [{"id": call.call_id, "type": "function", "function": {
        "name": "weather", "arguments": call.arguments}}]
    assert seen[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    # the same loop by hand: the output items sent back as input (as the client's
    # objects, or dumped with their unset fields as nulls), nothing stored
    for sent in (first.output, [item.model_dump() for item in first.output]):
        again = client.responses.create(model="tools", tools=[WEATHER], store=False, input=[
            {"role": "user", "content": "Weather in Paris?"}, *sent,
            {"type": "function_call_output", "call_id": call.call_id, "output": "rainy"}])
        assert again.output_text == "The tool said: rainy" and again.store is False
    text = client.responses.create(model="echo", input="hi there")
    again = client.responses.create(model="echo", input=[
        {"role": "user", "content": "hi there"}, *[o.model_dump() for o in text.output],
        {"role": "user", "content": "and again"}])
    assert again.output_text == "and again"
    assert fakes.EchoEngine.REQUESTS[-1].messages[1] == {"role": "assistant",
                                                         "content": "hi there"}
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.call_id, i.output) for i in items] == [
        ("function_call_output", call.call_id, "sunny")]


def test_tool_choice_names_a_function(client):
    r = client.responses.create(model="tools", input="What time is it in Oslo?",
                                tools=[WEATHER, TIME], parallel_tool_calls=False,
                                tool_choice={"type": "function", "name": "local_time"})
    assert [(o.type, o.name) for o in r.output] == [("function_call", "local_time")]
    assert r.tool_choice.name == "local_time" and r.parallel_tool_calls is False
    assert fakes.EchoEngine.REQUESTS[-1].tools.choice == "local_time"


def test_input_items_pages(client):
    r = client.responses.create(model="echo", input=[
        {"role": "user", "content": str(i)} for i in range(5)])
    desc = client.responses.input_items.list(r.id).data  # newest first by default
    assert [i.content[0].text for i in desc] == ["4", "3", "2", "1", "0"]
    page = client.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["0", "1"] and page.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["2", "3", "4"] and not rest.has_more


# -- streaming ---------------------------------------------------------------------------
def test_a_streamed_text_answer_event_by_event(url, client):
    events = sse(url, {"model": "slow", "input": "one two three four five"})
    assert kinds(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    created, added, part = events[0], events[2], events[3]
    rid = created["response"]["id"]
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []
    item = added["item"]
    assert added["output_index"] == 0 and item["type"] == "message" and item["content"] == []
    assert item["status"] == "in_progress"
    assert part["part"] == {"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []}
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1  # piece by piece
    for e in events[3:-1]:
        assert (e["item_id"] if "item_id" in e else e["item"]["id"]) == item["id"]
        assert e["output_index"] == 0
    text = "".join(e["delta"] for e in deltas)
    assert text == "one two three four five"
    done = {e["type"]: e for e in events}
    assert done["response.output_text.done"]["text"] == text
    assert done["response.content_part.done"]["part"]["text"] == text
    assert done["response.output_item.done"]["item"]["status"] == "completed"
    final = done["response.completed"]["response"]
    assert final["id"] == rid and final["status"] == "completed"
    assert final["output"] == [done["response.output_item.done"]["item"]]
    assert final["usage"]["output_tokens"] == 5
    assert client.responses.retrieve(rid).output_text == text  # stored before it said so

    # the openai client's stream helper accumulates the same
    with client.responses.stream(model="slow", input="one two three four five") as stream:
        got = list(stream)
        final_obj = stream.get_final_response()
    snaps = [e.snapshot for e in got if e.type == "response.output_text.delta"]
    assert snaps[-1] == text and all(text.startswith(s) for s in snaps)
    assert final_obj.output_text == text and final_obj.status == "completed"
    assert client.responses.retrieve(final_obj.id).output[0].id == final_obj.output[0].id


def test_a_streamed_function_call_event_by_event(url, client):
    events = sse(url, {"model": "slow_tools", "input": "Weather?", "tools": [WEATHER]})
    assert kinds(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    item = events[2]["item"]
    assert item["type"] == "function_call" and item["name"] == "weather"
    assert item["arguments"] == "" and item["status"] == "in_progress"
    assert item["call_id"].startswith("call_")
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # the arguments as they are written
    assert all(e["item_id"] == item["id"] and e["output_index"] == 0 for e in deltas)
    args = "".join(e["delta"] for e in deltas)
    assert json.loads(args) == {"city": "Paris"}
    done = {e["type"]: e for e in events}
    assert done["response.function_call_arguments.done"]["arguments"] == args
    assert done["response.function_call_arguments.done"]["name"] == "weather"
    assert done["response.output_item.done"]["item"] == {**item, "arguments": args,
                                                         "status": "completed"}
    assert done["response.completed"]["response"]["output"] == [
        done["response.output_item.done"]["item"]]

    with client.responses.stream(model="slow_tools", input="Weather?",
                                 tools=[WEATHER]) as stream:
        got = list(stream)
        final = stream.get_final_response()
    snaps = [e.snapshot for e in got if e.type == "response.function_call_arguments.delta"]
    assert json.loads(snaps[-1]) == {"city": "Paris"}
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    with client.responses.create(model="tools", stream=True, previous_response_id=final.id,
                                 input=[{"type": "function_call_output",
                                         "call_id": call.call_id, "output": "cold"}]) as s:
        last = [e for e in s][-1]
    assert last.type == "response.completed"
    assert last.response.output_text == "The tool said: cold"


def test_a_streamed_cut_answer_ends_incomplete(url):
    events = sse(url, {"model": "slow", "input": "a b c d e", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_a_failure_mid_stream_is_an_error_event(url, client):
    events = sse(url, {"model": "fails", "input": "a b"})
    assert events[-1]["type"] == "error" and "kaboom" in events[-1]["message"]
    assert "response.completed" not in kinds(events)
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        client.responses.retrieve(events[0]["response"]["id"])


def test_a_client_leaving_mid_stream_gives_its_ticket_back(server):
    url, gate = server
    with httpx.stream("POST", url + "/v1/responses", timeout=30,
                      headers={"Authorization": f"Bearer {ALPHA}"},
                      json={"model": "long", "input": "w", "stream": True}) as r:
        deltas = 0
        for line in r.iter_lines():  # until it is generating
            deltas += line == "event: response.output_text.delta"
            if deltas == 2:
                break
        assert deltas == 2
    wait_until(lambda: idle(gate), "gate idle after the stream closed")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/responses", json={"model": "long", "input": "w"},
                   headers={"Authorization": f"Bearer {ALPHA}"}, timeout=0.5)
    wait_until(lambda: idle(gate), "gate idle after the client stopped waiting")
    r = client_of(url).responses.create(model="echo", input="still served")
    assert r.output_text == "still served"


# -- refusals ----------------------------------------------------------------------------
BAD = [
    ({"reasoning": {"effort": "high"}}, 400, "unsupported_parameter", "'reasoning'"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "unsupported_parameter", "'include'"),
    ({"background": True}, 400, "unsupported_parameter", "'background'"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "unsupported_parameter", "'prompt'"),
    ({"truncation": "disabled"}, 400, "unsupported_parameter", "'truncation'"),
    ({"top_logprobs": 3}, 400, "unsupported_parameter", "'top_logprobs'"),
    ({"conversation": "conv_1"}, 400, "unsupported_parameter", "'conversation'"),
    ({"frequency_penalty": 1}, 400, "unsupported_parameter", "'frequency_penalty'"),
    ({"tools": [{"type": "web_search"}]}, 400, "unsupported_parameter", "'tools[0].type'"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, 400,
     "unsupported_parameter", "'tools[1].type'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400,
     "invalid_tools", "'tool_choice' names function 'nope'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, 400, "invalid_tools", "'tool_choice'"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "invalid_tools",
     "tools[0].name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "unsupported_content", "input[0].content[0].type: 'input_image'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "unsupported_input_item",
     "input[0].type: 'reasoning'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "unsupported_input_item",
     "input[0].type: 'item_reference'"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "name": "f",
                                                  "arguments": "{}"}]}, 400,
     "invalid_input", "input[1].call_id must be a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, 400,
     "invalid_input", "input[0].output must be a string"),
    ({"input": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     400, "invalid_input", "input[1]: the input must end with a user message"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "invalid_input", "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "ada"}]}, 400, "invalid_input",
     "input[0].name"),
    ({"input": []}, 400, "invalid_input", "'input' must be a string or a non-empty list"),
    ({"input": ["hi"]}, 400, "invalid_input", "input[0] must be an object"),
    ({"input": [{"role": "developer", "content": "x"}]}, 400, "invalid_input",
     "must end with a user message"),
    ({"input": [{"role": "developer", "content": "x"}, {"type": "function_call_output",
                                                       "call_id": "c", "output": "o"}]},
     400, "no_user_message", "'input' has no user message"),
    ({"max_output_tokens": 0}, 400, "invalid_parameter", "'max_output_tokens'"),
    ({"temperature": 3}, 400, "invalid_parameter", "'temperature'"),
    ({"top_p": 0}, 400, "invalid_parameter", "'top_p'"),
    ({"stream": "yes"}, 400, "invalid_parameter", "'stream'"),
    ({"store": "no"}, 400, "invalid_parameter", "'store'"),
    ({"instructions": ["x"]}, 400, "invalid_parameter", "'instructions'"),
    ({"previous_response_id": 7}, 400, "invalid_parameter", "'previous_response_id'"),
    ({"text": {"format": {"type": "xml"}}}, 400, "invalid_response_format", "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "invalid_response_format", "text.format.schema is required"),
    ({"text": {"verbosity": "low"}}, 400, "unsupported_parameter", "'text.verbosity'"),
    ({"text": {"format": {"type": "json_object"}}}, 400, "unsupported_response_format",
     "'response_format' (json_object) cannot be enforced by pipeline 'echo'"),
    ({"model": "tools", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
     400, "unsupported_parameter", "'text.format' is not supported: not together with"),
    ({"tools": [WEATHER]}, 400, "unsupported_tools",
     "'tools': pipeline 'echo' cannot answer client tools"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "o"}]}, 400,
     "unsupported_tools", "pipeline 'echo' cannot answer client tools"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output",
                                                  "call_id": "c", "output": "o"}]}, 400,
     "invalid_input", "input[1].call_id: 'c' answers no function_call"),
    ({"metadata": {"k": 1}}, 400, "invalid_metadata", "'metadata'"),
    ({"user": 5}, 400, "invalid_session", "'user'"),
    ({"priority": "batch"}, 400, "priority_not_allowed", "choose its priority"),  # as chat
    ({"model": "loud"}, 400, "pipeline_not_chat", "pipeline 'loud' has no generate"),
    ({"model": "nope"}, 404, "model_not_found", "pipeline 'nope' is not served"),
    ({"model": None}, 400, "missing_model", "'model' is required"),
]


@pytest.mark.parametrize(("extra", "status", "code", "says"), BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_what_cannot_be_honoured_is_refused_naming_it(url, extra, status, code, says):
    body = {"model": "echo", "input": "hi", **extra}
    r = httpx.post(url + "/v1/responses", json=body, timeout=10,
                   headers={"Authorization": f"Bearer {ALPHA}"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and says in err["message"], err


def test_fields_accepted_and_ignored_by_design(client):
    r = client.responses.create(model="echo", input="ok", service_tier="auto", include=[],
                                reasoning=None, truncation="auto", background=False,
                                top_logprobs=0, stream_options=None)
    assert r.output_text == "ok"


# -- state -------------------------------------------------------------------------------
def test_unknown_and_deleted_responses_are_404(client):
    for call in (lambda: client.responses.retrieve("resp_nope"),
                 lambda: client.responses.delete("resp_nope"),
                 lambda: client.responses.input_items.list("resp_nope"),
                 lambda: client.responses.create(model="echo", input="x",
                                                 previous_response_id="resp_nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found"
        assert "'resp_nope' not found" in e.value.body["message"]
    r = client.responses.create(model="echo", input="keep me")
    assert client.responses.retrieve(r.id).output_text == "keep me"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="echo", input="x", previous_response_id=r.id)


def test_delete_answers_the_deleted_object(url):
    c = client_of(url)
    r = c.responses.create(model="echo", input="x")
    got = httpx.delete(f"{url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {ALPHA}"})
    assert got.status_code == 200
    assert got.json() == {"id": r.id, "object": "response", "deleted": True}


def test_a_tenant_never_sees_another_ones_responses(url):
    alpha, beta, admin = client_of(url, ALPHA), client_of(url, BETA), client_of(url, ADMIN)
    r = alpha.responses.create(model="echo", input="alpha's secret")
    for other in (beta, admin):
        for call in (lambda c=other: c.responses.retrieve(r.id),
                     lambda c=other: c.responses.delete(r.id),
                     lambda c=other: c.responses.input_items.list(r.id),
                     lambda c=other: c.responses.create(model="echo", input="x",
                                                        previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError):
                call()
    assert alpha.responses.retrieve(r.id).output_text == "alpha's secret"  # still there
    follow = alpha.responses.create(model="echo", input="next", previous_response_id=r.id)
    assert [m["content"] for m in fakes.EchoEngine.REQUESTS[-1].messages] == [
        "alpha's secret", "alpha's secret", "next"]
    assert follow.output_text == "next"
    # the operator's own responses are its own too
    mine = admin.responses.create(model="echo", input="operator")
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(mine.id)
    assert admin.responses.retrieve(mine.id).output_text == "operator"
    with pytest.raises(openai.AuthenticationError):
        client_of(url, "sk-wrong-99999999").responses.retrieve(r.id)


def test_instructions_are_not_carried_over(client):
    first = client.responses.create(model="echo", input="one", instructions="Rule A.")
    client.responses.create(model="echo", input="two", previous_response_id=first.id)
    assert [m["role"] for m in fakes.EchoEngine.REQUESTS[-1].messages] == [
        "user", "assistant", "user"]
    client.responses.create(model="echo", input="two", previous_response_id=first.id,
                            instructions="Rule B.")
    assert fakes.EchoEngine.REQUESTS[-1].messages[0] == {"role": "system",
                                                         "content": "Rule B."}


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="echo", input="forget me", store=False)
    assert r.store is False and r.output_text == "forget me"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="echo", input="x", previous_response_id=r.id)


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_responses_expire_after_their_ttl(monkeypatch, tmp_path):
    fakes.register_echo(monkeypatch)
    clock = Clock()
    spec = {"backend": "sqlite", "path": str(tmp_path / "memory.sqlite")}
    hub = ServingHub([PipelineService(generate("echo"))],
                     responses=Retention(ttl_s=60, store=spec, clock=clock))
    with running(hub) as url:
        c = client_of(url)
        r = c.responses.create(model="echo", input="short lived")
        clock.now += 59
        assert c.responses.retrieve(r.id).output_text == "short lived"
        clock.now += 1
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="echo", input="x", previous_response_id=r.id)
        store = open_store(check_store_spec(spec))
        assert store.purge(clock()) == 1  # the expired row goes at the store's purge
        assert store.purge(clock()) == 0


def test_the_retention_flag_is_checked(pipe, capsys):
    assert main(["serve", str(pipe), "--responses-ttl-s", "0"]) == 2
    assert "--responses-ttl-s: the responses' retention (ttl_s) must be a positive number" \
        in capsys.readouterr().err
    with pytest.raises(ValueError, match="positive number"):
        Retention(ttl_s=float("nan"))


# -- the real model (SmolLM2-135M on llama.cpp) ------------------------------------------
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "country": {"type": "string", "maxLength": 30},
                       "population": {"type": "integer"}}}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.rag_fixtures import LLM

    p = tr.Pipeline("smol", engines={"llm": LLM})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=96)
     .sink())
    db = tmp_path_factory.mktemp("llama") / "memory.sqlite"
    hub = ServingHub([PipelineService(p)],
                     responses=Retention(store={"backend": "sqlite", "path": str(db)}))
    with running(hub) as url:
        yield client_of(url, "unused")


@pytest.mark.engine
def test_a_json_schema_format_on_the_real_model(llama):
    r = llama.responses.create(model="smol", input="Tell me about Paris as JSON.",
                               text={"format": {"type": "json_schema", "name": "city",
                                                "schema": CITY, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema" and r.text.format.name == "city"


@pytest.mark.engine
def test_a_required_tool_call_on_the_real_model(llama):
    tool = {**WEATHER, "parameters": {**WEATHER["parameters"], "additionalProperties": False}}
    r = llama.responses.create(model="smol", input="What is the weather in Paris?",
                               tools=[tool], tool_choice="required")
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), tool["parameters"])
    # and the answer once the tool has run, chained on the stored response
    r2 = llama.responses.create(model="smol", previous_response_id=r.id, tools=[tool],
                                input=[{"type": "function_call_output",
                                        "call_id": c.call_id, "output": "sunny, 21 C"}
                                       for c in calls])
    assert r2.status in ("completed", "incomplete") and r2.output
