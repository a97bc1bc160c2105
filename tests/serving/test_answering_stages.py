"""Chat pipelines that answer with ``route`` or ``tool_call``, through a live server and
the official ``openai`` client: the conversation and the request's options reach the
engine, the engine's finish reason, usage counting everything the model read (system,
history, tool rounds, cascade levels), what streams for each kind, cancellation on
disconnect, and a clear 400 (and /v1/models entry) when no single stage answers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.compiler import compile_pipeline
from tailrace.engines import Generation, GenerationRequest
from tailrace.serving import PipelineService, ServingHub
from tailrace.serving.binding import bind
from tests.serving import fakes
from tests.serving.server import running

LOG: list[tuple[str, GenerationRequest, Generation]] = []  # (model, request, generation)
LOCK = threading.Lock()


def bot_reply(model: str, messages: Sequence[dict]) -> str:
    """The tool bot calls get_weather for a weather question, then answers with the
    result; every other model (and the bot otherwise) says ``MODEL: LAST MESSAGE``."""
    last = messages[-1]["content"]
    if model == "bot":
        if last.startswith("Result of get_weather: "):
            r = json.loads(last.split(": ", 1)[1])
            return f"It is {r['temp']} degrees in {r['city']}."
        if "weather" in last:
            return json.dumps({"tool": "get_weather", "arguments": {"city": "Paris"}})
    return f"{model}: {last}"


class Tagged:
    """A chat engine answering ``bot_reply`` one word-piece at a time (``delay`` apart);
    it honours ``on_token`` returning False (finish ``cancelled``), reports ``length``
    when it used all of ``max_tokens``, a confidence (-2.0 when the question says
    'hard'), and reads every message's words (+1 each) as prompt tokens."""

    chat = True

    def __init__(self, model: str, path: str | None = None, delay: float = 0.0,
                 context: int = 4096) -> None:
        self.model, self.delay, self.context_length = model, delay, context

    def count_tokens(self, text: str) -> int:
        return len(text.split()) + 1

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Any = None) -> list[Generation]:
        out = []
        for i, r in enumerate(requests):
            words = bot_reply(self.model, r.messages).split()[:r.max_tokens]
            done, reason = [], "length" if len(words) == r.max_tokens else "stop"
            for w in words:
                if self.delay:
                    time.sleep(self.delay)
                done.append(w if not done else " " + w)
                if on_token is not None and on_token(i, done[-1]) is False:
                    reason = "cancelled"
                    break
            hard = any("hard" in m["content"] for m in r.messages)
            g = Generation("".join(done), sum(self.count_tokens(m["content"])
                                              for m in r.messages),
                           len(done), reason, {"mean_logprob": -2.0 if hard else -0.1})
            with LOCK:
                LOG.append((self.model, r, g))
            out.append(g)
        return out

    def close(self) -> None:
        pass


def get_weather(city: str) -> dict:
    return {"city": city, "temp": 17}


WEATHER = {"name": "get_weather", "fn": "tests.serving.test_answering_stages.get_weather",
           "schema": {"type": "object", "required": ["city"],
                      "properties": {"city": {"type": "string"}}}}


def spec(model: str, **kw: Any) -> dict:
    return {"backend": "tagged", "model": model, "path": __file__, **kw}


def routed(name: str = "routed", delay: float = 0.0) -> tr.Pipeline:
    """Rules: a question over 6 tokens goes to 'big', the rest to 'small'."""
    p = tr.Pipeline(name, engines={"small": spec("small", delay=delay),
                                   "big": spec("big", delay=delay)})
    (p.source(fields=["question"])
     .apply("route", id="route", rules=[{"when": {"prompt_tokens_over": 6}, "engine": "big"}],
            default="small", input="question", system="Be brief.",  # the conversation: default
            output="answer", max_tokens=12, stop=["END"], frozen=["seed"])
     .sink())
    return p


def cascade() -> tr.Pipeline:
    """A draft generate feeds a cascade: the cascade answers, the draft never streams."""
    p = tr.Pipeline("cascade", engines={"small": spec("small"), "big": spec("big"),
                                        "drafter": spec("drafter")})
    (p.source(fields=["question"])
     .apply("generate", id="draft", engine="drafter", input="question", output="draft",
            max_tokens=12)
     .apply("route", id="route", cascade=["small", "big"], threshold=-1.0,
            prompt="{question}", output="answer", max_tokens=12)
     .sink())
    return p


def agent() -> tr.Pipeline:
    p = tr.Pipeline("agent", engines={"bot": spec("bot")})
    (p.source(fields=["question"])
     .apply("tool_call", id="agent", engine="bot", tools=[WEATHER], input="question",
            system="You are a weather bot.", output="answer",  # the conversation: default
            max_tokens=16)
     .sink())
    return p


def generated() -> tr.Pipeline:
    """A generate answering the conversation, without a ``usage:`` field."""
    p = tr.Pipeline("generated", engines={"llm": spec("small")})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", messages="_messages",
            system="Be brief.", output="answer", max_tokens=12)
     .sink())
    return p


