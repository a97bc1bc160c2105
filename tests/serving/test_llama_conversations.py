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


def test_max_tokens_stop_and_seed_are_honoured(chat):
    ask = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    short = chat.chat.completions.create(model="chat", messages=ask, max_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    full = chat.chat.completions.create(model="chat", messages=ask)
    assert full.usage.completion_tokens > 3
    cut = chat.chat.completions.create(model="chat", messages=ask, stop=["3"])
    assert "3" not in cut.choices[0].message.content
    assert cut.choices[0].finish_reason == "stop"
    assert full.choices[0].message.content.startswith(cut.choices[0].message.content)

    def sampled(seed: int) -> str:
        return chat.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "Write a haiku."}],
            temperature=1.2, seed=seed).choices[0].message.content

    assert sampled(5) == sampled(5)
    assert len({sampled(5), sampled(6), sampled(7)}) > 1
