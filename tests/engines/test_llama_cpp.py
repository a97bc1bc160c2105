"""LlamaCppEngine on the real SmolLM2-135M / Gemma3-270M GGUF models (llama-cpp-python).

One engine (n_seq_max=4) is shared by the module; greedy decoding is deterministic, so
batched multi-sequence results must equal the same requests run one at a time.
"""

from __future__ import annotations

import threading
import time

import pytest

from tailrace.engines.base import GenerationEngine, GenerationRequest
from tailrace.engines.llama_cpp import LlamaCppEngine
from tailrace.engines.llama_cpp.sampling import TextStream
from tailrace.errors import ContextOverflow, EngineError

pytestmark = pytest.mark.engine

FRANCE = ({"role": "user", "content": "What is the capital of France?"},)
#: greedy continuation of FRANCE with max_tokens=16 (observed once, then pinned)
FRANCE_GREEDY = "L'Étoile, la Marseillaise, la femme au"

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Explain photosynthesis in one sentence.",
             "Who wrote Hamlet?", "Translate 'good morning' to Spanish."]


def chat(text: str, max_tokens: int = 16, **kw) -> GenerationRequest:
    return GenerationRequest(messages=({"role": "user", "content": text},),
                             max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def engine():
    eng = LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=512, n_seq_max=4)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def one_at_a_time(engine):
    """Each of QUESTIONS generated alone (the reference for batched runs)."""
    return [engine.generate([chat(q)])[0] for q in QUESTIONS]


def test_engine_attributes(engine):
    assert isinstance(engine, GenerationEngine)
    assert engine.model == "smollm2-135m-instruct"
    assert engine.context_length == 512  # per sequence, each of the 4 has its own
    assert engine.chat is True and engine.default_stop == ()


def test_greedy_chat_is_pinned_and_repeatable(engine):
    req = GenerationRequest(messages=FRANCE, max_tokens=16)
    first = engine.generate([req])[0]
    assert first.text == FRANCE_GREEDY
    assert (first.finish_reason, first.completion_tokens) == ("length", 16)
    assert first.prompt_tokens > 10
    assert engine.generate([req])[0] == first


def test_concurrent_requests_equal_sequential(engine, one_at_a_time):
    batched = engine.generate([chat(q) for q in QUESTIONS[:4]])
    assert [g.text for g in batched] == [g.text for g in one_at_a_time[:4]]
    assert batched == one_at_a_time[:4]  # token counts and finish reasons too
    assert len({g.text for g in batched}) == 4


def test_more_requests_than_sequences_refill_slots(engine, one_at_a_time):
    assert len(QUESTIONS) > engine.n_seq_max
    batched = engine.generate([chat(q) for q in QUESTIONS])
    assert batched == one_at_a_time
    # mixed lengths: short ones free their slots early while long ones continue
    mixed = [chat(q, max_tokens=m) for q, m in zip(QUESTIONS, [3, 16, 1, 16, 5, 16],
                                                    strict=True)]
    got = engine.generate(mixed)
    for g, ref, m in zip(got, one_at_a_time, [3, 16, 1, 16, 5, 16], strict=True):
        assert g.completion_tokens <= m
        assert ref.text.startswith(g.text)


def test_streaming_pieces_make_up_the_text(engine):
    pieces: dict[int, list[str]] = {0: [], 1: []}
    stamps: list[float] = []

    def on_token(i: int, piece: str) -> None:
        pieces[i].append(piece)
        stamps.append(time.perf_counter())

    reqs = [chat(QUESTIONS[0], max_tokens=16), chat(QUESTIONS[3], max_tokens=24)]
    out = engine.generate(reqs, on_token=on_token)
    end = time.perf_counter()
    for i, g in enumerate(out):
        assert "".join(pieces[i]) == g.text
        assert len(pieces[i]) > 5  # streamed token by token, not at the end
    assert stamps[0] < end - 0.05  # the first piece came well before the batch ended