def ambiguous() -> tr.Pipeline:
    """Two generate stages on parallel branches: which one answers?"""
    p = tr.Pipeline("forked", engines={"llm": spec("small")})
    s = p.source(fields=["question"])
    a = s.apply("generate", id="left", engine="llm", input="question", output="left")
    b = s.apply("generate", id="right", engine="llm", input="question", output="right")
    a.merge(b).sink()
    return p


def same_field() -> tr.Pipeline:
    p = tr.Pipeline("twice", engines={"llm": spec("small")})
    (p.source(fields=["question"])
     .apply("generate", id="first", engine="llm", input="question", output="answer")
     .apply("route", id="again", rules=[], default="llm", input="answer", output="answer")
     .sink())
    return p


@pytest.fixture(autouse=True)
def tagged_backend(monkeypatch):
    from tailrace.engines import models as registry

    monkeypatch.setitem(registry.BACKENDS, "tagged",
                        ("tests.serving.test_answering_stages", "Tagged", ("generate",)))
    LOG.clear()


@pytest.fixture
def url():
    hub = ServingHub([PipelineService(routed()), PipelineService(cascade()),
                      PipelineService(agent()), PipelineService(fakes.shout_pipeline()),
                      PipelineService(ambiguous()), PipelineService(generated())])
    with running(hub) as u:
        yield u


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


CHAT = [{"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "bonjour"},
        {"role": "user", "content": "say one two three"}]
LONG = "please repeat these eight words right back now"  # 9 tokens: big


def streamed(c: openai.OpenAI, **kw: Any) -> tuple[list[str], str | None, Any]:
    pieces, finish, usage = [], None, None
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                        **kw):
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    return pieces, finish, usage


def test_route_rules_answer_the_conversation_with_the_requests_options(url):
    r = client(url).chat.completions.create(model="routed", messages=CHAT, max_tokens=3,
                                            temperature=0.7, top_p=0.9, stop="x",
                                            presence_penalty=0.5)
    [(model, req, gen)] = LOG
    assert model == "small" and r.choices[0].message.content == "small: say one"
    assert req.messages == ({"role": "system", "content": "Be brief.\n\nAnswer in French."},
                            {"role": "user", "content": "hi there"},
                            {"role": "assistant", "content": "bonjour"},
                            {"role": "user", "content": "say one two three"})
    assert (req.max_tokens, req.temperature, req.top_p, req.presence_penalty) == (3, 0.7, 0.9,
                                                                                  0.5)
    assert req.stop == ("END", "x")
    assert r.choices[0].finish_reason == "length"  # the engine's: 3 of max_tokens 3
    # what the model read: the system prompts, the history and the question (counted by
    # the engine), not only the question's 4 tokens
    assert r.usage.prompt_tokens == gen.prompt_tokens == 6 + 3 + 2 + 5
    assert r.usage.completion_tokens == 3


def test_route_rules_stream_the_chosen_engines_tokens(url):
    c = client(url)
    whole = c.chat.completions.create(model="routed",
                                      messages=[{"role": "user", "content": LONG}])
    assert whole.choices[0].message.content == "big: " + LONG
    pieces, finish, usage = streamed(c, model="routed",
                                     messages=[{"role": "user", "content": LONG}],
                                     max_tokens=100)
    assert "".join(pieces) == "big: " + LONG and finish == "stop"
    assert LOG[-1][1].max_tokens == 12  # the YAML's max_tokens is the ceiling
    assert usage.prompt_tokens == LOG[-1][2].prompt_tokens == 3 + 9  # system + question
    assert usage.completion_tokens == 9


def test_a_generate_without_a_usage_field_reports_what_the_model_read(url):
    r = client(url).chat.completions.create(model="generated", messages=CHAT)
    [(_, _, gen)] = LOG
    assert r.usage.prompt_tokens == gen.prompt_tokens == 6 + 3 + 2 + 5  # not the question's 4
    assert r.usage.completion_tokens == gen.completion_tokens == 5


def test_a_frozen_option_of_a_route_is_a_400_naming_it(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="routed", messages=CHAT, seed=1)
    assert "'seed' is fixed by pipeline 'routed' (its answering stage 'route'" in str(e.value)


def test_a_cascade_streams_only_the_answer_it_keeps(url):
    c = client(url)
    pieces, finish, usage = streamed(c, model="cascade", temperature=0.2,
                                     messages=[{"role": "user", "content": "a hard one"}])
    assert "".join(pieces) == "big: a hard one" and finish == "stop"
    assert not any("small" in p or "drafter" in p for p in pieces)
    by = {m: (q, g) for m, q, g in LOG}
    assert set(by) == {"drafter", "small", "big"}
    assert by["drafter"][0].temperature == 0.0  # not the answering stage: YAML settings
    assert by["small"][0].temperature == by["big"][0].temperature == 0.2
    # both levels' tokens: the model read the question twice
    assert usage.prompt_tokens == by["small"][1].prompt_tokens + by["big"][1].prompt_tokens
    assert usage.completion_tokens == 4 + 4
    LOG.clear()
    pieces, finish, _ = streamed(c, model="cascade",
                                 messages=[{"role": "user", "content": "an easy one"}])
    assert pieces == ["small: an easy one"]  # kept by its confidence: sent whole
    assert {m for m, _, _ in LOG} == {"drafter", "small"}


