"""Tokens stream out of engine actors on Ray: in order, before the generation ends,
cancellable from the caller, with engine errors and dead actors reported, never a hang."""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest

from tailrace.engines import GenerationRequest
from tailrace.errors import EngineError
from tests.runtime.ray_engine_fakes import cluster_engine, counter_spec, kill_engine, signal


def req(n: int) -> GenerationRequest:
    return GenerationRequest(prompt="count", max_tokens=n)


def counted(n: int) -> str:
    return "".join(f"t{k} " for k in range(n))


@pytest.fixture
def engines(ray_session):
    """Opens fake cluster engines under fresh names; kills their actors afterwards."""
    opened: list[tuple[str, dict]] = []

    def open_(spec: dict) -> object:
        name = f"s{uuid.uuid4().hex[:8]}"
        opened.append((name, spec))
        return cluster_engine(name, spec)

    open_.opened = opened
    yield open_
    for name, spec in opened:
        with contextlib.suppress(ValueError):  # already gone
            kill_engine(name, spec)


def test_pieces_arrive_in_order_while_the_engine_is_still_generating(ray_session, engines):
    import ray

    hold = f"hold-{uuid.uuid4().hex[:8]}"
    sig = signal(hold)
    try:
        eng = engines(counter_spec(hold=hold))
        got: dict[int, list[str]] = {0: [], 1: []}

        def on_token(i: int, piece: str) -> bool:
            if not got[0] and not got[1]:  # the engine waits for this before going on
                sig.send.remote()
            got[i].append(piece)
            return True

        gens = eng.generate([req(40), req(7)], on_token)
        assert got[0][0] == "t0 "  # the first piece, alone: the engine was held after it
        assert "".join(got[0]) == counted(40) == gens[0].text
        assert "".join(got[1]) == counted(7) == gens[1].text
        assert [g.finish_reason for g in gens] == ["length", "length"]
    finally:
        ray.kill(sig)


def test_without_on_token_the_call_is_whole_and_equal(engines):
    eng = engines(counter_spec())
    plain = eng.generate([req(5), req(3)])
    pieces: list[tuple[int, str]] = []
    streamed = eng.generate([req(5), req(3)], lambda i, p: pieces.append((i, p)))
    assert [g.text for g in plain] == [g.text for g in streamed] == [counted(5), counted(3)]
    assert "".join(p for i, p in pieces if i == 0) == counted(5)


def test_on_token_returning_false_stops_that_sequence_in_the_actor(engines):
    eng = engines(counter_spec())
    seen: list[tuple[int, str]] = []

    def on_token(i: int, piece: str) -> bool:
        seen.append((i, piece))
        return i != 0  # refuse request 0 (endless) from its first piece on

    gens = eng.generate([req(0), req(4)], on_token)
    # the engine saw its on_token return False for request 0, long before its cap
    assert gens[0].finish_reason == "cancelled"
    assert 0 < gens[0].completion_tokens < 1_000_000
    assert [p for i, p in seen if i == 0] == [seen[0][1]]  # nothing handed on after False
    assert (gens[1].text, gens[1].finish_reason) == (counted(4), "length")


def test_a_caller_that_stops_reading_cancels_its_requests_in_the_actor(engines):
    from tests.runtime.ray_engine_fakes import actor_state

    spec = counter_spec()
    eng = engines(spec)
    name = engines.opened[-1][0]

    def on_token(i: int, piece: str) -> bool:
        raise RuntimeError("the consumer broke")

    with pytest.raises(RuntimeError, match="the consumer broke"):
        eng.generate([req(0)], on_token)  # endless unless stopped
    deadline = time.monotonic() + 60  # waits for the condition; a failure ends at 60 s
    while (state := actor_state(name, spec))["streams"] or not state["log"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.01)
    assert [g.finish_reason for g in state["log"]] == ["cancelled"]


