"""The latency-model engine server (bench/latency_server.py): OpenAI wire format, the timing
model, FIFO admission, stats and flag validation. Light: a loopback server, small token
counts, tolerant timing bounds (behavioural checks, not benchmarks)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

_PATH = Path(__file__).resolve().parents[2] / "bench" / "latency_server.py"
_spec = importlib.util.spec_from_file_location("latency_server", _PATH)
assert _spec is not None and _spec.loader is not None
ls = sys.modules.get("latency_server") or importlib.util.module_from_spec(_spec)
if "latency_server" not in sys.modules:
    sys.modules["latency_server"] = ls
    _spec.loader.exec_module(ls)


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key="not-needed", timeout=10, max_retries=0)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def test_url_and_models_and_healthz():
    with ls.start_server(ls.LatencyConfig(model="lm")) as srv:
        assert srv.url == f"http://127.0.0.1:{srv.port}/v1"
        assert [m.id for m in client(srv).models.list().data] == ["lm"]
        assert get_json(srv.root + "/healthz") == {"status": "ok"}
    assert not srv.running


def test_chat_non_streaming_returns_max_tokens_filler_and_usage():
    with ls.start_server(ls.LatencyConfig(decode_tps=2000)) as srv:
        prompt = "hello there, latency model"
        r = client(srv).chat.completions.create(model="any", messages=user(prompt),
                                                max_tokens=8)
        assert r.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 8
        assert r.usage.prompt_tokens == len(prompt) // 4 + 1
        assert r.usage.total_tokens == r.usage.prompt_tokens + 8
        c = client(srv).completions.create(model="any", prompt="abcdefgh", max_tokens=3)
        assert (c.choices[0].text, c.usage.prompt_tokens, c.usage.completion_tokens) == (
            "tok0 tok1 tok2", 3, 3)


def test_len_marker_overrides_length_capped_by_max_tokens():
    with ls.start_server(ls.LatencyConfig(decode_tps=2000)) as srv:
        c = client(srv)
        short = c.chat.completions.create(model="m", messages=user("q [[len=3]]"),
                                          max_tokens=20)
        assert short.choices[0].message.content == "tok0 tok1 tok2"
        assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("stop", 3)
        capped = c.chat.completions.create(model="m", messages=user("q [[len=50]]"),
                                           max_tokens=4)
        assert (capped.choices[0].finish_reason, capped.usage.completion_tokens) == (
            "length", 4)
        # only the last message counts
        msgs = [{"role": "system", "content": "[[len=2]]"}, {"role": "user", "content": "q"}]
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=5)
        assert r.usage.completion_tokens == 5


def test_streaming_yields_token_chunks_then_finish_usage_and_done():
    with ls.start_server(ls.LatencyConfig(decode_tps=1000)) as srv:
        stream = client(srv).chat.completions.create(
            model="m", messages=user("hi"), max_tokens=6, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        pieces = [ch.choices[0].delta.content for ch in chunks
                  if ch.choices and ch.choices[0].delta.content]
        assert pieces == ["tok0", " tok1", " tok2", " tok3", " tok4", " tok5"]
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

        texts = [ch.choices[0].text for ch in client(srv).completions.create(
            model="m", prompt="p", max_tokens=3, stream=True)]
        assert "".join(texts) == "tok0 tok1 tok2" and len(texts) == 4

        # the raw wire: SSE events, the last one "data: [DONE]"
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "p", "max_tokens": 2, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.getheader("content-type").startswith("text/event-stream")
        events = [e for e in resp.read().decode().split("\n\n") if e]
        conn.close()
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_timing_follows_the_model():
    cfg = ls.LatencyConfig(decode_tps=200, prefill_tps=1000, batch_slowdown=0.0)
    with ls.start_server(cfg) as srv:
        c = client(srv)
        c.completions.create(model="m", prompt="warm", max_tokens=1)
        t0 = time.perf_counter()
        c.chat.completions.create(model="m", messages=user("x"), max_tokens=20)  # 20 / 200
        decode = time.perf_counter() - t0
        t0 = time.perf_counter()
        c.completions.create(model="m", prompt="a" * 396, max_tokens=0)  # 100 / 1000
        prefill = time.perf_counter() - t0
    assert 0.08 <= decode <= 0.5, decode
    assert 0.08 <= prefill <= 0.5, prefill



def test_jitter_spreads_token_times_within_bounds():
    # 20 tokens at 200 tok/s = 0.1 s; each token time is scaled by 1 + U(-0.5, 0.5)
    with ls.start_server(ls.LatencyConfig(decode_tps=200, jitter=0.5, seed=7)) as srv:
        c = client(srv)
        t0 = time.perf_counter()
        r = c.chat.completions.create(model="m", messages=user("x"), max_tokens=20)
        took = time.perf_counter() - t0
    assert r.usage.completion_tokens == 20
    assert 0.05 <= took <= 0.5, took

def run_concurrently(srv, n: int, max_tokens: int) -> list[float]:
    """``n`` chat requests at once; each one's seconds to answer."""
    c = client(srv)
    took = [0.0] * n

    def one(i: int) -> None:
        t0 = time.perf_counter()
        c.chat.completions.create(model="m", messages=user(f"r{i}"), max_tokens=max_tokens)
        took[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return took


def test_max_seqs_queues_fifo_and_healthz_answers_while_saturated():
    # 10 tokens at 25 tok/s = 0.4 s a request; 4 requests on 2 slots = 2 waves, ~0.8 s.
    # The checks are behavioural (peaks, counts, what /stats showed around /healthz); the
    # only time bound is the physical lower one, which load cannot break.
    cfg = ls.LatencyConfig(decode_tps=25, batch_slowdown=0.0, max_seqs=2)
    with ls.start_server(cfg) as srv:
        seen: dict = {}

        def watch() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s = get_json(srv.root + "/stats")
                if s["active"] == 2 and s["queued"] == 2:
                    seen["health"] = get_json(srv.root + "/healthz")
                    seen["after"] = get_json(srv.root + "/stats")
                    return
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        t0 = time.perf_counter()
        took = run_concurrently(srv, 4, max_tokens=10)
        wall = time.perf_counter() - t0
        watcher.join(15)
        stats = srv.stats()
    assert len(took) == 4 and wall >= 0.7, (wall, took)  # two waves cannot overlap
    assert stats["peak_active"] == 2 and stats["peak_queued"] == 2
    assert (stats["served"], stats["active"], stats["queued"]) == (4, 0, 0)
    # /healthz answered while both slots were held, not after the queue drained
    assert seen.get("health") == {"status": "ok"}, seen
    assert seen["after"]["served"] < 4, seen


def test_batch_slowdown_stretches_concurrent_sequences():
    # alone 10 / 100 = 0.1 s; two together at slowdown 1.0: each token twice as long, ~0.2 s
    cfg = ls.LatencyConfig(decode_tps=100, batch_slowdown=1.0, max_seqs=4)
    with ls.start_server(cfg) as srv:
        took = run_concurrently(srv, 2, max_tokens=10)
    assert all(0.17 <= t <= 0.6 for t in took), took


def test_client_disconnect_frees_the_slot():
    with ls.start_server(ls.LatencyConfig(decode_tps=20, max_seqs=1)) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": user("x"), "max_tokens": 100, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        conn.close()
        deadline = time.monotonic() + 5
        while srv.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = srv.stats()
        assert (stats["active"], stats["cancelled"], stats["served"]) == (0, 1, 0)
        r = client(srv).completions.create(model="m", prompt="p", max_tokens=1)
        assert r.usage.completion_tokens == 1
        srv.reset_stats()
        assert srv.stats()["received"] == 0


def test_bad_requests_answer_400_in_openai_format():
    with ls.start_server() as srv:
        c = client(srv)
        with pytest.raises(openai.BadRequestError, match="only n=1"):
            c.chat.completions.create(model="m", messages=user("x"), max_tokens=1, n=2)
        with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
            c.chat.completions.create(model="m", messages=[], max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="'max_tokens' must be a non-negative"):
            c.completions.create(model="m", prompt="x", max_tokens=-1)
        assert srv.stats()["rejected"] == 3


def test_tailrace_openai_engine_against_it():
    from tailrace.engines.base import GenerationRequest
    from tailrace.engines.openai import OpenAIEngine

    with ls.start_server(ls.LatencyConfig(decode_tps=1000)) as srv:
        engine = OpenAIEngine(srv.url, "latency-model", retries=0)
        try:
            pieces: list[str] = []
            gens = engine.generate(
                [GenerationRequest(messages=({"role": "user", "content": "a [[len=2]]"},),
                                   max_tokens=8),
                 GenerationRequest(prompt="abcd", max_tokens=3)],
                on_token=lambda i, p: pieces.append(p))
        finally:
            engine.close()
    assert [(g.text, g.completion_tokens, g.finish_reason) for g in gens] == [
        ("tok0 tok1", 2, "stop"), ("tok0 tok1 tok2", 3, "length")]
    assert gens[1].prompt_tokens == 2 and gens[0].extra["usage"] == "server"
    assert len(pieces) == 5


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"decode_tps": 0}, "--decode-tps must be > 0, got 0"),
    ({"prefill_tps": -1.0}, "--prefill-tps must be > 0, got -1.0"),
    ({"batch_slowdown": -0.1}, "--batch-slowdown must be >= 0, got -0.1"),
    ({"max_seqs": 0}, "--max-seqs must be >= 1, got 0"),
    ({"jitter": 1.0}, "--jitter must be in [0, 1), got 1.0"),
    ({"decode_tps": float("inf")}, "--decode-tps must be finite, got inf"),
])
def test_bad_config_rejected(kwargs, message):
    with pytest.raises(ValueError) as err:
        ls.LatencyConfig(**kwargs)
    assert str(err.value) == message


def test_bad_flags_rejected_by_the_cli(capsys):
    with pytest.raises(SystemExit) as exit_:
        ls.main(["--decode-tps", "0", "--port", "0"])
    assert exit_.value.code == 2
    assert "latency_server.py: error: --decode-tps must be > 0, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ls.main(["--max-seqs", "two"])
    assert "--max-seqs: invalid int value: 'two'" in capsys.readouterr().err


def test_spawn_runs_it_as_a_subprocess():
    with ls.spawn(ls.LatencyConfig(decode_tps=1000, max_seqs=3, model="sub")) as srv:
        assert srv.proc.poll() is None
        r = client(srv).completions.create(model="sub", prompt="p", max_tokens=4)
        assert r.choices[0].text == "tok0 tok1 tok2 tok3"
        stats = srv.stats()
        assert stats["served"] == 1 and stats["config"]["max_seqs"] == 3
    assert srv.proc.returncode == 0
