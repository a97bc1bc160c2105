"""Real agent frameworks against a live ``tailrace serve``, calling client tools (issue 27):
the OpenAI Agents SDK (``agents``, plain and streamed; its Responses-API model once
``/v1/responses`` is served), LangChain's ``create_agent``, LangGraph's
``create_react_agent`` and LlamaIndex's ``OpenAILike`` (``predict_and_call`` and a
``FunctionAgent``), over the scripted ``ToolEngine`` (tests/serving/fakes.py): each
tool really runs (``CALLS``) and its result is the final answer. Then the wire itself
through the official ``openai`` client: streamed tool-call deltas field by field and
reassembled, every ``tool_choice``, and the 400s. Last, one tool call per framework on
the real SmolLM2-135M (llama.cpp, grammar-held), its arguments valid against the tool's
JSON Schema."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub, create_app
from tailrace.serving.responses_store import Retention
from tests.rag_fixtures import LLM
from tests.serving import fakes
from tests.serving.server import running

CALLS: list[str] = []  # every city a tool function was called with


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    CALLS.append(city)
    return f"sunny, 21 C in {city}"


def pipeline_lookup(city: str) -> dict:
    """The tool a pipeline's own tool_call stage registers (not a client tool)."""
    return {"city": city}


ANSWER = "The tool said: sunny, 21 C in Paris"  # ToolEngine's answer after the call
QUESTION = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                            "description": "Get the current weather."}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": SCHEMA,
                                         "description": "Get the local time."}}
USER = [{"role": "user", "content": QUESTION}]


def _serves(path: str) -> bool:
    """Whether tailrace's app has a route at ``path`` (checked when the tests run)."""
    return any(getattr(r, "path", None) == path for r in create_app(ServingHub([])).routes)


RESPONSES = pytest.mark.skipif(
    not _serves("/v1/responses"),
    reason="/v1/responses is not served yet (being built): OpenAIResponsesModel needs it")


# -- pipelines and servers -----------------------------------------------------------------
def generate_pipeline(name: str, engine: dict[str, Any], **stage: Any) -> tr.Pipeline:
    """``question`` -> one generate stage (it answers) over ``engine``."""
    p = tr.Pipeline(name, engines={"llm": engine})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=64, **stage)
     .sink())
    return p


def tool_stage_pipeline(name: str) -> tr.Pipeline:
    """A pipeline that answers with its own tool_call stage."""
    p = tr.Pipeline(name, engines={"llm": TOOLS})
    (p.source(fields=["question"])
     .apply("tool_call", id="agent", engine="llm", input="question", max_tokens=64,
            tools=[{"name": "lookup", "fn": "tests.serving.test_agents.pipeline_lookup",
                    "schema": SCHEMA}])
     .sink())
    return p


TOOLS = {"backend": "tools", "model": "tools", "path": fakes.__file__}
#: a longer call ("ParisParisParis"), its 7-character pieces 10 ms apart: its arguments
#: reach the client as several deltas (pieces closer together may be sent as one)
SLOW_TOOLS = {**TOOLS, "repeat": 3, "delay": 0.01}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # /v1/responses keeps what the Responses-API model sends in a private SQLite file
    db = tmp_path_factory.mktemp("responses") / "memory.sqlite"
    with pytest.MonkeyPatch.context() as mp:
        fakes.register_tools(mp)
        fakes.register_echo(mp)
        hub = ServingHub([PipelineService(generate_pipeline("agent", TOOLS)),
                          PipelineService(generate_pipeline("alone", TOOLS, messages=False)),
                          PipelineService(generate_pipeline("slow", SLOW_TOOLS)),
                          PipelineService(generate_pipeline("echo", fakes.echo_spec())),
                          PipelineService(tool_stage_pipeline("toolstage"))],
                         responses=Retention(store={"backend": "sqlite", "path": str(db)}))
        with running(hub) as u:
            yield u + "/v1"


@pytest.fixture(autouse=True)
def fresh():
    CALLS.clear()
    fakes.EchoEngine.REQUESTS.clear()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0)


def sent(i: int = -1) -> list[dict[str, Any]]:
    """The messages of the ``i``-th request the engine got."""
    return list(fakes.EchoEngine.REQUESTS[i].messages)