def test_tool_call_continues_the_conversation_and_streams_only_the_answer(url):
    c = client(url)
    chat = [{"role": "system", "content": "Use Celsius."},
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "weather in Paris?"}]
    r = c.chat.completions.create(model="agent", messages=chat, temperature=0.3,
                                  max_tokens=40, stop=["STOP"])
    assert r.choices[0].message.content == "It is 17 degrees in Paris."
    assert r.choices[0].finish_reason == "stop"
    first, second = (q for _, q, _ in LOG)
    assert first.messages[0]["role"] == "system"
    assert first.messages[0]["content"].startswith("You are a weather bot.\n\nYou can call")
    assert first.messages[0]["content"].endswith("Use Celsius.")
    assert first.messages[1:] == tuple(chat[1:])  # the history reached the model
    assert second.messages[:4] == first.messages  # ... and the tool round continues it
    assert second.messages[-1]["content"].startswith("Result of get_weather: ")
    for q in (first, second):  # every round takes the request's options
        assert (q.temperature, q.max_tokens, q.stop) == (0.3, 16, ("STOP",))
    assert r.usage.prompt_tokens == sum(g.prompt_tokens for _, _, g in LOG)
    assert r.usage.completion_tokens == sum(g.completion_tokens for _, _, g in LOG)
    pieces, finish, usage = streamed(c, model="agent", messages=chat)
    assert pieces == ["It is 17 degrees in Paris."] and finish == "stop"  # no tool call
    assert usage.prompt_tokens == r.usage.prompt_tokens


def test_a_closed_route_stream_stops_its_sequence():
    hub = ServingHub([PipelineService(routed("slow", delay=0.02))])
    words = " ".join(["w"] * 11)  # 12 tokens: 'big'
    with running(hub) as url:
        body = {"model": "slow", "stream": True, "max_tokens": 12,
                "messages": [{"role": "user", "content": words}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
        assert sum(1 for x in got if x.startswith("data: ")) >= 2
        deadline = time.monotonic() + 10
        while not LOG and time.monotonic() < deadline:
            time.sleep(0.02)
    [(model, _, gen)] = LOG
    assert model == "big" and gen.finish_reason == "cancelled" and gen.completion_tokens < 12


def test_no_single_answering_stage_is_a_400_and_models_says_why(url):
    for model, why in (("shout", "has no generate, route or tool_call stage"),
                       ("forked", "stages 'left' (generate), 'right' (generate) are on "
                                  "parallel branches")):
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": model, "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "pipeline_not_chat"
        assert why in r.json()["error"]["message"]
        entry = next(m for m in httpx.get(url + "/v1/models").json()["data"]
                     if m["id"] == model)
        assert why in entry["metadata"]["not_chat"]
        assert "chat.completions" not in entry["metadata"]["endpoints"]
    entry = next(m for m in httpx.get(url + "/v1/models").json()["data"] if m["id"] == "agent")
    assert entry["metadata"]["answering_stage"] == {"id": "agent", "kind": "tool_call"}


def test_the_answering_stage_is_the_last_before_the_sink():
    b = bind(compile_pipeline(cascade()))
    assert (b.stage, b.kind, b.answer_field, b.max_tokens) == ("route", "route", "answer", 12)
    b = bind(compile_pipeline(same_field()))
    assert b.problem is not None and "stages 'first' and 'again' both write field " \
        "'answer'" in b.problem


def test_token_reservations_count_every_model_stage():
    """Tenants' token reservations and the admission cost model: a generate's
    max_tokens, a cascade's at every level, a tool_call's at every round."""
    from tailrace.serving.binding import output_tokens

    assert output_tokens(compile_pipeline(routed())) == 12
    assert output_tokens(compile_pipeline(cascade())) == 12 + 2 * 12
    agent_plan = compile_pipeline(agent())
    [tc] = [o for s in agent_plan.stages for o in s.ops if o.op.name == "tool_call"]
    assert tc.params["max_rounds"] >= 1
    assert output_tokens(agent_plan) == 16 * (tc.params["max_rounds"] + 1)


def test_response_format_needs_a_generate_stage_to_answer(monkeypatch):
    """Only a generate stage validates a JSON answer: a route or tool_call answering
    stage refuses ``response_format`` even when its engine could constrain decoding."""
    monkeypatch.setattr(Tagged, "response_formats", ("json_object", "json_schema"),
                        raising=False)
    hub = ServingHub([PipelineService(routed()), PipelineService(agent())])
    with running(hub) as u:
        for model in ("routed", "agent"):
            with pytest.raises(openai.BadRequestError) as e:
                client(u).chat.completions.create(model=model, messages=CHAT,
                                                  response_format={"type": "json_object"})
            assert e.value.body["code"] == "unsupported_response_format"
            assert "'response_format' (json_object)" in e.value.body["message"]
    assert bind(compile_pipeline(generated())).response_formats == {"json_object",
                                                                    "json_schema"}
