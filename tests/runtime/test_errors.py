"""Raising operators become error records; timeouts and retries apply per record."""

import threading
import time

import pytest

import tailrace as tr


def boom_on_3(x):
    if x == 3:
        raise ValueError(f"bad value {x}")
    return x


def test_raising_operator_gives_error_record_and_run_continues(run):
    p = tr.Pipeline("t")
    p.source(range(6)).map(boom_on_3, id="check").map(lambda x: x + 100).sink()
    result = run(p)
    assert result.outputs == [100, 101, 102, 104, 105]
    [err] = result.errors
    assert (err.stage, err.input, err.error, err.message, err.attempts) == (
        "check", 3, "ValueError", "bad value 3", 1)
    assert result.stats["check"].errors == 1
    assert result.stats.errors == 1


def test_error_records_for_filter_flat_map_branch(run):
    def pred(x):
        return 1 / x > 0

    p = tr.Pipeline("t")
    s = p.source([0, 1], id="src")
    s.filter(pred, id="f").sink()
    s.flat_map(lambda x: [1 / x], id="fm").sink()
    t, f = s.branch(pred, id="b")
    t.merge(f).sink()
    result = run(p)
    assert sorted(e.stage for e in result.errors) == ["b", "f", "fm"]
    assert all(e.input == 0 and e.error == "ZeroDivisionError" for e in result.errors)


def test_missing_field_error_names_the_field(run):
    p = tr.Pipeline("t")
    p.source([{"a": 1}]).map(str, input="b", output="c", id="m").sink()
    [err] = run(p).errors
    assert err.message == "record has no field 'b' (it has: a)"


def test_retries_then_success(run):
    attempts = {}

    def flaky(x):
        attempts[x] = attempts.get(x, 0) + 1
        if attempts[x] < 3:
            raise ConnectionError("try again")
        return x

    p = tr.Pipeline("t")
    p.source([1, 2]).map(flaky, id="flaky", retries=2).sink()
    result = run(p)
    assert sorted(result.outputs) == [1, 2] and not result.errors
    assert result.stats["flaky"].retries == 4


def test_retries_exhausted_gives_error_with_attempts(run):
    def always(x):
        raise ConnectionError("down")

    p = tr.Pipeline("t")
    p.source([7]).map(always, id="call", retries=2).sink()
    [err] = run(p).errors
    assert (err.stage, err.input, err.error, err.attempts) == ("call", 7, "ConnectionError", 3)


def test_timeout_sync_operator(run):
    release = threading.Event()

    def slow(x):
        if x == 1:
            release.wait(5)  # blocks until the test ends; never sleeps the full time
        return x

    p = tr.Pipeline("t")
    p.source([0, 1, 2]).map(slow, id="slow", timeout_ms=50).sink()
    try:
        result = run(p)
    finally:
        release.set()
    assert sorted(result.outputs) == [0, 2]
    [err] = result.errors
    assert (err.stage, err.input, err.error) == ("slow", 1, "StageTimeout")
    assert err.message == "operator took longer than timeout_ms=50"
    assert result.stats["slow"].timeouts == 1


def test_timeout_async_operator_with_retry(run):
    import asyncio

    calls = []

    async def slow_first(x):
        calls.append(x)
        if len(calls) == 1:
            await asyncio.Event().wait()  # never completes: cancelled by the timeout
        return x

    p = tr.Pipeline("t")
    p.source([5]).map(slow_first, id="a", timeout_ms=20, retries=1).sink()
    result = run(p)
    assert result.outputs == [5] and not result.errors
    assert result.stats["a"].timeouts == 1 and result.stats["a"].retries == 1


def test_batch_contract_failure_fails_every_record_of_the_batch(run):
    def bad_batch(xs):
        raise RuntimeError("model crashed")

    p = tr.Pipeline("t")
    p.source([1, 2, 3]).map(bad_batch, id="gen", batch={"max_size": 3}).sink()
    result = run(p)
    assert result.outputs == []
    assert sorted(e.input for e in result.errors) == [1, 2, 3]


def test_batch_function_returning_wrong_length(run):
    p = tr.Pipeline("t")
    p.source([1, 2]).map(lambda xs: xs[:1], id="gen", batch={"max_size": 2}).sink()
    errs = run(p).errors
    assert len(errs) == 2
    assert errs[0].message == ("batch function returned 1 results for 2 inputs; it must "
                               "return one per input")


def test_blocking_replicas_run_in_parallel_threads(run):
    """Two replicas of a blocking stage overlap: a barrier of 2 only passes if the two
    calls run at the same time (it would time out if they ran one after the other)."""
    barrier = threading.Barrier(2, timeout=5)

    def meet(x):
        barrier.wait()
        return threading.current_thread().name

    p = tr.Pipeline("t")
    p.source([1, 2], queue=2).map(meet, replicas=2, queue=2).sink()
    names = run(p).outputs
    assert len(set(names)) == 2 and all(n.startswith("tailrace") for n in names)


@pytest.mark.parametrize("contract", [{"blocking": True}, {"replicas": 3}])
def test_thread_mode_keeps_every_record(run, contract):
    p = tr.Pipeline("t")
    p.source(range(5000)).map(lambda x: x + 1, **contract).sink()
    assert sorted(run(p).outputs) == list(range(1, 5001))


def test_inline_stage_does_not_block_on_thread_stage(run):
    p = tr.Pipeline("t")
    p.source(range(50)).map(lambda x: (time.sleep(0.0001), x)[1], blocking=True).sink()
    assert run(p).outputs == list(range(50))
