"""EnginePool: batching across callers, dispatch, retries, restarts, health, shutdown.

The first half runs replicas on threads over a fake backend (fast, exact failure
injection); the second half runs real llama.cpp replica processes (``engine`` mark).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from tailrace.engines import BACKENDS
from tailrace.engines.base import Generation, GenerationRequest
from tailrace.engines.pool import EnginePool, close_pools, get_pool
from tailrace.errors import ContextOverflow, EngineError


class FakeEngine:
    """Upper-cases prompts. Endpoint 'bad' streams a correct prefix then fails every call;
    'broken' cannot be opened; the prompt 'overflow' does not fit."""

    def __init__(self, model: str = "fake", base_url: str | None = None,
                 kind: str = "generate"):
        if base_url == "broken":
            raise EngineError("cannot reach broken")
        self.model, self.base_url, self.context_length, self.dim = model, base_url, 100, 2

    def generate(self, requests, on_token=None):
        if self.base_url == "bad":
            if on_token is not None:
                on_token(0, requests[0].prompt.upper()[:2])
            raise EngineError("bad endpoint")
        out = []
        for i, r in enumerate(requests):
            if r.prompt == "overflow":
                raise ContextOverflow("the prompt does not fit")
            text = r.prompt.upper()
            for ch in text if on_token is not None else ():
                on_token(i, ch)
            out.append(Generation(text, len(r.prompt), len(text), "stop"))
        return out

    def embed(self, texts):
        import numpy as np

        return np.array([[len(t), 1.0] for t in texts], dtype=np.float32)

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(BACKENDS, "fake", (__name__, "FakeEngine", ("generate", "embed")))
    return {"backend": "fake", "model": "fake"}


def prompt(text: str) -> GenerationRequest:
    return GenerationRequest(prompt=text, max_tokens=4)


def run_callers(pool, texts, **kw):
    """Call ``pool.generate`` from one thread per text at once; results or errors by text."""
    barrier, out = threading.Barrier(len(texts)), {}

    def caller(text):
        barrier.wait()
        try:
            out[text] = pool.generate([prompt(text)], **kw)[0].text
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            out[text] = e

    threads = [threading.Thread(target=caller, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize(("kw", "match"), [
    ({"replicas": 0}, "engine pool 'llm' needs at least one replica, got 0"),
    ({"endpoints": []}, "engine pool 'llm' needs at least one replica, got 0"),
    ({"replicas": 1, "endpoints": ["x"]}, "give either replicas=N .* not both or neither"),
    ({}, "give either replicas=N"),
    ({"replicas": 1, "dispatch": "fastest"},
     "unknown dispatch policy 'fastest'; known: least_work, prefix_affinity, round_robin"),
    ({"replicas": 1, "max_batch_size": 0}, "max_batch_size must be an integer >= 1"),
])
def test_bad_configuration_is_one_clear_error(kw, match):
    with pytest.raises(EngineError, match=match):
        EnginePool("llm", {"backend": "llama_cpp", "model": "smollm2-135m-instruct"}, **kw)


def test_calls_before_start_and_after_stop_say_so(fake):
    pool = EnginePool("llm", fake, endpoints=["a"])
    with pytest.raises(EngineError, match="engine pool 'llm' is not started; call start()"):
        pool.generate([prompt("x")])
    pool.start()
    pool.stop()
    pool.stop()  # idempotent
    with pytest.raises(EngineError, match="engine pool 'llm' was stopped"):
        pool.generate([prompt("x")])


def test_concurrent_callers_share_batches_and_get_their_own_results(fake):
    texts = [f"q{i}" for i in range(8)]
    with EnginePool("llm", fake, endpoints=["a", "b"], max_batch_size=4,
                    max_wait_ms=200, max_in_flight=1) as pool:
        assert run_callers(pool, texts) == {t: t.upper() for t in texts}
        assert pool.generate([prompt("x"), prompt("y")]) == [
            Generation("X", 1, 1, "stop"), Generation("Y", 1, 1, "stop")]
        stats = pool.statistics()
    assert stats.shared_batches >= 1 and stats.mean_batch_size > 1
    assert sum(r.requests for r in stats.replicas) == 10 and stats.queued == 0


def test_a_failing_replica_is_retried_elsewhere_without_repeating_streamed_text(fake):
    pieces: list[str] = []
    with EnginePool("llm", fake, endpoints=["bad", "good"], dispatch="round_robin") as pool:
        gen = pool.generate([prompt("abc")], on_token=lambda i, t: pieces.append(t))
        stats = pool.statistics()
    assert gen[0].text == "ABC"
    assert "".join(pieces) == "ABC"  # "AB" streamed by the failed attempt is not repeated
    assert stats.retries == 1 and stats.replicas[0].failures == 1
    assert stats.replicas[0].last_error == "bad endpoint"


def test_retries_are_bounded(fake):
    with EnginePool("llm", fake, endpoints=["bad", "bad"], max_retries=1) as pool, \
            pytest.raises(EngineError, match=r"engine pool 'llm': a call failed 2 times "
                                             r"\(replicas \[0, 1\]\); last error: bad endpoint"):
        pool.generate([prompt("abc")])


def test_a_request_that_does_not_fit_fails_alone_and_is_not_retried(fake):
    with EnginePool("llm", fake, endpoints=["a"], max_wait_ms=200) as pool:
        out = run_callers(pool, ["overflow", "fine"])
        stats = pool.statistics()
    assert out["fine"] == "FINE"
    assert isinstance(out["overflow"], ContextOverflow)
    assert stats.retries == 0 and stats.failed_calls == 1 and stats.shared_batches == 1


def test_embeddings_are_split_back_per_caller(fake):
    with EnginePool("emb", {**fake, "kind": "embed"}, endpoints=["a"], max_wait_ms=50) as pool:
        rows = pool.embed(["a", "bbb"])
        assert rows.tolist() == [[1.0, 1.0], [3.0, 1.0]] and rows.dtype.name == "float32"
        assert pool.embed([]).shape == (0, 2)
        with pytest.raises(EngineError, match="engine pool 'emb' serves embed, not generate"):
            pool.generate([prompt("x")])


def test_a_replica_that_cannot_start_times_out_with_its_last_error(fake):
    pool = EnginePool("llm", fake, endpoints=["a", "broken"], health_timeout_s=0.3)
    with pytest.raises(EngineError, match=r"engine pool 'llm': replica 1 did not become healthy "
                                          r"within 0.3s \(its last error: cannot reach broken\)"):
        pool.start()


def test_get_pool_shares_one_pool_per_name(fake):
    try:
        pool = get_pool("shared", fake, endpoints=["a"])
        assert get_pool("shared", fake) is pool
        with pytest.raises(EngineError, match="engine pool 'shared' already runs"):
            get_pool("shared", {**fake, "model": "other"})
    finally:
        close_pools()
    assert pool.statistics().replicas[0].healthy is False


# -- prefix_affinity over fake replicas that cache prefixes ---------------------------------

class CachingEngine:
    """Remembers every prompt it rendered; reports the longest prefix (4 characters a token)
    it shares with one of them as cached tokens, and its endpoint as ``extra["replica"]``."""

    def __init__(self, model: str = "cache", base_url: str | None = None):
        self.model, self.base_url, self.context_length, self.seen = model, base_url, 10_000, []

    def generate(self, requests, on_token=None):
        out = []
        for r in requests:
            text = "".join(f"<{m['role']}>{m['content']}" for m in r.messages)
            shared = max((len(os.path.commonprefix([text, s])) for s in self.seen), default=0)
            self.seen.append(text)
            out.append(Generation("ok", len(text) // 4, 1, "stop",
                                  {"cached_tokens": shared // 4, "replica": self.base_url}))
        return out

    def close(self):
        pass


@pytest.fixture
def caching(monkeypatch):
    monkeypatch.setitem(BACKENDS, "cache", (__name__, "CachingEngine", ("generate",)))
    return {"backend": "cache", "model": "cache"}


def turn(conv: str, k: int, session: str | None = None) -> GenerationRequest:
    """Turn ``k`` (1-based) of conversation ``conv``: a long system prompt and k-1 exchanges."""
    msgs = [{"role": "system", "content": f"You help {conv}. " * 40}]
    for t in range(1, k + 1):
        msgs.append({"role": "user", "content": f"{conv} asks question {t}. " * 10})
        if t < k:
            msgs.append({"role": "assistant", "content": "ok"})
    return GenerationRequest(messages=tuple(msgs), max_tokens=4, session=session)


def test_prefix_affinity_splits_a_batch_by_where_each_history_lives(caching):
    with EnginePool("llm", caching, endpoints=["r0", "r1"], dispatch="prefix_affinity",
                    max_wait_ms=0) as pool:
        a1, b1 = pool.generate([turn("ann", 1), turn("bob", 1)])  # least work spreads them
        assert {a1.extra["replica"], b1.extra["replica"]} == {"r0", "r1"}
        for k in (2, 3):  # one engine call per caller, split across the replicas
            a, b = pool.generate([turn("ann", k), turn("bob", k)])
            assert (a.extra["replica"], b.extra["replica"]) == (a1.extra["replica"],
                                                                 b1.extra["replica"])
            assert a.extra["cached_tokens"] > 100 and b.extra["cached_tokens"] > 100
        stats = pool.statistics()
    assert stats.batches == 3 and sum(r.calls for r in stats.replicas) == 6


def test_sessions_stick_to_their_replica(caching):
    with EnginePool("llm", caching, endpoints=["r0", "r1"], dispatch="prefix_affinity",
                    max_wait_ms=0) as pool:
        short = lambda s: GenerationRequest(  # noqa: E731 - no shared prefix to follow
            messages=({"role": "user", "content": f"hi from {s}"},), session=s)
        x, y = pool.generate([short("s1"), short("s2")])
        # alone, each would go to r0 (both idle, lower id): s2 stays on its replica
        assert [pool.generate([short("s2")])[0].extra["replica"] for _ in range(3)] == \
            [y.extra["replica"]] * 3
        assert pool.generate([short("s1")])[0].extra["replica"] == x.extra["replica"]
    assert x.extra["replica"] != y.extra["replica"]


def test_pool_statistics_sum_cached_and_prompt_tokens_per_replica(caching):
    outs: dict[str, list[Generation]] = {"r0": [], "r1": []}
    with EnginePool("llm", caching, endpoints=["r0", "r1"], dispatch="prefix_affinity",
                    max_wait_ms=0) as pool:
        for k in (1, 2, 3):
            for g in pool.generate([turn("ann", k), turn("bob", k)]):
                outs[g.extra["replica"]].append(g)
        stats = pool.statistics()
    for r in stats.replicas:
        gens = outs[r.endpoint]
        assert r.prompt_tokens == sum(g.prompt_tokens for g in gens) > 0
        assert r.cached_tokens == sum(g.extra["cached_tokens"] for g in gens) > 0
        assert r.cache_hit_ratio == pytest.approx(r.cached_tokens / r.prompt_tokens)


def test_prefix_affinity_keeps_an_embedding_batch_whole(fake):
    with EnginePool("emb", {**fake, "kind": "embed"}, endpoints=["a", "b"],
                    dispatch="prefix_affinity", max_wait_ms=0) as pool:
        assert pool.embed(["a", "bb", "ccc"]).shape == (3, 2)
        stats = pool.statistics()
    assert [r.calls for r in stats.replicas] == [1, 0]


def test_prefix_affinity_options_are_checked(caching):
    with pytest.raises(EngineError, match="engine pool 'llm': affinity_slack must be an "
                                          "integer >= 0 .*got -5"):
        EnginePool("llm", caching, endpoints=["r0"], dispatch="prefix_affinity",
                   affinity_slack=-5)
    with pytest.raises(EngineError, match="affinity_slack applies to dispatch: "
                                          "prefix_affinity, not 'least_work'"):
        EnginePool("llm", caching, endpoints=["r0"], affinity_slack=10)


# -- real llama.cpp replica processes -------------------------------------------------------

LLAMA = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 1,
         "n_ctx": 512, "n_seq_max": 4}
QUESTIONS = ["What is the capital of France?", "Name a primary colour.",
             "Who wrote Hamlet?", "What is 2 + 2?"]


def chat(text: str, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(messages=({"role": "user", "content": text},),
                             max_tokens=max_tokens)


@pytest.fixture(scope="module")
def reference():
    """Greedy texts from one engine in this process (the expected pool results)."""
    pytest.importorskip("llama_cpp")
    from tailrace.engines.llama_cpp import LlamaCppEngine

    eng = LlamaCppEngine(**{k: v for k, v in LLAMA.items() if k != "backend"})
    try:
        texts = {q: eng.generate([chat(q)])[0].text for q in QUESTIONS}
        texts["long"] = eng.generate([chat(QUESTIONS[0], 64)])[0].text
    finally:
        eng.close()
    return texts


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    """Poll a real process's state (not a timing assertion)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.engine
def test_llama_replicas_serve_concurrent_callers_like_one_engine(reference):
    with EnginePool("llm", LLAMA, replicas=2, max_batch_size=4, max_wait_ms=100) as pool:
        out: dict[str, str] = {}
        barrier = threading.Barrier(len(QUESTIONS))

        def caller(q):
            barrier.wait()
            out[q] = pool.generate([chat(q)])[0].text

        threads = [threading.Thread(target=caller, args=(q,)) for q in QUESTIONS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = pool.statistics()
        pids = {r.pid for r in stats.replicas}
    assert out == {q: reference[q] for q in QUESTIONS}
    assert stats.shared_batches >= 1 and stats.mean_batch_size > 1
    assert len(pids) == 2 and os.getpid() not in pids
    assert multiprocessing.active_children() == []


@pytest.mark.engine
def test_killed_replica_call_completes_on_the_other_and_it_restarts(reference):
    started = threading.Event()
    pieces: list[str] = []

    def on_token(_i, text):
        pieces.append(text)
        started.set()

    with EnginePool("llm", LLAMA, replicas=2, max_wait_ms=0) as pool:
        result: list = []
        caller = threading.Thread(target=lambda: result.append(
            pool.generate([chat(QUESTIONS[0], 64)], on_token=on_token)))
        caller.start()
        assert started.wait(30)
        [victim] = [r for r in pool.statistics().replicas if r.in_flight == 1]
        os.kill(victim.pid, signal.SIGKILL)
        caller.join(60)
        assert result and result[0][0].text == reference["long"]
        assert "".join(pieces) == reference["long"]  # nothing streamed twice
        wait_until(lambda: pool.statistics().replicas[victim.id].healthy)  # restarted
        stats = pool.statistics()
        dead = stats.replicas[victim.id]
        assert dead.failures == 1 and dead.restarts == 1 and dead.pid != victim.pid
        assert stats.retries == 1 and stats.replicas[1 - victim.id].calls == 1
    assert multiprocessing.active_children() == []


@pytest.mark.engine
def test_a_replica_that_never_starts_fails_start_with_the_health_timeout(tmp_path):
    spec = {**LLAMA, "path": str(tmp_path / "missing.gguf")}
    pool = EnginePool("llm", spec, replicas=1, health_timeout_s=5.0)
    with pytest.raises(EngineError, match=r"engine pool 'llm': replica 0 did not become healthy "
                                          r"within 5.0s \(its last error: model file not found"):
        pool.start()
    assert multiprocessing.active_children() == []


@pytest.mark.engine
@pytest.mark.parametrize("dispatch", ["prefix_affinity", "least_work"])
def test_llama_prefix_affinity_keeps_conversations_on_their_cache_and_spreads_them(dispatch):
    """4 conversations, 3 turns, each turn's 4 requests batched together on 2 replicas.
    prefix_affinity: every later turn reads its own history from its replica's cache and
    both replicas work; least_work sends each batch whole to one replica (the control)."""
    pytest.importorskip("llama_cpp")
    names = ["Ada", "Bo", "Cy", "Di"]
    history = {n: [{"role": "system", "content": f"You are {n}'s assistant. " + "Answer in "
                    "one short sentence, politely, and never repeat the question. " * 6}]
               for n in names}
    cached: dict[str, list[int]] = {n: [] for n in names}
    with EnginePool("llm", {**LLAMA, "n_ctx": 1024}, replicas=2, dispatch=dispatch,
                    max_batch_size=4, max_wait_ms=60_000) as pool:
        for t in range(3):
            ask = {"role": "user", "content": f"Question {t + 1}: name a "
                                              f"{['colour', 'fruit', 'city'][t]}."}
            reqs = [GenerationRequest(messages=(*history[n], ask), max_tokens=6) for n in names]
            gens = pool.generate(reqs)  # one caller, one batch of 4 (max_batch_size)
            for n, req, g in zip(names, reqs, gens, strict=True):
                history[n] = [*req.messages, {"role": "assistant", "content": g.text}]
                cached[n].append(g.extra.get("cached_tokens", 0))
        stats = pool.statistics()
    later = [c for n in names for c in cached[n][1:]]
    served = [r.requests for r in stats.replicas]
    assert sum(r.cached_tokens for r in stats.replicas) == sum(sum(c) for c in cached.values())
    if dispatch == "prefix_affinity":
        assert served == [6, 6]  # turn 1 split 2/2 by least work, later turns followed
        assert all(c >= 64 for c in later), cached  # each read its own history (whole chunks)
        assert all(r.cached_tokens > 0 and r.cache_hit_ratio > 0.3 for r in stats.replicas)
    else:
        assert sorted(served) == [0, 12]  # a batch goes whole to one replica


def test_prefix_affinity_lets_a_llama_replica_queue_calls_per_sequence():
    # one call per request: the call cap follows n_seq_max (else the cap sends requests
    # away from their cached prefix while the slack would keep them)
    spec = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_seq_max": 6}
    caps = lambda **kw: [r.max_in_flight for r in EnginePool(  # noqa: E731
        "llm", spec, replicas=2, **kw)._replicas]
    assert caps(dispatch="prefix_affinity") == [24, 24]
    assert caps() == [4, 4] and caps(dispatch="prefix_affinity", max_in_flight=2) == [2, 2]


class OrderEngine(FakeEngine):
    """Records the prompts of each call, in the order calls arrive."""

    CALLS: list = []

    def generate(self, requests, on_token=None):
        OrderEngine.CALLS.append([r.prompt for r in requests])
        return super().generate(requests, on_token)


def test_the_batcher_sends_the_most_urgent_requests_first(monkeypatch):
    monkeypatch.setitem(BACKENDS, "order", (__name__, "OrderEngine", ("generate",)))
    OrderEngine.CALLS.clear()
    pool = EnginePool("urgent", {"backend": "order", "model": "fake"}, replicas=1,
                      isolation="thread", max_batch_size=1, max_wait_ms=0, max_in_flight=1)
    pool.start()
    try:
        reqs = [GenerationRequest(prompt="batch-a", max_tokens=4),
                GenerationRequest(prompt="batch-b", max_tokens=4),
                GenerationRequest(prompt="chat", max_tokens=4, priority=2, deadline=1.0)]
        got = pool.generate(reqs)
    finally:
        pool.stop()
    assert [g.text for g in got] == ["BATCH-A", "BATCH-B", "CHAT"]  # results in order
    assert OrderEngine.CALLS == [["chat"], ["batch-a"], ["batch-b"]]


# -- one batcher per engine kind: an engine that batches its calls itself gets no window -----

class ContinuousEngine(FakeEngine):
    """The fake engine, declaring that it batches concurrent generate calls itself (as
    llama.cpp's decode loop and a remote server do); prompts starting "hold" wait for
    ``RELEASE``; every call's prompts are recorded in ``CALLS``."""

    continuous_batching = frozenset({"generate"})
    CALLS: list = []
    RELEASE = threading.Event()

    def generate(self, requests, on_token=None):
        if requests[0].prompt.startswith("hold"):
            assert ContinuousEngine.RELEASE.wait(30)
        ContinuousEngine.CALLS.append([r.prompt for r in requests])
        return super().generate(requests, on_token)


@pytest.fixture
def continuous(monkeypatch):
    monkeypatch.setitem(BACKENDS, "continuous", (__name__, "ContinuousEngine",
                                                 ("generate", "embed")))
    ContinuousEngine.CALLS.clear()
    ContinuousEngine.RELEASE.clear()
    yield {"backend": "continuous", "model": "fake"}
    ContinuousEngine.RELEASE.set()


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """Call ``fn(*args)`` on a thread of its own; its result (or error) lands in the list."""
    out: list = []

    def call():
        try:
            out.append(fn(*args))
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    return t, out


def test_the_engine_says_who_batches_its_calls():
    from tailrace.engines.models import batches_continuously

    assert batches_continuously({"backend": "llama_cpp"}, "generate")
    assert batches_continuously({"backend": "openai"}, "generate")  # the remote server
    assert not batches_continuously({"backend": "openai", "kind": "embed"}, "embed")
    assert not batches_continuously({"backend": "onnx"}, "embed")
    assert not batches_continuously({"backend": "nope"}, "generate")


def test_a_generation_request_to_an_engine_that_batches_itself_waits_for_no_window(continuous):
    """The pool's clock never moves: a request held for a batch window would never go out
    (the embedding request below shows it), one for an engine that batches continuously
    goes out at once."""
    with EnginePool("llm", continuous, replicas=1, isolation="thread",
                    clock=lambda: 0.0) as pool:
        caller, out = in_thread(pool.generate, [prompt("now")])
        caller.join(30)
        assert out == [[Generation("NOW", 3, 3, "stop")]]
        assert pool.statistics().queued == 0
    with EnginePool("emb", {**continuous, "kind": "embed"}, replicas=1, isolation="thread",
                    clock=lambda: 0.0) as pool:
        caller, out = in_thread(pool.embed, ["abc"])
        wait_until(lambda: pool.statistics().queued == 1)
        assert caller.is_alive() and out == []  # embeddings: the pool is their batcher
        assert pool.statistics().batches == 0
    caller.join(30)
    assert isinstance(out[0], EngineError)  # the pool stopped with it still waiting


def test_embeddings_still_wait_for_the_pools_window(continuous):
    now = [0.0]
    with EnginePool("emb", {**continuous, "kind": "embed"}, replicas=1, isolation="thread",
                    max_batch_size=4, clock=lambda: now[0]) as pool:
        callers = [in_thread(pool.embed, [t]) for t in ("a", "bb")]
        wait_until(lambda: pool.statistics().queued == 2)
        assert pool.statistics().batches == 0  # 2 ms not passed: both wait
        now[0] = 0.002  # the window (default 2 ms) ends: one call for both callers
        for t, _ in callers:
            t.join(30)
        stats = pool.statistics()
    assert [out[0].tolist() for _, out in callers] == [[[1.0, 1.0]], [[2.0, 1.0]]]
    assert stats.batches == 1 and stats.shared_batches == 1


def test_a_window_set_on_such_a_pool_is_kept(continuous):
    now = [0.0]
    with EnginePool("llm", continuous, replicas=1, isolation="thread", max_wait_ms=5,
                    clock=lambda: now[0]) as pool:
        caller, out = in_thread(pool.generate, [prompt("later")])
        wait_until(lambda: pool.statistics().queued == 1)
        assert out == []
        now[0] = 0.005
        caller.join(30)
    assert out == [[Generation("LATER", 5, 5, "stop")]]


def test_without_a_window_waiting_requests_still_go_most_urgent_class_first(continuous):
    """Requests that wait for a replica (its one call slot taken) share a call, one class a
    call, the most urgent first (a call's answers come back together)."""
    with EnginePool("llm", continuous, replicas=1, isolation="thread", max_in_flight=1,
                    clock=lambda: 0.0) as pool:
        busy, _ = in_thread(pool.generate, [prompt("hold")])
        wait_until(lambda: pool.statistics().replicas[0].in_flight == 1)
        lax = [in_thread(pool.generate, [prompt(t)]) for t in ("lax-a", "lax-b")]
        wait_until(lambda: pool.statistics().queued == 2)
        urgent, out = in_thread(pool.generate, [GenerationRequest(
            prompt="urgent", max_tokens=4, priority=2, deadline=1.0)])
        wait_until(lambda: pool.statistics().queued == 3)
        ContinuousEngine.RELEASE.set()
        for t in (busy, urgent, *(t for t, _ in lax)):
            t.join(30)
    assert out[0][0].text == "URGENT"
    assert ContinuousEngine.CALLS == [["hold"], ["urgent"], ["lax-a", "lax-b"]]