def test_a_busy_consumer_holds_neither_the_engine_nor_a_piece_per_token(engines):
    from tests.runtime.ray_engine_fakes import actor_state

    spec = counter_spec()
    eng = engines(spec)
    name = engines.opened[-1][0]
    got: list[str] = []

    def on_token(i: int, piece: str) -> bool:
        if not got:  # busy on the first piece until the engine has finished them all
            deadline = time.monotonic() + 60
            while not actor_state(name, spec)["log"]:
                assert time.monotonic() < deadline, "the engine waited for the consumer"
                time.sleep(0.01)
        got.append(piece)
        return True

    gens = eng.generate([req(5000)], on_token)
    assert "".join(got) == gens[0].text == counted(5000)
    assert len(got) <= 4  # joined while the consumer was busy, not 5,000 Ray objects


def test_an_engine_error_in_the_actor_is_the_engines_error(engines):
    eng = engines(counter_spec(fail_after=3))
    pieces: list[str] = []
    with pytest.raises(EngineError, match="counter engine failed after 3 tokens"):
        eng.generate([req(10)], lambda i, p: pieces.append(p))
    assert "".join(pieces) in ("", "t0 ", "t0 t1 ", counted(3))  # a prefix, in order


def test_an_actor_killed_mid_stream_is_a_clear_error_and_the_next_call_works(
        ray_session, engines):
    import ray

    hold = f"hold-{uuid.uuid4().hex[:8]}"
    sig = signal(hold)  # never sent: the engine holds after the first piece until killed
    try:
        spec = counter_spec(hold=hold)
        eng = engines(spec)
        name = engines.opened[-1][0]

        def on_token(i: int, piece: str) -> bool:
            kill_engine(name, spec, restart=True)
            return True

        with pytest.raises(EngineError, match=f"engine '{name}': its actor died while "
                                              "streaming"):
            eng.generate([req(5)], on_token)
        sig.send.remote()  # the restarted actor's engine need not wait
        pieces: list[str] = []
        gens = eng.generate([req(5)], lambda i, p: pieces.append(p))
        assert "".join(pieces) == gens[0].text == counted(5)
    finally:
        ray.kill(sig)


def test_an_actor_that_dies_before_streaming_anything_is_retried(engines, tmp_path):
    marker = tmp_path / "died"
    eng = engines(counter_spec(die_once=str(marker)))
    pieces: list[str] = []
    gens = eng.generate([req(6)], lambda i, p: pieces.append(p))
    assert marker.exists()  # the first attempt's actor process died
    assert "".join(pieces) == gens[0].text == counted(6)


def test_an_engine_pool_streams_too(ray_session, engines):
    import ray

    hold = f"hold-{uuid.uuid4().hex[:8]}"
    sig = signal(hold)  # each replica's engine holds after its first piece until sent
    try:
        eng = engines(counter_spec(hold=hold, replicas=2, isolation="thread"))
        got: dict[int, list[str]] = {i: [] for i in range(4)}

        def on_token(i: int, piece: str) -> bool:
            sig.send.remote()
            got[i].append(piece)
            return True

        gens = eng.generate([req(9 + i) for i in range(4)], on_token)
        for i in range(4):
            assert "".join(got[i]) == gens[i].text == counted(9 + i)
    finally:
        ray.kill(sig)


@pytest.mark.engine
def test_llama_cpp_on_the_cluster_streams_the_greedy_text(ray_session):
    from tailrace.runtime.ray.engines import ClusterEngine
    from tests.runtime.ray_engine_fakes import kill_engine

    name = f"llm{uuid.uuid4().hex[:8]}"
    spec = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 1,
            "n_ctx": 256}
    eng = ClusterEngine(name, spec)
    try:
        reqs = [GenerationRequest(messages=({"role": "user", "content": q},), max_tokens=24)
                for q in ("What is the capital of France?", "Name three colours.")]
        whole = eng.generate(reqs)
        got: dict[int, list[str]] = {0: [], 1: []}
        streamed = eng.generate(reqs, lambda i, p: got[i].append(p))
        for i in (0, 1):
            assert whole[i].text and "".join(got[i]) == streamed[i].text == whole[i].text
        assert len(got[0]) > 1  # more than one piece: it streamed, not whole at the end
    finally:
        kill_engine(name, spec)
