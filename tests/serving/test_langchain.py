"""LangChain's ``ChatOpenAI`` and ``OpenAIEmbeddings`` (langchain-openai, a test
dependency) against a live ``tailrace serve``: multi-turn plain and streamed, its
options reaching the engine, what cannot be honoured a 400, embeddings equal to the
pipeline's own; and one multi-turn conversation on the real llama.cpp model."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tailrace.serving import PipelineService, ServingHub
from tests.serving import fakes
from tests.serving.server import running
from tests.serving.test_conversations import chat_pipeline
from tests.serving.test_embeddings import embed_pipeline, stage_vector

lc = pytest.importorskip("langchain_openai")
messages = pytest.importorskip("langchain_core.messages")

CONVERSATION = [
    messages.SystemMessage("Client system."),
    messages.HumanMessage("My name is Ada."),
    messages.AIMessage("Hello Ada."),
    messages.HumanMessage("What is my name?"),
]
SENT = [
    {"role": "system", "content": "Stage system.\n\nClient system."},
    {"role": "user", "content": "My name is Ada."},
    {"role": "assistant", "content": "Hello Ada."},
    {"role": "user", "content": "CONTEXT: facts\nQ: What is my name?"},
]


@pytest.fixture(scope="module")
def url():
    pytest.importorskip("onnxruntime")
    with pytest.MonkeyPatch.context() as mp:
        fakes.register_echo(mp)
        hub = ServingHub([PipelineService(chat_pipeline()),
                          PipelineService(chat_pipeline("slow", delay=0.02)),
                          PipelineService(embed_pipeline())])
        with running(hub) as u:
            yield u


def chat_model(url: str, model: str = "chat", **kw) -> lc.ChatOpenAI:
    return lc.ChatOpenAI(base_url=url + "/v1", api_key="none", model=model, max_retries=0,
                         **kw)


def test_a_conversation_reaches_the_engine_whole(url):
    reply = chat_model(url).invoke(CONVERSATION)
    assert list(fakes.EchoEngine.REQUESTS[-1].messages) == SENT
    assert reply.content == "CONTEXT: facts Q: What is my name?"  # the echo's words
    assert reply.response_metadata["finish_reason"] == "stop"
    usage = reply.usage_metadata
    assert usage["output_tokens"] == 7 and usage["total_tokens"] == usage["input_tokens"] + 7


def test_streamed_conversation_comes_in_pieces(url):
    pieces = [c.content for c in chat_model(url, model="slow").stream(CONVERSATION)]
    assert list(fakes.EchoEngine.REQUESTS[-1].messages) == SENT
    assert sum(1 for p in pieces if p) >= 2  # a word each 20 ms: not all in one read
    assert "".join(pieces) == "CONTEXT: facts Q: What is my name?"


def test_its_options_reach_the_engine(url):
    chat_model(url, max_tokens=3, temperature=0.7, top_p=0.9, seed=7, stop=["zz"],
               presence_penalty=0.5, frequency_penalty=0.25).invoke("a b c d e")
    got = fakes.EchoEngine.REQUESTS[-1]
    assert (got.max_tokens, got.temperature, got.top_p, got.seed) == (3, 0.7, 0.9, 7)
    assert (got.presence_penalty, got.frequency_penalty, got.stop) == (0.5, 0.25, ("zz",))


def test_what_cannot_be_honoured_is_a_400(url):
    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    with pytest.raises(openai.BadRequestError, match="'tools'"):
        chat_model(url).bind_tools([lookup]).invoke("Where is Paris?")
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        chat_model(url, n=2).invoke("hi")


def test_embeddings_equal_the_pipelines_own(url):
    emb = lc.OpenAIEmbeddings(base_url=url + "/v1", api_key="none", model="emb",
                              check_embedding_ctx_length=False, max_retries=0)
    texts = ["Paris is the capital of France.", "short"]
    vecs = emb.embed_documents(texts)
    for text, v in zip(texts, vecs, strict=True):
        np.testing.assert_allclose(np.asarray(v, dtype=np.float32), stage_vector(url, text),
                                   atol=1e-6)
    assert len(emb.embed_query("a question")) == len(vecs[0]) == 384


@pytest.mark.engine
def test_multi_turn_on_the_real_model():
    from tests.serving.test_llama_conversations import chat_pipeline as llama_chat

    with running(ServingHub([PipelineService(llama_chat())])) as u:
        model = chat_model(u, max_tokens=16, seed=3)
        history = [messages.HumanMessage("Hello, my name is Zorblax the Third."),
                   messages.AIMessage("Nice to meet you, Zorblax the Third!"),
                   messages.HumanMessage("What is my name?")]
        alone = model.invoke(history[-1:])
        turns = model.invoke(history)
        streamed = "".join(c.content for c in model.stream(history))
    # the model read the earlier turns: its prompt grew by at least their text
    assert turns.usage_metadata["input_tokens"] >= alone.usage_metadata["input_tokens"] + 15
    assert turns.content and streamed == turns.content  # greedy: the same answer streamed
