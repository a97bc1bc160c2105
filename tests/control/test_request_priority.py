"""A request's own priority class and deadline (``Request.priority``/``deadline``, the
gate's ``_urgency`` record field) under the admission policies, on a virtual clock."""

import asyncio
import re

import pytest

from tailrace.control import (
    AdmissionGate,
    AdmissionRejected,
    PipelineSLO,
    Request,
    make_policy,
)
from tailrace.request import REQUEST
from tailrace.request import Request as Envelope
from tests.control.test_admission import BIG, UNIT, VirtualClock, req, saturate


def drain(p, clock, running):
    """Release one ticket a second until nothing is left; the admission order."""
    order = []
    while running is not None:
        clock.now += 1.0
        p.release(running)
        admitted = p.poll()
        order += [t.request.id for t in admitted]
        running = admitted[0] if admitted else None
    return order


def test_within_a_pipeline_the_requests_class_first_then_its_deadline():
    clock = VirtualClock()
    p = make_policy("slo", clock=clock, cost_model=UNIT, max_in_flight=1,
                    slos={"qa": PipelineSLO(BIG)})  # standard
    running = p.try_admit(req("r0"))
    for rid, priority, deadline in [("b1", "batch", 100.0), ("s1", None, 300.0),
                                    ("i1", "interactive", 400.0), ("s2", 1, 200.0),
                                    ("i2", 2, 350.0), ("x1", 5, 900.0)]:
        assert p.try_admit(req(rid, deadline=deadline, priority=priority)) is None
    assert p.statistics().queue_depth == {"qa": 6}
    assert drain(p, clock, running) == ["x1", "i2", "i1", "s2", "s1", "b1"]
    assert p.statistics().rejected == {}


def test_across_pipelines_each_competes_with_its_best_waiting_request():
    clock = VirtualClock()
    slos = {"bulk": PipelineSLO(BIG, "batch"), "chat": PipelineSLO(BIG, "interactive")}
    p = make_policy("slo", clock=clock, cost_model=UNIT, max_in_flight=1, slos=slos,
                    max_lead=10.0)
    running = p.try_admit(req("r0", "bulk"))
    for rid, pipe, priority, deadline in [
            ("b-low", "bulk", None, 50.0), ("b-urgent", "bulk", "interactive", 80.0),
            ("c1", "chat", None, 60.0), ("c-low", "chat", "batch", 40.0),
            ("b-urgent2", "bulk", "interactive", 20.0)]:
        assert p.try_admit(req(rid, pipe, deadline=deadline, priority=priority)) is None
    # interactive first (earliest deadline across both pipelines), then batch by deadline
    assert drain(p, clock, running) == ["b-urgent2", "c1", "b-urgent", "c-low", "b-low"]


def test_a_request_class_does_not_break_the_fair_share():
    """Every bulk request claims interactive: the pipelines still split capacity 1:4."""
    clock = VirtualClock()
    slos = {"bulk": PipelineSLO(BIG, "batch", weight=1),
            "chat": PipelineSLO(BIG, "interactive", weight=4)}
    p = make_policy("slo", clock=clock, cost_model=UNIT, max_in_flight=4, slos=slos)
    stats = saturate(p, clock, ["bulk", "chat"], admissions=2000,
                     priorities={"bulk": "interactive"})
    assert stats.rejected == {}
    assert stats.admitted_cost["chat"] / stats.admitted_cost["bulk"] == pytest.approx(4, rel=0.1)


def test_a_requests_deadline_is_used_and_an_unmeetable_one_rejected():
    clock = VirtualClock()
    heard = []
    p = make_policy("slo", clock=clock, cost_model=UNIT, max_in_flight=1,
                    slos={"qa": PipelineSLO(BIG)}, on_reject=heard.append)
    running = p.try_admit(req("r0"))
    assert p.try_admit(req("late-ok", deadline=2.0)) is None  # starts at 1, done at 2
    assert p.try_admit(req("too-soon", deadline=1.5)) is None  # EDF: first, done at 2 > 1.5
    assert [(r.request.id, r.reason, r.retry_after) for r in heard] == [
        ("too-soon", "deadline_unmeetable", pytest.approx(0.5))]
    assert drain(p, clock, running) == ["late-ok"]


