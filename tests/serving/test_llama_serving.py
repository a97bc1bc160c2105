"""Serving the embedded llama.cpp model (SmolLM2-135M) over HTTP with the official
``openai`` client: the docs example, streaming, completions, disconnect cancellation."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.engines import GenerationRequest, open_engine
from tailrace.serving import PipelineService, ServingHub
from tests.rag_fixtures import LLM
from tests.serving import fakes
from tests.serving.server import running

pytestmark = pytest.mark.engine

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
COUNT = "Count from 1 to 200, separated by commas."


def doc_block(lang: str, index: int = 0) -> str:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)[index]


def recorded_pipeline() -> tr.Pipeline:
    """The docs' chat pipeline plus a stage that remembers each answer's usage."""
    p = tr.Pipeline("counted", engines={"llm": LLM})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=64, usage="usage")
     .map(fakes.remember, id="remember").sink())
    return p


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "chat.yaml"
    path.write_text(doc_block("yaml"))
    assert yaml_engine(path) == LLM  # the docs share the test engine: one model load
    hub = ServingHub([PipelineService(tr.Pipeline.from_yaml(str(path))),
                      PipelineService(recorded_pipeline())])
    with running(hub) as url:
        yield url


def yaml_engine(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())["engines"]["llm"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_the_docs_client_example_runs(server, capsys):
    code = doc_block("python")
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    exec(code.replace("http://127.0.0.1:8000/v1", server + "/v1"), {})  # noqa: S102
    lines = capsys.readouterr().out.strip().splitlines()
    answer, n = lines[0].rsplit(" ", 1)
    assert answer.strip() and 0 < int(n) <= 48
    assert "paris" in answer.lower()
    assert len(lines) >= 2 and lines[-1].strip()  # the streamed answer


@pytest.mark.slow
def test_streamed_chunks_arrive_before_the_answer_is_complete(server):
    c = client(server)
    question = [{"role": "user", "content": "Describe the sea in two sentences."}]
    whole = c.chat.completions.create(model="chat", messages=question)
    t0 = time.perf_counter()
    arrivals, pieces = [], []
    for chunk in c.chat.completions.create(model="chat", messages=question, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - t0)
            pieces.append(chunk.choices[0].delta.content)
    done = time.perf_counter() - t0
    assert len(pieces) >= 5
    assert arrivals[0] < done * 0.5  # the first token came while generation went on
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: same answer
    assert whole.usage.completion_tokens > 5


def test_completions_endpoint_over_the_model(server):
    r = client(server).completions.create(model="chat", prompt="What colour is the sky?")
    assert r.choices[0].text.strip()
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 48


@pytest.mark.slow
def test_a_closed_stream_stops_its_sequence(server):
    fakes.RECORDED.clear()
    body = {"model": "counted", "stream": True,
            "messages": [{"role": "user", "content": COUNT}]}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [x for x in (next(lines) for _ in range(6)) if x.startswith("data: ")]
    assert len(got) >= 3  # it was generating when the client left
    deadline = time.monotonic() + 30
    while not fakes.RECORDED and time.monotonic() < deadline:
        time.sleep(0.05)
    [cancelled] = fakes.RECORDED
    # the same request, not cancelled, uses all 64 tokens
    full = client(server).chat.completions.create(model="counted", messages=body["messages"])
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 64
    assert cancelled["usage"]["completion_tokens"] < 32
    assert full.choices[0].message.content.startswith(cancelled["answer"])


def test_engine_stops_a_cancelled_sequence_and_keeps_the_others():
    engine = open_engine(LLM)
    msgs = ({"role": "user", "content": COUNT},)
    reqs = [GenerationRequest(messages=msgs, max_tokens=24) for _ in range(2)]
    seen = {0: 0, 1: 0}

    def on_token(i: int, piece: str) -> bool:
        seen[i] += 1
        return i != 0 or seen[0] < 3  # request 0 is abandoned after 3 pieces

    a, b = engine.generate(reqs, on_token)
    assert (a.finish_reason, a.completion_tokens, seen[0]) == ("cancelled", 3, 3)
    assert (b.finish_reason, b.completion_tokens) == ("length", 24)
    assert b.text.startswith(a.text)
