"""Conversations and per-request options on the embedded llama.cpp model (SmolLM2-135M)
through a live server and the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.rag_fixtures import LLM
from tests.serving.server import running

pytestmark = pytest.mark.engine


def chat_pipeline() -> tr.Pipeline:
    p = tr.Pipeline("chat", engines={"llm": LLM})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            system="You are a helpful assistant.", messages="_messages", max_tokens=24,
            usage="usage")
     .sink())
    return p


@pytest.fixture(scope="module")
def chat():
    hub = ServingHub([PipelineService(chat_pipeline())])
    with running(hub) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_an_earlier_turn_reaches_the_model(chat):
    question = {"role": "user", "content": "What is my name?"}
    alone = chat.chat.completions.create(model="chat", messages=[question])
    history = [{"role": "user", "content": "Hello, my name is Zorblax the Third."},
               {"role": "assistant", "content": "Nice to meet you, Zorblax the Third!"}]
    turns = chat.chat.completions.create(model="chat", messages=[*history, question])
    # the model read the earlier turns: its prompt grew by at least their text
    assert turns.usage.prompt_tokens >= alone.usage.prompt_tokens + 15
    assert turns.choices[0].message.content
    assert turns.choices[0].message.content != alone.choices[0].message.content
