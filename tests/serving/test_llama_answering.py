"""A route pipeline over the embedded llama.cpp model (SmolLM2-135M), served and
streamed through the official ``openai`` client: the chosen engine's tokens stream, the
request's options reach it, usage counts the whole prompt."""

from __future__ import annotations

import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.rag_fixtures import LLM
from tests.serving.server import running

pytestmark = pytest.mark.engine


def routed() -> tr.Pipeline:
    """Two names for the one model (one load): long questions get a longer budget."""
    p = tr.Pipeline("routed", engines={"small": LLM, "big": LLM})
    (p.source(fields=["question"])
     .apply("route", id="route", rules=[{"when": {"prompt_tokens_over": 40}, "engine": "big"}],
            default="small", input="question", messages="_messages",
            system="You are a helpful assistant.", output="answer", max_tokens=24,
            per_engine={"big": {"max_tokens": 48}})
     .sink())
    return p


def test_a_route_pipeline_answers_and_streams():
    hub = ServingHub([PipelineService(routed())])
    ask = [{"role": "system", "content": "Answer in English."},
           {"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    with running(hub) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        whole = c.chat.completions.create(model="routed", messages=ask, max_tokens=12)
        assert whole.choices[0].message.content.strip()
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 12  # the request's max_tokens reached it
        # the chat template, both system messages and the question: well over the
        # question's dozen tokens
        assert whole.usage.prompt_tokens > 25
        pieces, finish = [], None
        for ch in c.chat.completions.create(model="routed", messages=ask, max_tokens=12,
                                            stream=True):
            if ch.choices and ch.choices[0].delta.content:
                pieces.append(ch.choices[0].delta.content)
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
    assert len(pieces) > 1 and finish == "length"  # tokens streamed as they came
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: the same answer
