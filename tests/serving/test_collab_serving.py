"""A served pipeline whose ``generate`` runs on a collaborative engine (``backend: collab``),
asked with the official ``openai`` client: one ordinary answer, streamed or not, whose
usage says how many tokens each model wrote and what they cost. SmolLM2-135M on both sides
keeps it fast; a random router makes both models write."""

from __future__ import annotations

import openai
import pytest

import tailrace as tr
from tailrace.engines.models import MODELS, model_path
from tailrace.serving import PipelineService, ServingHub
from tests.serving.server import running

FILE = model_path(MODELS["smollm2-135m-instruct"])
FILE_STEM = FILE.stem

pytestmark = pytest.mark.engine

SMOL = "{%s, n_threads: 2, n_ctx: 512, price: {prompt_per_1k: %s, completion_per_1k: %s}}"
YAML = """version: 1
pipeline: duo
source: {fields: [prompt]}
engines:
  duo:
    backend: collab
    small: %s
    large: %s
    router: {kind: random, rate: 0.5, seed: 1}
    span: token
stages:
  - {id: answer, op: generate, engine: duo, input: prompt, output: answer, max_tokens: 24}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("collab") / "duo.yaml"
    # the large side loads the same file by path: another name, so usage splits by model
    path.write_text(YAML % (SMOL % ("model: smollm2-135m-instruct", 0.01, 0.01),
                            SMOL % (f"path: {FILE}", 0.1, 0.1)))
    with running(ServingHub([PipelineService(tr.Pipeline.from_yaml(str(path)))])) as url:
        yield url


def test_the_openai_client_gets_one_answer_with_tokens_by_model(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "system", "content": "Answer in one short sentence."},
           {"role": "user", "content": "Why is the sky blue?"}]
    whole = c.chat.completions.create(model="duo", messages=ask)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    u = whole.usage
    by = u.completion_tokens_details.model_extra["by_model"]
    small, large = by["smollm2-135m-instruct"], by[FILE_STEM]
    assert small > 0 and large > 0 and small + large == u.completion_tokens
    # each model at its price: what it wrote plus what it read (the prompt at least once)
    cost = u.model_extra["cost"]
    low = (0.01 * (u.prompt_tokens + small) + 0.1 * (u.prompt_tokens + large)) / 1000
    assert low <= cost <= low + 0.1 * u.completion_tokens / 1000, (cost, low)
    pieces, usage = [], None
    for chunk in c.chat.completions.create(model="duo", messages=ask, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text  # greedy: the same answer, streamed
    assert usage is not None and usage.completion_tokens == u.completion_tokens
    streamed = usage.completion_tokens_details.model_extra["by_model"]
    # the random router draws on: another split of the same answer
    assert sorted(streamed) == sorted(by) and sum(streamed.values()) == u.completion_tokens


@pytest.fixture(scope="module")
def drafting(tmp_path_factory):
    path = tmp_path_factory.mktemp("collab") / "draft.yaml"
    text = YAML % (SMOL % ("model: smollm2-135m-instruct", 0.01, 0.01),
                   SMOL % (f"path: {FILE}", 0.1, 0.1))
    path.write_text(text.replace("span: token", "span: draft").replace("max_tokens: 24",
                                                                        "max_tokens: 40"))
    with running(ServingHub([PipelineService(tr.Pipeline.from_yaml(str(path)))])) as url:
        yield url


def test_drafted_lines_stream_as_one_answer_and_refused_drafts_never_reach_the_client(
        drafting):
    """span: draft: the small model drafts each line, the random router refuses some and
    the large model rewrites them; the client sees the model's own answer, line by line."""
    c = openai.OpenAI(base_url=drafting + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "List five colours, one per line."}]
    whole = c.chat.completions.create(model="duo", messages=ask)
    text = whole.choices[0].message.content
    assert text.count("\n") >= 3
    u = whole.usage
    by = u.completion_tokens_details.model_extra["by_model"]
    small, large = by["smollm2-135m-instruct"], by[FILE_STEM]
    assert small > 0 and large > 0 and small + large == u.completion_tokens
    # the refused drafts were computed: the small model's cost counts them on top
    low = (0.01 * (u.prompt_tokens + small) + 0.1 * (u.prompt_tokens + large)) / 1000
    assert u.model_extra["cost"] >= low + 0.01 * large / 1000 * 0.99
    pieces = [ch.choices[0].delta.content for ch in c.chat.completions.create(
        model="duo", messages=ask, stream=True) if ch.choices and ch.choices[0].delta.content]
    assert "".join(pieces) == text and len(pieces) >= 3