def test_stop_string_cuts_text_and_is_not_streamed(engine):
    streamed: list[str] = []
    req = GenerationRequest(messages=FRANCE, max_tokens=16, stop=("Marseillaise",))
    g = engine.generate([req], on_token=lambda i, p: streamed.append(p))[0]
    assert g.text == "L'Étoile, la "
    assert g.finish_reason == "stop" and g.completion_tokens < 16
    assert "".join(streamed) == g.text
    # a stop string whose prefix appears but never completes: held back, then released
    streamed.clear()
    req = GenerationRequest(messages=FRANCE, max_tokens=16, stop=(", la Zebra",))
    g = engine.generate([req], on_token=lambda i, p: streamed.append(p))[0]
    assert g.text == FRANCE_GREEDY and "".join(streamed) == FRANCE_GREEDY


def test_max_tokens_finishes_with_length(engine):
    g = engine.generate([chat(QUESTIONS[3], max_tokens=5)])[0]
    assert (g.finish_reason, g.completion_tokens) == ("length", 5)
    assert g.text and engine.count_tokens(g.text) <= 6
    zero = engine.generate([chat(QUESTIONS[3], max_tokens=0)])[0]
    assert (zero.text, zero.completion_tokens, zero.finish_reason) == ("", 0, "length")


def test_sampling_with_a_seed_is_reproducible(engine):
    req = chat(QUESTIONS[1], max_tokens=12, temperature=0.9, seed=7)
    a, b = engine.generate([req]), engine.generate([req])
    assert a == b and a[0].completion_tokens > 0


def test_raw_prompt_is_used_as_is(engine):
    g = engine.generate([GenerationRequest(prompt="1, 2, 3, 4,", max_tokens=6)])[0]
    assert g.prompt_tokens == engine.count_tokens("1, 2, 3, 4,")
    assert g.text.startswith(" 5")


def test_context_overflow_for_the_whole_batch_before_any_work(engine):
    calls: list[str] = []
    long_prompt = "word " * 600  # 601 tokens: the trailing space is one more
    with pytest.raises(ContextOverflow, match=(
            r"^prompt has 601 tokens; with max_tokens=64 it exceeds the model context of "
            r"512 tokens; shorten the prompt \(e\.g\. a refine stage's max_tokens\) or "
            r"lower max_tokens$")):
        engine.generate([chat("hi"), GenerationRequest(prompt=long_prompt, max_tokens=64)],
                        on_token=lambda i, p: calls.append(p))
    assert calls == []
    # the boundary: prompt + max_tokens == context_length fits, one more does not
    edge = "word " * 490
    n = engine.count_tokens(edge)
    with pytest.raises(ContextOverflow, match=f"prompt has {n} tokens; with max_tokens="
                                              f"{513 - n} it exceeds"):
        engine.generate([GenerationRequest(prompt=edge, max_tokens=513 - n)])
    g = engine.generate([GenerationRequest(prompt=edge, max_tokens=512 - n)])[0]
    assert g.prompt_tokens == n and 0 < g.completion_tokens <= 512 - n


def test_count_tokens(engine):
    short = engine.count_tokens("The quick brown fox.")
    longer = engine.count_tokens("The quick brown fox jumps over the lazy dog. " * 10)
    assert 0 < short < longer
    assert longer >= 10 * (short + 3) // 2


COUNT = "Count from 1 to 100, separated by commas."  # generates past 120 tokens


