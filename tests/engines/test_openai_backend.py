"""The openai backend against a real OpenAI-compatible server: llama-cpp-python's own server
running SmolLM2-135M-Instruct on a free loopback port (no mocked client)."""

from __future__ import annotations

import importlib.util
import re
import time

import pytest

from tailrace.engines import model_info, model_path
from tailrace.engines.base import GenerationRequest
from tailrace.engines.openai import OpenAIEngine
from tailrace.errors import ContextOverflow, EngineError

from .llama_server import free_port, llama_server

pytestmark = pytest.mark.engine

MODEL = "smollm2-135m-instruct"
N_CTX = 1024
URL = r"http://127\.0\.0\.1:\d+/v1"

for _module, _install in (("openai", "pip install openai"),
                          ("llama_cpp", "pip install 'llama-cpp-python[server]'"),
                          ("fastapi", "pip install 'llama-cpp-python[server]'")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs the '{_module}' package ({_install})", allow_module_level=True)


def chat(text: str, max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(messages=({"role": "user", "content": text},),
                             max_tokens=max_tokens, temperature=0.0)


@pytest.fixture(scope="module")
def gguf():
    try:
        return model_path(model_info(MODEL, "llama_cpp"))
    except EngineError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def server(gguf):
    # --interrupt_requests false: by default the server ends a running stream early (a bare
    # [DONE], no finish reason) as soon as another request waits, which breaks batches
    with llama_server(gguf, "--model_alias", MODEL, "--interrupt_requests", "false",
                      n_ctx=N_CTX) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(server):
    eng = OpenAIEngine(server.base_url, MODEL, timeout_s=30, retries=0,
                       context_length=N_CTX, concurrency=4)
    yield eng
    eng.close()


def test_chat_greedy_gives_text_and_the_servers_token_counts(engine):
    """Greedy chat through the engine (streamed) matches the server's non-streamed answer."""
    gen = engine.generate([chat("Say hi to Ada.")])[0]
    ref = engine._client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi to Ada."}],
        max_tokens=12, temperature=0.0)
    assert gen.text.strip()
    assert gen.text == ref.choices[0].message.content
    assert gen.finish_reason == ref.choices[0].finish_reason
    assert gen.completion_tokens == ref.usage.completion_tokens > 0
    if gen.extra["usage"] == "server":
        assert gen.prompt_tokens == ref.usage.prompt_tokens
    else:  # llama-cpp-python 0.3 ignores stream_options: the prompt's text is counted
        assert gen.extra["usage"] == "estimated"
        assert gen.prompt_tokens == engine.count_tokens("Say hi to Ada.") > 0


def test_streamed_pieces_make_the_final_text(engine):
    pieces: list[tuple[int, str]] = []
    gen = engine.generate([chat("Name three colours.", max_tokens=16)],
                          on_token=lambda i, piece: pieces.append((i, piece)))[0]
    assert len(pieces) > 1
    assert {i for i, _ in pieces} == {0}
    assert "".join(p for _, p in pieces) == gen.text
    assert gen.extra["streamed"] is True


def test_completion_request_ends_at_the_stop_string(engine):
    gen = engine.generate([GenerationRequest(prompt="Count: 1, 2, 3, 4, 5,", max_tokens=24,
                                             stop=(" 8",))])[0]
    assert gen.text == " 6, 7,"
    assert gen.finish_reason == "stop"
    unstopped = engine.generate([GenerationRequest(prompt="Count: 1, 2, 3, 4, 5,",
                                                   max_tokens=8)])[0]
    assert unstopped.text.startswith(" 6, 7, 8")
    assert unstopped.finish_reason == "length" and unstopped.completion_tokens == 8


def test_a_batch_of_three_completes_in_request_order(engine):
    requests = [chat(f"What is {n} plus {n}?", max_tokens=8) for n in (2, 3, 4)]
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    gens = engine.generate(requests, on_token=lambda i, piece: pieces[i].append(piece))
    assert len(gens) == 3
    for i, gen in enumerate(gens):
        assert gen.text and "".join(pieces[i]) == gen.text
        assert gen.text == engine.generate([requests[i]])[0].text  # greedy: same alone


def test_count_tokens_uses_the_servers_tokenizer(engine):
    assert engine.count_tokens("hello world") == 2
    assert engine.tokenizer == "/extras/tokenize"
    assert engine.count_tokens(" ".join(["word"] * 100)) == 100


@pytest.mark.parametrize("request_", [
    chat("word " * 1500, max_tokens=8),
    GenerationRequest(prompt="word " * 1500, max_tokens=8),
], ids=["chat", "completion"])
def test_a_prompt_longer_than_the_servers_context_is_context_overflow(engine, request_):
    """llama-cpp-python answers a streamed over-long request 200 with an empty event stream;
    the engine asks again without streaming and gets the real 400 context_length_exceeded."""
    with pytest.raises(ContextOverflow, match=(
            rf"^openai engine at {URL} \(model '{MODEL}'\): prompt does not fit the context "
            rf"window \(server 400: This model's maximum context length is {N_CTX} tokens[,.] "
            r"[Hh]owever,? you requested \d+ tokens")):
        engine.generate([request_])


def test_one_overflowing_request_fails_the_whole_batch(engine):
    with pytest.raises(ContextOverflow):
        engine.generate([chat("Say hi.", max_tokens=4), chat("word " * 1500, max_tokens=4)])


def test_a_read_timeout_is_an_engine_error(server):
    """A 400-token prompt takes the server longer than 50 ms to prefill."""
    eng = OpenAIEngine(server.base_url, MODEL, timeout_s=0.05, retries=0)
    try:
        with pytest.raises(EngineError, match=(
                rf"^openai engine at {URL} \(model '{MODEL}'\): request timed out after "
                r"0\.05s$")):
            eng.generate([GenerationRequest(prompt="word " * 400, max_tokens=2)])
    finally:
        eng.close()


def test_an_unreachable_server_fails_fast_with_a_clear_message():
    port = free_port()  # nobody listens there
    eng = OpenAIEngine(f"http://127.0.0.1:{port}/v1", "nobody", timeout_s=2, retries=0)
    start = time.monotonic()
    try:
        with pytest.raises(EngineError, match="^" + re.escape(
                f"openai engine at http://127.0.0.1:{port}/v1 (model 'nobody'): cannot "
                "connect ([Errno 111] Connection refused)") + "$"):
            eng.generate([chat("hi")])
    finally:
        eng.close()
    assert time.monotonic() - start < 2


def test_the_wrong_kind_is_refused_without_a_request():
    eng = OpenAIEngine("http://127.0.0.1:9/v1", "m", kind="embed")
    with pytest.raises(EngineError, match="created with kind='embed' and cannot generate"):
        eng.generate([chat("hi")])
    eng.close()
    with pytest.raises(EngineError, match="engine is closed"):
        eng.embed(["x"])


def test_api_key_env_must_be_set(monkeypatch):
    monkeypatch.delenv("TAILRACE_TEST_NO_KEY", raising=False)
    with pytest.raises(EngineError, match="'TAILRACE_TEST_NO_KEY' .* is not set"):
        OpenAIEngine("http://127.0.0.1:9/v1", "m", api_key_env="TAILRACE_TEST_NO_KEY")


@pytest.fixture(scope="module")
def embed_server(gguf):
    with llama_server(gguf, "--model_alias", MODEL, "--embedding", "true", n_ctx=N_CTX) as srv:
        yield srv


def test_embeddings_are_normalised_float32_rows(embed_server):
    """``--embedding true`` works with this chat model, but SmolLM2's GGUF has no pooling type,
    so the server returns one vector per token, and for every input of a batch but the first
    they are misaligned (llama-cpp-python 0.3.36). The engine mean-pools and falls back to one
    text per request; identical texts must therefore get identical rows."""
    np = pytest.importorskip("numpy")
    eng = OpenAIEngine(embed_server.base_url, MODEL, kind="embed", timeout_s=30, retries=0)
    try:
        texts = ["the cat sat on the mat", "stock prices fell sharply", "the cat sat on the mat"]
        vecs = eng.embed(texts)
        assert vecs.shape == (3, 576) and vecs.dtype == np.float32
        assert eng.dim == 576 and eng.pooling == "client-mean"
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(vecs[0], vecs[2], atol=1e-5)
        assert float(vecs[0] @ vecs[1]) < 0.999
        np.testing.assert_allclose(eng.embed(texts[:1])[0], vecs[0], atol=1e-5)
        assert eng.embed([]).shape == (0, 576)
    finally:
        eng.close()


def test_a_caller_that_stops_a_stream_stops_the_server_too():
    """``on_token`` returning False stops that request: finish 'cancelled', the connection
    closes, and the server stops generating (bench/latency_server.py counts it cancelled)
    instead of decoding the other ~1000 tokens for nobody."""
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(path))
    try:
        import latency_server as ls
    finally:
        sys.path.remove(str(path))
    with ls.start_server(ls.LatencyConfig(decode_tps=200, prefill_tps=1e6)) as srv:
        eng = OpenAIEngine(srv.url, "latency-model", timeout_s=30, retries=0)
        try:
            seen: list[str] = []

            def on_token(i: int, piece: str) -> bool:
                seen.append(piece)
                return len(seen) < 3

            (g,) = eng.generate([chat("go", max_tokens=1000)], on_token)
            assert g.finish_reason == "cancelled" and len(seen) == 3
            assert g.text == "tok0 tok1 tok2"
            deadline = time.monotonic() + 30
            while srv.stats()["cancelled"] == 0:  # the server saw the client leave
                assert time.monotonic() < deadline, srv.stats()
                time.sleep(0.02)
            assert srv.stats()["served"] == 0
        finally:
            eng.close()