def test_a_lower_class_request_expires_behind_a_higher_one():
    clock = VirtualClock()
    heard = []
    p = make_policy("slo", clock=clock, cost_model=UNIT, max_in_flight=1,
                    slos={"qa": PipelineSLO(BIG)}, on_reject=heard.append)
    running = p.try_admit(req("r0"))
    assert p.try_admit(req("i1", priority="interactive")) is None
    assert p.try_admit(req("b1", priority="batch", deadline=3.0)) is None
    clock.now = 2.5  # r0 overran: b1 can no longer finish by 3.0, though i1 is ahead of it
    p.release(running)
    assert [t.request.id for t in p.poll()] == ["i1"]
    assert [(r.request.id, r.reason) for r in heard] == [("b1", "deadline_expired")]
    assert p.statistics().queued == 0


def test_reserve_lanes_go_by_the_requests_class():
    clock = VirtualClock()
    p = make_policy("slo", clock=clock, cost_model=UNIT, max_in_flight=4, reserve=2,
                    slos={"qa": PipelineSLO(BIG, "batch")})
    assert p.try_admit(req("i0", priority="interactive")) is not None
    plain = [p.try_admit(req(f"b{i}")) for i in range(3)]
    # 1 interactive + 1 batch fill the unreserved lanes; the other batch requests wait
    assert [t is not None for t in plain] == [True, False, False]
    assert p.try_admit(req("i1", priority="interactive")) is not None  # a reserved lane
    assert p.poll() == []  # 3 of 4 lanes busy, the last one is reserved
    clock.now = 20.0  # the interactive class has gone quiet: batch may take the last lane
    assert [t.request.id for t in p.poll()] == ["b1"]


@pytest.mark.parametrize("name", ["fcfs", "simultaneous"])
def test_fcfs_and_simultaneous_ignore_the_class_and_the_deadline(name):
    clock = VirtualClock()
    options = {"max_in_flight": 1} if name == "fcfs" else {}
    p = make_policy(name, clock=clock, cost_model=UNIT, **options)
    running = p.try_admit(req("r0"))
    later = [p.try_admit(req("b1", priority="batch")),
             p.try_admit(req("i1", priority="interactive", deadline=0.5))]
    if name == "simultaneous":
        assert all(t is not None for t in later)
        return
    assert later == [None, None]
    assert drain(p, clock, running) == ["b1", "i1"]
    assert p.statistics().rejected == {}


def test_a_bad_priority_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^" + re.escape(
            "request 'r1': priority must be 'interactive', 'standard', 'batch', an integer "
            "class or None, got 'urgent'") + "$"):
        Request("r1", "qa", 0.0, priority="urgent")
    with pytest.raises(ValueError, match="priority must be"):
        Request("r1", "qa", 0.0, priority=True)


def test_the_gate_reads_the_records_urgency():
    clock = VirtualClock()
    gate = AdmissionGate(make_policy("slo", clock=clock, cost_model=UNIT, max_in_flight=1,
                                     slos={"qa": PipelineSLO(BIG)}),
                         max_tokens={"qa": 10})  # 1 s each

    async def scenario():
        first = await gate.admit("qa", {"q": "x",
                                        REQUEST: Envelope(asked={"priority": "interactive"})})
        assert (first.request.priority, first.request.deadline) == ("interactive", None)
        # a second must wait 1 s for the first and run 1 s: 1.5 s is too short
        with pytest.raises(AdmissionRejected) as e:
            await gate.admit("qa", {"q": "x", REQUEST: Envelope(asked={"deadline_ms": 1500})})
        assert e.value.reason == "deadline_unmeetable"
        gate.done(first)
        clock.now = 10.0
        second = await gate.admit("qa", {"q": "x", REQUEST: Envelope(asked={
            "deadline_ms": 1500, "priority": 0})})
        assert (second.request.priority, second.deadline) == (0, 11.5)
        plain = gate.admit("qa", {"q": "x"})
        gate.done(second)
        third = await plain
        assert (third.request.priority, third.request.deadline) == (None, None)
        gate.done(third)

    try:
        asyncio.run(scenario())
    finally:
        gate.close()