def test_concurrent_calls_share_the_decode_loop(engine, one_at_a_time):
    """A short call arriving while a long one generates joins the running loop (continuous
    batching): it finishes first, and both results equal their solo greedy runs."""
    started, order, out = threading.Event(), [], {}

    def long_call():
        out["long"] = engine.generate([chat(COUNT, max_tokens=120)],
                                      on_token=lambda i, t: started.set())[0]
        order.append("long")

    def short_call():
        out["short"] = engine.generate([chat(QUESTIONS[0])])[0]
        order.append("short")

    solo_long = engine.generate([chat(COUNT, max_tokens=120)])[0]
    t_long = threading.Thread(target=long_call)
    t_long.start()
    assert started.wait(60)
    t_short = threading.Thread(target=short_call)
    t_short.start()
    t_short.join(60)
    t_long.join(60)
    assert solo_long.completion_tokens == 120  # long enough to still run when short came
    assert order == ["short", "long"]
    assert out["short"] == one_at_a_time[0] and out["long"] == solo_long


def test_a_failing_callback_fails_only_its_call(engine, one_at_a_time):
    def broken(i, text):
        raise RuntimeError("the caller's callback broke")

    results: list = []
    t = threading.Thread(target=lambda: results.append(engine.generate([chat(QUESTIONS[2])])))
    with pytest.raises(RuntimeError, match="the caller's callback broke"):
        t.start()
        engine.generate([chat(COUNT, max_tokens=64)], on_token=broken)
    t.join(60)
    assert results == [[one_at_a_time[2]]]
    assert engine.generate([chat(QUESTIONS[0])])[0] == one_at_a_time[0]  # still healthy


def test_gemma_base_model_completion_with_default_stops():
    eng = LlamaCppEngine("gemma3-270m", n_threads=2, n_ctx=256, n_seq_max=2)
    try:
        assert eng.chat is False and "\n\n" in eng.default_stop
        out = eng.generate([
            GenerationRequest(prompt="Question: What is the capital of France?\nAnswer:",
                              max_tokens=24),
            GenerationRequest(prompt="Question: What is 2 + 2?\nAnswer:", max_tokens=24)])
        for g in out:
            assert g.text.strip()
            assert "\n\n" not in g.text and "Question:" not in g.text
        assert "Paris" in out[0].text
    finally:
        eng.close()
    with pytest.raises(EngineError, match="closed"):
        eng.generate([GenerationRequest(prompt="x")])
    with pytest.raises(EngineError, match="closed"):
        eng.count_tokens("x")
    eng.close()  # twice is fine


def test_unknown_model_names_the_known_ones():
    with pytest.raises(EngineError, match=r"unknown model 'nope'.*gemma3-270m, "
                                          r"qwen2\.5-coder-0\.5b-instruct, "
                                          r"qwen2\.5-coder-1\.5b-instruct, "
                                          r"smollm2-135m-instruct"):
        LlamaCppEngine("nope")
    with pytest.raises(EngineError, match="model file not found"):
        LlamaCppEngine(path="/nonexistent/model.gguf")


def test_text_stream_utf8_and_stop_holdback():
    s = TextStream(stops=("STOP",))
    e_acute = "É".encode()
    assert s.feed(b"caf") == "caf"
    assert s.feed(e_acute[:1]) == ""  # half a character: nothing yet
    assert s.feed(e_acute[1:] + b" S") == "É "  # "S" might start "STOP": held
    assert s.feed(b"TO") == ""
    assert s.feed(b"P and more") == ""
    assert s.stopped and s.text == "cafÉ " and s.finish() == ""
    s = TextStream(stops=("STOP",))
    assert s.feed(b"a ST") == "a "
    assert s.feed(b"ep") == "STep"  # "STe" can no longer become "STOP"
    assert s.feed(b" ST") == " "
    assert s.finish() == "ST" and s.text == "a STep ST" and not s.stopped
    s = TextStream()
    assert s.feed(b"x\xe2\x82") == "x" and s.finish() == "\ufffd"


