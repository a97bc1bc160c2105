"""The embedded engine's prefix cache seen through HTTP with the official ``openai``
client: the second turn of a conversation (a generate stage answering from ``messages:
_messages``) reports the prompt tokens it did not recompute in
``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field), and the answers equal
those of an engine without the cache."""

from __future__ import annotations

import openai
import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServingHub
from tests.rag_fixtures import LLM
from tests.serving.server import running

pytestmark = pytest.mark.engine

FIRST = ("I am planning a trip to the mountains next month with two friends. We like "
         "long walks, quiet lakes and small villages with good bread. We will travel "
         "by train and stay for about a week. Which season is best for walking there?")


def pipeline(name: str, **engine) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": {**LLM, **engine}})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            messages="_messages", max_tokens=12)
     .sink())
    return p


@pytest.fixture(scope="module")
def client():
    hub = ServingHub([PipelineService(pipeline("cached")),
                      PipelineService(pipeline("uncached", prefix_cache=False))])
    with running(hub) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def two_turns(client: openai.OpenAI, model: str) -> list:
    msgs = [{"role": "user", "content": FIRST}]
    first = client.chat.completions.create(model=model, messages=msgs)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And what should we pack?"}]
    return [first, client.chat.completions.create(model=model, messages=msgs)]


def test_the_second_turn_reuses_the_first_and_says_so(client):
    cached = two_turns(client, "cached")
    plain = two_turns(client, "uncached")
    assert [r.choices[0].message.content for r in cached] == \
        [r.choices[0].message.content for r in plain]
    details = cached[1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 64  # one whole 64-token chunk
    assert details.cached_tokens < cached[1].usage.prompt_tokens
    assert plain[1].usage.prompt_tokens_details is None  # nothing reused: no field