def assert_tool_loop(system: str | None = None) -> None:
    """The engine was asked twice: offered get_weather, then given the tool's result
    after its own call; ``system`` (if given) led both conversations."""
    first, second = fakes.EchoEngine.REQUESTS  # exactly two model calls
    assert [f["name"] for f in first.tools.functions] == ["get_weather"]
    assert second.messages[-1]["role"] == "tool"
    assert second.messages[-1]["content"] == "sunny, 21 C in Paris"
    [call] = second.messages[-2]["tool_calls"]
    assert second.messages[-1]["tool_call_id"] == call["id"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    if system is not None:
        for r in (first, second):
            assert r.messages[0] == {"role": "system", "content": system}


# -- OpenAI Agents SDK ---------------------------------------------------------------------
def sdk_agent(url: str, responses: bool = False, **kw: Any) -> Any:
    """An Agents SDK agent on pipeline ``agent`` (its own AsyncOpenAI client: one per
    event loop)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    api = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)
    model = (agents.OpenAIResponsesModel if responses else agents.OpenAIChatCompletionsModel)(
        model=kw.pop("model", "agent"), openai_client=api)
    return agents.Agent(name="weather", instructions="You answer weather questions.",
                        model=model, tools=[agents.function_tool(get_weather)], **kw)


def test_agents_sdk_calls_the_tool_and_answers_with_its_result(url):
    from agents import Runner

    result = Runner.run_sync(sdk_agent(url), QUESTION)
    assert result.final_output == ANSWER
    assert CALLS == ["Paris"]
    assert_tool_loop(system="You answer weather questions.")


async def _streamed(agent: Any) -> tuple[Any, list[str]]:
    from agents import Runner

    run = Runner.run_streamed(agent, QUESTION)
    names = [e.name async for e in run.stream_events() if e.type == "run_item_stream_event"]
    return run.final_output, names


def test_agents_sdk_streamed_run_reassembles_the_streamed_call(url):
    final, names = asyncio.run(_streamed(sdk_agent(url)))
    assert final == ANSWER
    assert CALLS == ["Paris"]
    assert names[:2] == ["tool_called", "tool_output"]
    assert_tool_loop(system="You answer weather questions.")


@RESPONSES
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_agents_sdk_responses_model_calls_the_tool(url, streamed):
    from agents import Runner

    agent = sdk_agent(url, responses=True)
    if streamed:
        final, _ = asyncio.run(_streamed(agent))
    else:
        final = Runner.run_sync(agent, QUESTION).final_output
    assert final == ANSWER
    assert CALLS == ["Paris"]
    assert_tool_loop(system="You answer weather questions.")


# -- LangChain and LangGraph ---------------------------------------------------------------
def chat_openai(url: str, model: str = "agent", **kw: Any) -> Any:
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(base_url=url, api_key="none", model=model, max_retries=0, **kw)


def lc_tool() -> Any:
    return pytest.importorskip("langchain_core.tools").tool(get_weather)


@pytest.mark.parametrize("responses", [False, pytest.param(True, marks=RESPONSES)],
                         ids=["chat-completions", "responses-api"])
def test_langchain_create_agent_calls_the_tool_with_its_system_prompt(url, responses):
    agents = pytest.importorskip("langchain.agents")
    agent = agents.create_agent(chat_openai(url, use_responses_api=responses),
                                tools=[lc_tool()], system_prompt="You are a weather bot.")
    out = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
    assert out["messages"][-1].text == ANSWER  # (Responses: content is a list of blocks)
    assert [m.type for m in out["messages"]] == ["human", "ai", "tool", "ai"]
    assert out["messages"][1].tool_calls[0]["args"] == {"city": "Paris"}
    assert CALLS == ["Paris"]
    assert_tool_loop(system="You are a weather bot.")


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_langgraph_react_agent_calls_the_tool_with_its_system_prompt(url):
    prebuilt = pytest.importorskip("langgraph.prebuilt")
    agent = prebuilt.create_react_agent(chat_openai(url), tools=[lc_tool()],
                                        prompt="You are a weather bot.")
    out = agent.invoke({"messages": [{"role": "user", "content": QUESTION}]})
    assert out["messages"][-1].content == ANSWER
    assert CALLS == ["Paris"]
    assert_tool_loop(system="You are a weather bot.")


# -- LlamaIndex ----------------------------------------------------------------------------
def openai_like(url: str, model: str = "agent", **kw: Any) -> Any:
    li = pytest.importorskip("llama_index.llms.openai_like")
    return li.OpenAILike(model=model, api_base=url, api_key="none", is_chat_model=True,
                         is_function_calling_model=True, max_retries=0, **kw)


def li_tool() -> Any:
    return pytest.importorskip("llama_index.core.tools").FunctionTool.from_defaults(get_weather)


def test_llamaindex_predict_and_call_runs_the_tool(url):
    out = openai_like(url).predict_and_call([li_tool()], QUESTION)
    assert str(out) == "sunny, 21 C in Paris"  # predict_and_call returns the tool's output
    assert CALLS == ["Paris"]
    assert [f["name"] for f in fakes.EchoEngine.REQUESTS[0].tools.functions] == ["get_weather"]


# LlamaIndex's workflows inspect the agent's pydantic attributes (their warnings, not ours)
@pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20",
                            "ignore::pydantic.warnings.PydanticDeprecatedSince211")
def test_llamaindex_function_agent_calls_the_tool_and_answers(url):
    workflow = pytest.importorskip("llama_index.core.agent.workflow")

    async def run() -> Any:
        agent = workflow.FunctionAgent(tools=[li_tool()], llm=openai_like(url),
                                       system_prompt="You are a weather bot.")
        return await agent.run(user_msg=QUESTION)

    assert str(asyncio.run(run())) == ANSWER
    assert CALLS == ["Paris"]
    assert_tool_loop(system="You are a weather bot.")


# -- the wire: streamed deltas, tool_choice, parallel_tool_calls ----------------------------
def test_streamed_tool_call_deltas_field_by_field(url):
    c = client(url)
    plain = c.chat.completions.create(model="slow", messages=USER, tools=[WEATHER])
    [call] = plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "tool_calls"
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")

    chunks = list(c.chat.completions.create(model="slow", messages=USER, tools=[WEATHER],
                                            stream=True))
    deltas = [tc.model_dump(exclude_unset=True) for ch in chunks if ch.choices
              for tc in ch.choices[0].delta.tool_calls or ()]
    first, *later = deltas
    assert set(first) == {"index", "id", "type", "function"}
    assert first["index"] == 0 and first["type"] == "function"
    assert first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert later  # usually 5 pieces; how many is the relay's business, not asserted
    for d in later:
        assert set(d) == {"index", "function"} and d["index"] == 0
        assert set(d["function"]) == {"arguments"}
    streamed = "".join(d["function"]["arguments"] for d in later)
    assert json.loads(streamed) == json.loads(call.function.arguments) \
        == {"city": "ParisParisParis"}
    # no text around the call, and the role comes with the call's first delta (content
    # null, as OpenAI sends a call)
    assert [ch.choices[0].delta.content for ch in chunks if ch.choices
            and ch.choices[0].delta.content is not None] == []
    head = next(ch.choices[0].delta for ch in chunks if ch.choices)
    assert head.role == "assistant" and head.tool_calls[0].function.name == "get_weather"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])

    # the openai client's own reassembly: ChatCompletionStreamState and .stream()
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for ch in chunks:
        state.handle_chunk(ch)
    with c.chat.completions.stream(model="slow", messages=USER, tools=[WEATHER]) as s:
        for _ in s:
            pass
        helper = s.get_final_completion()
    for done in (state.get_final_completion(), helper):
        [got] = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls"
        assert (got.type, got.function.name) == ("function", "get_weather")
        assert json.loads(got.function.arguments) == json.loads(call.function.arguments)
        assert got.id.startswith("call_")


@pytest.mark.parametrize(("choice", "called"), [
    ("auto", "get_time"), ("required", "get_time"),
    ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ("none", None)])
def test_each_tool_choice(url, choice, called):
    r = client(url).chat.completions.create(model="agent", messages=USER,
                                            tools=[TIME, WEATHER], tool_choice=choice)
    msg = r.choices[0].message
    if called is None:  # offered nothing: the (echoing) engine answers in text
        assert msg.tool_calls is None and msg.content == QUESTION
        assert r.choices[0].finish_reason == "stop"
    else:
        assert [c.function.name for c in msg.tool_calls] == [called]
        assert r.choices[0].finish_reason == "tool_calls"
    spec = fakes.EchoEngine.REQUESTS[-1].tools
    assert [f["name"] for f in spec.functions] == ["get_time", "get_weather"]


def test_parallel_tool_calls_false_is_accepted_and_reaches_the_engine(url):
    r = client(url).chat.completions.create(model="agent", messages=USER, tools=[WEATHER],
                                            parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    assert fakes.EchoEngine.REQUESTS[-1].tools.parallel is False


def test_a_tool_result_in_the_history_is_answered(url):
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    r = client(url).chat.completions.create(model="agent", tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}])
    assert r.choices[0].message.content == "The tool said: rain"
    assert r.choices[0].finish_reason == "stop"
    assert [m["role"] for m in sent()] == ["system", "user", "assistant", "tool"]


# -- 400s through the official client ----------------------------------------------------
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": "{}"}}]}


@pytest.mark.parametrize(("model", "kw", "message"), [
    ("agent", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}},
     "'tool_choice' names function 'nope', which 'tools' does not offer"),
    ("agent", {"tools": [{"type": "custom", "custom": {"name": "grammar"}}]},
     "tools[0].type: 'custom' tools are not supported"),
    ("agent", {"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ("agent", {"messages": [*USER, ASSISTANT_CALL, {"role": "tool", "content": "rain"}]},
     "messages[2].tool_call_id is required"),
    ("toolstage", {"tools": [WEATHER]},
     "'tools': pipeline 'toolstage' cannot answer client tools: its answering stage 'agent' "
     "(tool_call): it is a tool_call stage"),
    ("echo", {"tools": [WEATHER]},
     "'tools': pipeline 'echo' cannot answer client tools: its answering stage 'answer' "
     "(generate): its engine 'llm' (backend 'echo') does not call tools"),
    ("alone", {"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi."},
                            {"role": "assistant", "content": "Hello."}, *USER]},
     "its answering stage 'answer' says 'messages: false'"),
], ids=["unknown-function", "custom-tool", "required-without-tools", "no-tool-call-id",
        "tool-call-stage", "echo-engine", "messages-false"])
def test_what_cannot_be_answered_is_a_400_naming_the_field(url, model, kw, message):
    kw = {"messages": USER, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model=model, **kw)
    assert message in e.value.message
    assert not fakes.EchoEngine.REQUESTS  # nothing reached an engine


def test_messages_false_takes_the_last_user_message_alone(url):
    r = client(url).chat.completions.create(model="alone", messages=USER)
    assert r.choices[0].message.content == QUESTION
    assert sent() == USER


# -- the real SmolLM2-135M (llama.cpp): a grammar-held call per framework -------------------
@pytest.fixture(scope="module")
def smol():
    hub = ServingHub([PipelineService(generate_pipeline("smol", LLM))])
    with running(hub) as u:
        yield u + "/v1"


def valid_call(args: Any, schema: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(args) if isinstance(args, str) else args, schema)


@pytest.mark.engine
def test_real_model_agents_sdk_required_tool_call(smol):
    agents = pytest.importorskip("agents")
    agent = sdk_agent(smol, model="smol", tool_use_behavior="stop_on_first_tool",
                      model_settings=agents.ModelSettings(tool_choice="required",
                                                          temperature=0))
    result = agents.Runner.run_sync(agent, QUESTION)
    [call] = [i.raw_item for i in result.new_items if i.type == "tool_call_item"]
    assert call.name == "get_weather"
    valid_call(call.arguments, agents.function_tool(get_weather).params_json_schema)
    [city] = CALLS
    assert result.final_output == f"sunny, 21 C in {city}"  # the tool's, as it stopped


@pytest.mark.engine
def test_real_model_langchain_required_tool_call(smol):
    fn = pytest.importorskip("langchain_core.utils.function_calling")
    tool = lc_tool()
    msg = chat_openai(smol, "smol", temperature=0).bind_tools(
        [tool], tool_choice="required").invoke(QUESTION)
    [call] = msg.tool_calls
    assert call["name"] == "get_weather"
    valid_call(call["args"], fn.convert_to_openai_tool(tool)["function"]["parameters"])
    assert msg.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.engine
def test_real_model_llamaindex_required_tool_call(smol):
    llm, tool = openai_like(smol, "smol", temperature=0), li_tool()
    resp = llm.chat_with_tools([tool], user_msg=QUESTION, tool_required=True)
    [call] = llm.get_tool_calls_from_response(resp, error_on_no_tool_call=True)
    assert call.tool_name == "get_weather"
    valid_call(call.tool_kwargs, tool.metadata.get_parameters_dict())
