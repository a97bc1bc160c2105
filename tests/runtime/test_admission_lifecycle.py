"""Every admission ticket taken is given back exactly once, whatever ends the record
(local runtime). Each test here failed before the fix it pins: most hung forever."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.request import REQUEST


class CountingGate(AdmissionGate):
    """A gate that counts, per ticket, how often it was given back."""

    def __init__(self, policy):
        super().__init__(policy)
        self.issued: list = []
        self.returned: Counter = Counter()

    async def admit(self, pipeline, record):
        t = await super().admit(pipeline, record)
        self.issued.append(t)
        return t

    def done(self, ticket, service_seconds=None):
        self.returned[ticket.seq] += 1
        super().done(ticket, service_seconds)

    def assert_balanced(self):
        assert self.statistics().in_flight == 0
        assert len(self.returned) == len(self.issued)
        assert set(self.returned.values()) <= {1}, "a ticket was given back twice"


def fcfs(n=2, queue=10_000):
    return CountingGate(make_policy("fcfs", max_in_flight=n, max_queue=queue))


def finishes(fn, timeout=60.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it never returns."""
    out: dict = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the run did not finish within {timeout:g} s (a leaked ticket?)"
    if "error" in out:
        raise out["error"]
    return out["result"]


async def until(cond, timeout=10.0):
    """Wait (polling) until ``cond()`` holds; fail after ``timeout`` seconds."""
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


def records(n):
    return [{"i": i} for i in range(n)]


def test_filter_drops_give_their_tickets_back():
    gate = fcfs(2)
    p = tr.Pipeline("f")
    p.source(id="src").filter(lambda r: r["i"] % 3 == 0, id="keep").map(
        lambda r: {**r, "x": 1}).sink()
    result = finishes(lambda: tr.run(p, input=records(60), admission=gate, fuse=False))
    assert sorted(r["i"] for r in result.outputs) == list(range(0, 60, 3))
    assert result.stats["keep"].dropped == 40
    gate.assert_balanced()


def test_fused_filter_drops_give_their_tickets_back():
    gate = fcfs(1)
    p = tr.Pipeline("f")
    p.source(id="src").map(lambda r: r).filter(lambda r: r["i"] < 5, id="keep").sink()
    result = finishes(lambda: tr.run(p, input=records(30), admission=gate))
    assert len(result.outputs) == 5 and result.stats["keep"].dropped == 25
    gate.assert_balanced()


def test_a_map_that_replaces_the_record_does_not_keep_the_slot():
    gate = fcfs(1)
    p = tr.Pipeline("f")
    p.source(id="src").map(lambda r: {"j": r["i"]}, id="fresh").map(lambda r: r).sink()
    result = finishes(lambda: tr.run(p, input=records(20), admission=gate, fuse=False))
    assert sorted(r["j"] for r in result.outputs) == list(range(20))
    gate.assert_balanced()


def test_flat_map_children_release_the_ticket_once_after_the_last_child():
    gate = fcfs(2)
    p = tr.Pipeline("f")
    (p.source(id="src").flat_map(lambda r: [{**r, "k": k} for k in range(r["i"] % 3)])
     .map(lambda r: r, queue=1).sink())
    result = finishes(lambda: tr.run(p, input=records(30), admission=gate, fuse=False))
    assert len(result.outputs) == sum(i % 3 for i in range(30))
    assert all(REQUEST not in r for r in result.outputs)
    gate.assert_balanced()


def test_fan_out_and_branches_release_once():
    gate = fcfs(2)
    p = tr.Pipeline("f")
    s = p.source(id="src")
    s.map(lambda r: {**r, "a": 1}).sink(a := [])
    t, f = s.branch(lambda r: r["i"] % 2 == 0)
    t.merge(f.filter(lambda r: r["i"] % 4 == 1)).sink(b := [])
    finishes(lambda: tr.run(p, input=records(40), admission=gate, fuse=False))
    assert len(a) == 40 and len(b) == 30
    gate.assert_balanced()


def test_errors_and_retries_exhausted_release():
    def boom(r):
        if r["i"] % 2:
            raise ValueError("odd")
        return r

    gate = fcfs(1)
    p = tr.Pipeline("f")
    p.source(id="src").map(boom, retries=1, id="boom").sink()
    result = finishes(lambda: tr.run(p, input=records(10), admission=gate))
    assert len(result.outputs) == 5 and len(result.errors) == 5
    assert all(e.attempts == 2 for e in result.errors)
    gate.assert_balanced()


def test_records_that_are_not_dicts_are_refused_not_hung():
    gate = fcfs(2)
    p = tr.Pipeline("f")
    p.source(range(200)).map(lambda x: x).sink(out := [])
    result = finishes(lambda: tr.run(p, admission=gate))
    assert out == [] and len(result.errors) == 200
    assert result.errors[0].stage == "admission"
    assert "admission needs records that are dicts" in result.errors[0].message
    gate.assert_balanced()


