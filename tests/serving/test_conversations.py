"""Conversations through a live server: the whole ``messages`` list reaches a generate
stage with ``messages: _messages`` (checked in what reached the fake engine), the
context window drops the oldest turns first, and what cannot be answered is a 400."""

from __future__ import annotations

import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.serving import fakes
from tests.serving.server import running


def chat_pipeline(name: str = "chat", messages=None, **engine) -> tr.Pipeline:
    """A prompt stage and a generate stage that answers; ``messages``: its YAML key
    (None: left out, the default: the request's conversation)."""
    p = tr.Pipeline(name, engines={"llm": fakes.echo_spec(**engine)})
    conv = {} if messages is None else {"messages": messages}
    (p.source(fields=["question"])
     .apply("prompt", id="ctx", template="CONTEXT: facts\nQ: {question}", output="prompt")
     .apply("generate", id="answer", engine="llm", input="prompt", output="answer",
            system="Stage system.", max_tokens=8, usage="usage", **conv)
     .sink())
    return p


@pytest.fixture
def url(monkeypatch):
    fakes.register_echo(monkeypatch)
    fakes.EchoEngine.REQUESTS.clear()
    hub = ServingHub([PipelineService(chat_pipeline()),
                      PipelineService(chat_pipeline("tiny", context=60)),
                      PipelineService(chat_pipeline("named", messages="_messages")),
                      PipelineService(chat_pipeline("alone", messages=False))])
    with running(hub) as u:
        yield u


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


CONVERSATION = [
    {"role": "system", "content": "Client system."},
    {"role": "user", "content": "My name is Ada."},
    {"role": "assistant", "content": "Hello Ada."},
    {"role": "user", "content": "What is my name?"},
]


@pytest.mark.parametrize("pipeline", ["chat", "named"])
def test_multi_turn_conversation_reaches_the_engine_in_order(url, pipeline):
    # by default (no messages: key) as with messages: _messages
    r = client(url).chat.completions.create(model=pipeline, messages=CONVERSATION)
    sent = fakes.EchoEngine.REQUESTS[-1].messages
    assert list(sent) == [
        {"role": "system", "content": "Stage system.\n\nClient system."},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "CONTEXT: facts\nQ: What is my name?"},
    ]
    assert r.choices[0].message.content.startswith("CONTEXT:")


def test_streamed_multi_turn_conversation(url):
    stream = client(url).chat.completions.create(model="chat", messages=CONVERSATION,
                                                 stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("CONTEXT:")
    assert len(fakes.EchoEngine.REQUESTS[-1].messages) == 4


def test_oldest_turns_are_dropped_to_fit_the_context(url):
    # tiny: 60 tokens of context, max_tokens 8 -> 52 for the prompt; each message costs
    # its words + 1 + 8 (overhead); the fixed part (system + latest) takes 26
    long = " ".join(["word"] * 8)
    msgs = [{"role": "user", "content": "first " + long},
            {"role": "assistant", "content": "reply one"},
            {"role": "user", "content": "second turn"},
            {"role": "assistant", "content": "reply two"},
            {"role": "user", "content": "latest?"}]
    client(url).chat.completions.create(model="tiny", messages=msgs)
    sent = fakes.EchoEngine.REQUESTS[-1].messages
    assert sent[0] == {"role": "system", "content": "Stage system."}
    assert sent[-1]["content"].endswith("Q: latest?")
    assert [m["content"] for m in sent[1:-1]] == ["second turn", "reply two"]


def test_a_question_that_cannot_fit_is_a_400(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x " * 60}])
    assert "system prompt and the latest question" in str(e.value)


@pytest.mark.parametrize(("message", "field"), [
    ({"role": "tool", "content": "42", "tool_call_id": "a"},
     "messages[0].tool_call_id: 'a' answers no call"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "messages[0].content[0].type"),
    ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
     "messages[0].content[0].type"),
])
def test_messages_it_cannot_answer_are_400s_naming_the_field(url, message, field):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(
            model="chat", messages=[message, {"role": "user", "content": "hi"}])
    assert field in str(e.value)


def test_tool_results_to_a_pipeline_that_takes_no_tools_are_a_400(url):
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="chat", messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    assert "messages[1] (a tool call or result): pipeline 'chat' cannot answer client " \
        "tools" in str(e.value)


def test_a_conversation_must_end_with_a_user_message(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "prefill"}])
    assert "messages[1]" in str(e.value)


def test_a_pipeline_that_opts_out_refuses_a_conversation_naming_the_stage(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="alone", messages=CONVERSATION)
    assert "stage 'answer' says 'messages: false'" in str(e.value)
    assert e.value.code == "conversation_not_accepted"
    r = client(url).chat.completions.create(model="alone", messages=CONVERSATION[-1:])
    assert r.choices[0].message.content.startswith("CONTEXT:")
    assert list(fakes.EchoEngine.REQUESTS[-1].messages) == [
        {"role": "system", "content": "Stage system."},
        {"role": "user", "content": "CONTEXT: facts\nQ: What is my name?"}]


def test_models_lists_whether_a_pipeline_takes_conversations_and_tools(url):
    meta = {m.id: m.model_extra["metadata"] for m in client(url).models.list().data}
    assert meta["chat"]["conversation"] is True and meta["alone"]["conversation"] is False
    assert meta["chat"]["tools"] is False  # the echo engine calls no tools
