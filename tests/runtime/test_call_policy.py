"""Timeouts and retries on every kind of operator: per-record operators, batch-only
operators (refine, select, memory, ...) and ``generate``; what happens to a blocking
call that outlives its timeout."""

from __future__ import annotations

import threading
import time

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler import ABANDON_CAP
from tailrace.request import REQUEST, Cancel, Request
from tests.serving.fakes import echo_spec, register_echo


def _yaml(stages: str, engines: str = "") -> tr.Pipeline:
    return loads_pipeline("version: 1\npipeline: t\n" + engines + "stages:\n" + stages)


@pytest.mark.parametrize("contract", ["retries: 1", "timeout_ms: 5000",
                                      "retries: 2, timeout_ms: 5000"])
def test_batch_only_operators_honour_retries_and_timeouts(contract):
    p = _yaml(f"""
  - {{id: pick, op: select, fields: [q, passages], {contract}}}
  - {{id: pack, op: refine, input: passages, max_tokens: 50, {contract}}}
""")
    recs = [{"q": f"q{i}", "passages": [{"title": "t", "text": f"passage {i}"}], "x": 1}
            for i in range(5)] + [{"q": "bad", "passages": "not a list"}]
    result = tr.run(p, input=recs)
    assert sorted(r["q"] for r in result.outputs) == [f"q{i}" for i in range(5)]
    assert all("passage" in r["context"] and "x" not in r for r in result.outputs)
    [err] = result.errors  # the bad record, with its own reason, not a TypeError
    assert err.stage == "pack" and err.input["q"] == "bad" and "TypeError" not in err.error


@pytest.mark.parametrize("contract", ["retries: 1", "timeout_ms: 5000"])
def test_generate_with_retries_or_timeout_loses_no_record(monkeypatch, contract):
    register_echo(monkeypatch)
    p = _yaml(f"""
  - {{id: answer, op: generate, engine: llm, input: q, max_tokens: 4, {contract}}}
""", engines="engines:\n  llm: " + str(echo_spec()).replace("'", '"') + "\n")
    result = tr.run(p, input=[{"q": "hello there"}, {"q": 42}, {"q": "bye"}])
    assert sorted(r["answer"] for r in result.outputs) == ["bye", "hello there"]
    [err] = result.errors
    assert err.input == {"q": 42} and "must hold the prompt text" in err.message


RELEASE = threading.Event()


def hang(x):
    RELEASE.wait(30)  # ignores cancellation, like a stuck native call
    return x


def test_hung_blocking_calls_are_capped_with_a_clear_error():
    RELEASE.clear()
    try:
        p = tr.Pipeline("t")
        p.source(range(ABANDON_CAP + 3)).map(hang, timeout_ms=20, id="stuck",
                                            blocking=True).sink()
        result = tr.run(p)
    finally:
        RELEASE.set()
    assert result.outputs == []
    msgs = [e.message for e in result.errors]
    assert len(msgs) == ABANDON_CAP + 3
    assert msgs[:ABANDON_CAP] == ["operator took longer than timeout_ms=20"] * ABANDON_CAP
    assert all("still running past timeout_ms=20" in m and "refusing new calls" in m
               for m in msgs[ABANDON_CAP:])


def test_calls_run_after_abandoned_ones_return():
    """A slow call is abandoned; once it returns, later calls run normally again (they
    do not time out without running, as they did queued behind abandoned threads)."""
    slow = threading.Event()

    def first_slow(x):
        if x == 0:
            slow.wait(0.5)
        return x

    p = tr.Pipeline("t")
    p.source(range(20)).map(first_slow, timeout_ms=100, id="m", blocking=True).sink()
    result = tr.run(p)
    assert result.outputs == list(range(1, 20))
    assert [e.input for e in result.errors] == [0]


def test_a_retry_never_overlaps_its_abandoned_attempt():
    running = []
    overlaps = []
    lock = threading.Lock()

    def slow_once(x):
        with lock:
            if running:
                overlaps.append(x)
            running.append(x)
        try:
            time.sleep(0.15 if len([r for r in calls if r == x]) == 0 else 0)
            calls.append(x)
            return x
        finally:
            with lock:
                running.remove(x)

    calls: list = []
    p = tr.Pipeline("t")
    p.source([1]).map(slow_once, timeout_ms=50, retries=2, id="m", blocking=True).sink()
    result = tr.run(p)
    assert overlaps == []
    assert result.outputs == [1] or [e.input for e in result.errors] == [1]


def test_an_abandoned_generate_is_cancelled_cooperatively(monkeypatch):
    """The timed-out attempt's cancel is set: the engine stops that sequence; the
    caller's own request's cancel is untouched."""
    register_echo(monkeypatch)
    from tests.serving.fakes import EchoEngine

    EchoEngine.LOG.clear()
    p = _yaml("""
  - {id: answer, op: generate, engine: llm, input: q, max_tokens: 50, timeout_ms: 100,
     retries: 0}
""", engines="engines:\n  llm: " + str(echo_spec(delay=0.02)).replace("'", '"') + "\n")
    mine = threading.Event()
    result = tr.run(p, input=[{"q": " ".join(["w"] * 50), REQUEST: Request(cancel=Cancel(mine))}])
    [err] = result.errors
    assert "timeout_ms=100" in err.message
    deadline = time.monotonic() + 5
    while not EchoEngine.LOG and time.monotonic() < deadline:
        time.sleep(0.01)
    assert EchoEngine.LOG[-1].finish_reason == "cancelled"
    assert EchoEngine.LOG[-1].completion_tokens < 50
    assert not mine.is_set()