def test_top_p_near_zero_samples_like_greedy(engine):
    greedy = engine.generate([chat(QUESTIONS[1], max_tokens=12)])[0]
    for seed in (1, 2):
        nucleus = engine.generate([chat(QUESTIONS[1], max_tokens=12, temperature=1.5,
                                        top_p=1e-6, seed=seed)])[0]
        assert nucleus.text == greedy.text
    wide = {engine.generate([chat(QUESTIONS[1], max_tokens=12, temperature=1.5,
                                  seed=seed)])[0].text for seed in (1, 2, 3)}
    assert len(wide) > 1  # without top_p the same temperature does sample


def test_penalties_change_a_repetitive_greedy_answer(engine):
    count = GenerationRequest(prompt="1, 2, 3, 4,", max_tokens=12)
    plain = engine.generate([count])[0]
    penalised = engine.generate([GenerationRequest(prompt="1, 2, 3, 4,", max_tokens=12,
                                                   frequency_penalty=2.0)])[0]
    assert plain.text.count(",") >= 4  # it keeps counting
    assert penalised.text != plain.text  # the repeated commas and spaces were penalised


def test_penalise_and_top_p_on_small_logits():
    import numpy as np

    from tailrace.engines.llama_cpp.sampling import penalise, sample

    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    out = penalise(logits, {2: 2, 0: 1}, 0.5, 1.0)
    assert out.tolist() == [-0.5, 2.0, 0.5] and logits.tolist() == [1.0, 2.0, 3.0]
    rng = np.random.default_rng(0)
    assert {sample(logits, 5.0, rng, top_p=0.3) for _ in range(50)} == {2}
    assert len({sample(logits, 5.0, rng) for _ in range(50)}) > 1


# -- prefix reuse (the KV of finished sequences) -------------------------------------------
TURNS = ["Tell me about the moon.", "How far away is it?", "Could people live there?",
         "What would they eat?", "Summarise our talk in one sentence."]


def converse(eng: LlamaCppEngine, max_tokens: int = 24) -> list:
    """A five-turn chat, each turn sent with the whole history (as an OpenAI client does)."""
    history: list[dict[str, str]] = []
    out = []
    for text in TURNS:
        history.append({"role": "user", "content": text})
        g = eng.generate([GenerationRequest(messages=tuple(history), max_tokens=max_tokens)])[0]
        history.append({"role": "assistant", "content": g.text})
        out.append(g)
    return out


@pytest.fixture(scope="module")
def no_reuse():
    eng = LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=1024, n_seq_max=2,
                         prefix_cache=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reuse():
    eng = LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=1024, n_seq_max=2,
                         cache_sequences=2)
    yield eng
    eng.close()


def test_prefix_reuse_keeps_greedy_outputs_identical(reuse, no_reuse):
    plain = converse(no_reuse)
    cached = converse(reuse)
    assert [g.text for g in cached] == [g.text for g in plain]
    assert cached == plain  # token counts and finish reasons too
    assert all("cached_tokens" not in g.extra for g in plain)
    # turn k starts from turn k-1's prompt, in whole prefill chunks (a partial chunk's
    # KV is computed differently: it is not kept)
    c = reuse.prefill_chunk
    for prev, g in zip(cached, cached[1:], strict=False):
        assert g.extra.get("cached_tokens", 0) >= prev.prompt_tokens // c * c
    assert cached[-1].extra["cached_tokens"] >= 2 * c
    assert no_reuse.cache_statistics()["hit_tokens"] == 0


def test_an_identical_prompt_reuses_its_whole_chunks(reuse):
    req = chat("Name a large ocean. " * 20, max_tokens=8)
    first = reuse.generate([req])[0]
    again = reuse.generate([req])[0]
    assert again == first
    c = reuse.prefill_chunk  # the last token always runs (its logits start the answer)
    assert first.prompt_tokens > 2 * c
    assert again.extra["cached_tokens"] == (again.prompt_tokens - 1) // c * c
    st = reuse.cache_statistics()
    assert st["hit_tokens"] > 0 and 0 < st["hit_ratio"] < 1 and st["lookups"] >= 2
    assert st["cache_bytes"] > 0  # two cache-only streams of 1,024 tokens