def test_outputs_do_not_carry_the_ticket_and_shared_records_keep_theirs():
    gate = fcfs(4)
    p = tr.Pipeline("f")
    s = p.source(id="src")
    s.sink(a := [])
    s.map(lambda r: r, queue=1).sink(b := [])  # the same dicts, later
    finishes(lambda: tr.run(p, input=records(50), admission=gate, fuse=False))
    assert len(a) == len(b) == 50
    assert not any(REQUEST in r for r in a + b)
    gate.assert_balanced()


def test_admission_at_the_source_is_bounded():
    """At most ``admission_window`` arrivals wait for admission at once: the source stops
    reading instead of making one task per input record."""
    most = [0]

    def tasks(r):
        most[0] = max(most[0], len(asyncio.all_tasks()))
        return r

    gate = fcfs(4)
    p = tr.Pipeline("f")
    p.source(id="src").map(tasks, queue=4).sink()
    result = finishes(lambda: tr.run(p, input=({"i": i} for i in range(6000)),
                                     admission=gate))
    assert len(result.outputs) == 6000
    assert most[0] < 1100  # the 1024-record window plus the stage tasks
    gate.assert_balanced()


def test_a_cancelled_admission_wait_gives_its_ticket_back():
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=10))

    async def scenario():
        first = await gate.admit("p", {"q": "a"})
        waiting = asyncio.ensure_future(gate.admit("p", {"q": "b"}))
        await until(lambda: gate.statistics().queued == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.done(first)  # admits the abandoned request, which is freed at once
        await until(lambda: gate.statistics().in_flight == 0
                    and gate.statistics().queued == 0)
        third = await asyncio.wait_for(gate.admit("p", {"q": "c"}), 5)
        gate.done(third)

    asyncio.run(scenario())
    assert gate.statistics().in_flight == 0
    gate.close()


def test_a_ticket_admitted_as_its_caller_cancels_is_given_back():
    """The race: the policy admits a waiter whose future is cancelled before delivery."""
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=10))

    async def scenario():
        first = await gate.admit("p", {"q": "a"})
        waiting = asyncio.ensure_future(gate.admit("p", {"q": "b"}))
        await until(lambda: gate.statistics().queued == 1)
        gate.done(first)  # schedules delivery of b's ticket on this loop...
        assert gate.statistics().in_flight == 1
        waiting.cancel()  # ...but b's caller leaves first
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await until(lambda: gate.statistics().in_flight == 0)

    asyncio.run(scenario())
    assert gate.statistics().in_flight == 0
    gate.close()


def test_close_after_a_waiters_loop_ended_does_not_raise():
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=10))
    loop = asyncio.new_event_loop()

    async def leave_one_waiting():
        await gate.admit("p", {"q": "a"})
        asyncio.ensure_future(gate.admit("p", {"q": "b"}))
        await until(lambda: gate.statistics().queued == 1)

    loop.run_until_complete(leave_one_waiting())
    loop.close()  # like a Ctrl-C'd run that shared the gate
    gate.close()  # raised "Event loop is closed"


def test_a_ticket_delivered_just_before_its_caller_is_cancelled_is_given_back():
    """The other order of the race (found by the fault suite under Ctrl-C): the ticket
    reached the waiter's future, then its task was cancelled before it resumed."""
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=10))

    async def scenario():
        first = await gate.admit("p", {"q": "a"})
        waiting = asyncio.ensure_future(gate.admit("p", {"q": "b"}))
        await until(lambda: gate.statistics().queued == 1)
        gate.done(first)  # schedules the delivery...
        await asyncio.sleep(0)  # ...which runs now: the future holds b's ticket
        waiting.cancel()  # and the task is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await until(lambda: gate.statistics().in_flight == 0)

    asyncio.run(scenario())
    gate.close()


def test_a_batch_window_lists_its_records_without_their_tickets():
    """Found by the fault suite: the ticket object rode on inside a batch's list."""
    gate = fcfs(2)
    p = tr.Pipeline("f")
    p.source(id="src").batch(3, output="items").map(lambda r: r, queue=1).sink()
    result = finishes(lambda: tr.run(p, input=records(7), admission=gate, fuse=False))
    items = [x for r in result.outputs for x in r["items"]]
    assert sorted(x["i"] for x in items) == list(range(7))
    assert not any(REQUEST in x for x in items)
    gate.assert_balanced()


def _nap(r):
    import time

    time.sleep(0.05)
    return r


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_end_to_end_latency_counts_the_wait_for_admission(runtime, request):
    # one record in flight at a time, each 50 ms in the stage: the fifth waits >= 200 ms
    # for its ticket, and that wait is part of what its caller sees (arrival -> output)
    if runtime == "ray":
        request.getfixturevalue("ray_session")
    gate = fcfs(n=1)
    p = tr.Pipeline("queued")
    p.source([{"i": i} for i in range(5)]).map(_nap, blocking=True).sink(out := [])
    try:
        result = tr.run(p, admission=gate, runtime=runtime)
    finally:
        gate.close()
    assert len(out) == 5
    assert result.stats.latency_us.max >= 150_000
    gate.assert_balanced()