def test_the_cache_is_bounded_by_its_streams_and_stays_correct(reuse, no_reuse):
    """More distinct prompts than streams: older prefixes are evicted (least recently
    used), the streams never hold more than one prefix each, answers stay exact."""
    qs = [chat(q, max_tokens=6) for q in QUESTIONS]
    for _ in range(2):
        for q in qs:
            assert reuse.generate([q])[0].text == no_reuse.generate([q])[0].text
    held = [k for k in reuse._decoder.cache.streams if k is not None]
    assert len(held) <= reuse.n_streams == 4
    batched = reuse.generate(qs)  # concurrent: two decode at once, the rest wait
    assert [g.text for g in batched] == [no_reuse.generate([q])[0].text for q in qs]


@pytest.mark.parametrize("kw, message", [
    ({"cache_sequences": -1}, "cache_sequences must be an integer >= 0"),
    ({"cache_sequences": 300}, r"n_seq_max \+ cache_sequences <= 256 \(got 300\)"),
    ({"cache_sequences": 2, "prefix_cache": False}, "cache_sequences needs prefix_cache"),
    ({"flash_attn": "no"}, "flash_attn must be true or false, got 'no'"),
])
def test_bad_cache_options_are_refused(kw, message):
    with pytest.raises(EngineError, match=message):
        LlamaCppEngine("smollm2-135m-instruct", n_threads=1, n_ctx=64, n_seq_max=1, **kw)


def test_plain_attention_keeps_prefix_reuse_exact():
    """``flash_attn: false`` computes attention another way (answers may differ from the
    default's in the last bits), but with the cache on or off it answers the same."""
    engines = [LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=1024, n_seq_max=2,
                              flash_attn=False, **kw)
               for kw in ({"prefix_cache": False}, {"cache_sequences": 2})]
    try:
        plain, cached = (converse(e) for e in engines)
        assert cached == plain and all(g.completion_tokens > 0 for g in plain)
        assert cached[-1].extra["cached_tokens"] >= 2 * engines[1].prefill_chunk
    finally:
        for e in engines:
            e.close()


# -- priorities inside the engine (a deterministic schedule: the decode loop is held in a
# token callback while requests queue, then let go) ---------------------------------------
class Hold:
    """A token callback that blocks the decode loop at its ``at``-th piece until released."""

    def __init__(self, at: int) -> None:
        self.at, self.n = at, 0
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, i: int, piece: str) -> None:
        self.n += 1
        if self.n == self.at:
            self.reached.set()
            assert self.release.wait(60)


def started(order: list, name: str):
    def cb(i: int, piece: str) -> None:
        if name not in order:
            order.append(name)
    return cb


def run_bg(eng, req, cb, out: dict, name: str) -> threading.Thread:
    t = threading.Thread(target=lambda: out.__setitem__(name, eng.generate([req], cb)[0]))
    t.start()
    return t


def queued(eng, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(eng._inbox) < n:
        assert time.monotonic() < deadline, "requests never reached the engine"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def one_slot():
    """One decoding slot and one spare stream (where a paused sequence keeps its KV)."""
    eng = LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=256, n_seq_max=1,
                         cache_sequences=1)
    yield eng
    eng.close()


def test_waiting_requests_start_by_class_then_arrival(one_slot):
    hold = Hold(2)
    out: dict = {}
    order: list = []
    first = run_bg(one_slot, chat(QUESTIONS[0], max_tokens=6), hold, out, "first")
    assert hold.reached.wait(60)
    one_slot_preempt = one_slot.preemptions
    threads = []
    for name, prio in [("low-a", 0), ("low-b", 0), ("high", 2), ("low-c", 0)]:
        threads.append(run_bg(one_slot, chat(QUESTIONS[1], max_tokens=2, priority=prio),
                              started(order, name), out, name))
        queued(one_slot, len(threads))
    # the first request decodes at class 0: a class-2 request preempts it (one spare
    # stream), the rest wait by class, then in arrival order
    hold.release.set()
    for t in [first, *threads]:
        t.join(60)
    assert order == ["high", "low-a", "low-b", "low-c"]
    assert one_slot.preemptions == one_slot_preempt + 1
    assert out["first"] == one_slot.generate([chat(QUESTIONS[0], max_tokens=6)])[0]


def test_a_preempted_sequence_resumes_with_the_same_answer(one_slot):
    low = chat(QUESTIONS[3], max_tokens=24)
    alone = one_slot.generate([low])[0]
    hold = Hold(3)
    out: dict = {}
    t_low = run_bg(one_slot, low, hold, out, "low")
    assert hold.reached.wait(60)
    before = one_slot.preemptions
    t_high = run_bg(one_slot, chat(QUESTIONS[4], max_tokens=6, priority=1), None, out,
                    "high")
    queued(one_slot, 1)
    hold.release.set()
    t_high.join(60)
    assert "low" not in out  # paused while the urgent one ran to its end
    t_low.join(60)
    assert one_slot.preemptions == before + 1
    assert out["low"] == alone  # resumed from its kept KV: the same greedy answer
    assert out["high"] == one_slot.generate([chat(QUESTIONS[4], max_tokens=6)])[0]


def test_without_a_spare_stream_an_urgent_request_waits_its_turn():
    eng = LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=256, n_seq_max=1)
    try:
        hold = Hold(2)
        out: dict = {}
        t_low = run_bg(eng, chat(QUESTIONS[0], max_tokens=8), hold, out, "low")
        assert hold.reached.wait(60)
        t_high = run_bg(eng, chat(QUESTIONS[1], max_tokens=2, priority=2), None, out, "high")
        queued(eng, 1)
        hold.release.set()
        t_low.join(60)
        assert "high" not in out or eng.preemptions == 0
        t_high.join(60)
        assert eng.preemptions == 0 and out["high"].completion_tokens == 2
    finally:
        eng.close()


def test_a_less_urgent_prompt_waits_while_an_urgent_sequence_runs():
    """Two decoding slots: a long class-0 prompt that arrives while a class-2 sequence
    decodes is not prefilled until that sequence ends (a prompt chunk costs dozens of
    decode steps on a CPU); it then runs to the same answer as alone. Without classes
    (both 0) it is prefilled at once, beside the running sequence."""
    eng = LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=1024, n_seq_max=2)
    try:
        long_text = "Summarise: " + " ".join(["the river flows to the sea"] * 30)
        alone = eng.generate([chat(long_text, max_tokens=3)])[0]
        assert alone.prompt_tokens > 3 * eng.prefill_chunk  # several chunks to prefill
        for urgent, expect_wait in ((2, True), (0, False)):
            events: list[str] = []
            hold = Hold(2)

            def urgent_cb(i: int, piece: str, hold=hold) -> None:
                events.append("urgent")
                hold(i, piece)

            out: dict = {}
            t_urgent = run_bg(eng, chat(QUESTIONS[0], max_tokens=12, priority=urgent),
                              urgent_cb, out, "urgent")
            assert hold.reached.wait(60)
            t_low = run_bg(eng, chat(long_text, max_tokens=3),
                           lambda i, piece: events.append("low"), out, "low")
            queued(eng, 1)
            hold.release.set()
            t_urgent.join(60)
            t_low.join(60)
            assert out["low"] == alone
            n_urgent = out["urgent"].completion_tokens
            assert n_urgent > 4 and events.count("urgent") == n_urgent
            first_low = events.index("low")
            if expect_wait:  # every urgent token came before the prompt was even read
                assert first_low == n_urgent, events
            else:  # one class: first come, first served, prefilled beside it
                assert first_low < n_urgent, events
    finally:
        eng.close()
