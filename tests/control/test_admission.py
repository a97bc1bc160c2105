"""Admission policies on a virtual clock, with no engine: order, shares, rejections, inputs."""

import dataclasses
import itertools
import re

import pytest

import tailrace.control as ctl
from tailrace.control import (
    AdmissionRejected,
    CostModel,
    PipelineSLO,
    Request,
    Verdict,
    make_policy,
)
from tailrace.control.admission import MIN_RETRY_AFTER


class VirtualClock:
    """A clock tests advance by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# predicted cost = max_tokens / 10 seconds, exactly
UNIT = CostModel(prefill_tps=1e9, decode_tps=10.0, overhead_s=0.0)
BIG = 1e9  # ms: a budget no test reaches


def req(rid, pipeline="qa", at=0.0, cost=1.0, deadline=None, priority=None):
    return Request(rid, pipeline, arrival=at, max_tokens=round(cost * 10), deadline=deadline,
                   priority=priority)


def policy(name, clock, **config):
    return make_policy(name, clock=clock, cost_model=UNIT, **config)


def ids(tickets):
    return [t.request.id for t in tickets]


def test_exported_names_are_pinned():
    assert sorted(ctl.__all__) == [
        "AdmissionGate", "AdmissionPolicy", "AdmissionRejected", "AdmissionStatistics",
        "CostModel", "DEADLINE_EXPIRED", "DEADLINE_UNMEETABLE", "Decision",
        "FCFSPolicy", "POLICIES", "PRIORITIES",
        "PipelineSLO", "QUEUE_FULL", "Rejection", "Request", "SLOPolicy",
        "SimultaneousPolicy", "Ticket", "Verdict",
        "make_policy", "policy_options", "register_policy",
    ]
    assert sorted(ctl.POLICIES) == ["fcfs", "simultaneous", "slo"]


def test_simultaneous_admits_everything():
    p = policy("simultaneous", VirtualClock())
    tickets = [p.try_admit(req(f"r{i}")) for i in range(100)]
    assert all(t is not None for t in tickets)
    s = p.statistics()
    assert (s.admitted, s.in_flight, s.queued, s.rejected) == (100, 100, 0, {})
    assert p.poll() == []


def test_fcfs_limits_concurrency_and_keeps_arrival_order():
    clock = VirtualClock()
    p = policy("fcfs", clock, max_in_flight=2)
    first = [p.try_admit(req(f"r{i}", deadline=10.0 - i)) for i in range(5)]
    assert [t is not None for t in first] == [True, True, False, False, False]
    assert p.statistics().queue_depth == {"qa": 3}
    assert p.poll() == []  # nothing was released: no room
    order = []
    for ticket in first[:2]:
        clock.advance(1.0)
        p.release(ticket)
        order += p.poll()
    clock.advance(1.0)
    p.release(order[0])
    order += p.poll()
    assert ids(order) == ["r2", "r3", "r4"]  # arrival order, deadlines notwithstanding
    assert [t.wait for t in order] == [1.0, 2.0, 3.0]


def test_fcfs_cost_budget_never_lets_a_newcomer_overtake():
    p = policy("fcfs", VirtualClock(), max_in_flight=None, max_cost=2.0)
    big = p.try_admit(req("big", cost=1.5))
    assert p.try_admit(req("mid", cost=1.0)) is None
    assert p.try_admit(req("small", cost=0.5)) is None  # would fit, but "mid" waits first
    p.release(big)
    assert ids(p.poll()) == ["mid", "small"]
    assert p.statistics().in_flight_cost == pytest.approx(1.5)


def test_a_request_bigger_than_the_budget_runs_alone():
    p = policy("fcfs", VirtualClock(), max_in_flight=None, max_cost=2.0)
    assert p.try_admit(req("huge", cost=5.0)) is not None
    assert p.try_admit(req("next", cost=0.1)) is None


def test_fcfs_full_queue_rejects_with_retry_after():
    clock = VirtualClock()
    heard = []
    p = policy("fcfs", clock, max_in_flight=1, max_queue=2, on_reject=heard.append)
    assert p.try_admit(req("r1")) is not None
    assert p.try_admit(req("r2")) is None and p.try_admit(req("r3")) is None
    assert p.last_rejection is None  # queued, not rejected
    clock.advance(0.25)
    assert p.try_admit(req("r4", at=0.25)) is None
    rejection = p.last_rejection
    assert heard == [rejection]
    assert rejection.reason == "queue_full" == ctl.QUEUE_FULL
    assert rejection.retry_after == pytest.approx(0.75)  # r1 is predicted to finish then
    assert p.decide(req("r5")) == ctl.Decision(Verdict.REJECT, "queue_full", 0.75)
    err = rejection.error()
    assert isinstance(err, AdmissionRejected) and err.retry_after == pytest.approx(0.75)
    with pytest.raises(AdmissionRejected,
                       match=r"request 'r4' for pipeline 'qa' rejected \(queue_full\); "
                             r"retry after 0\.75s"):
        raise err
    assert p.statistics().rejected == {"queue_full": 1}


def test_release_frees_capacity_once():
    clock = VirtualClock()
    p = policy("fcfs", clock, max_in_flight=1)
    t1 = p.try_admit(req("r1"))
    assert p.try_admit(req("r2")) is None
    clock.advance(1.0)
    p.release(t1)
    (t2,) = p.poll()
    assert t2.request.id == "r2" and t2.admitted_at == 1.0
    s = p.statistics()
    assert (s.completed, s.in_flight, s.queued, s.mean_wait) == (1, 1, 0, 0.5)
    with pytest.raises(ValueError, match=r"release: ticket for request 'r1' is not in flight "
                                         r"here \(released twice, or issued by another policy\)"):
        p.release(t1)


def test_release_with_seconds_calibrates_the_cost_model():
    p = make_policy("fcfs", clock=VirtualClock(), max_in_flight=1,
                    cost_model=CostModel(prefill_tps=1e9, decode_tps=10.0, overhead_s=0.0))
    for i in range(30):
        p.release(p.try_admit(req(f"r{i}")), 3.0)
    assert p.try_admit(req("next")).cost == pytest.approx(3.0, rel=0.01)


def test_cost_model_calibration_moves_predictions_toward_observations():
    model = CostModel(prefill_tps=100.0, decode_tps=10.0, overhead_s=0.0, alpha=0.5)
    r = Request("r", "qa", 0.0, prompt_tokens=50, max_tokens=5)
    assert model.predict(r) == pytest.approx(1.0)
    predictions = []
    for _ in range(10):
        model.observe(r, 2.0)
        predictions.append(model.predict(r))
    assert predictions == sorted(predictions) and predictions[0] == pytest.approx(1.5)
    assert predictions[-1] == pytest.approx(2.0, rel=0.01)
    other = Request("o", "unseen", 0.0, max_tokens=10)
    assert model.predict(other) == pytest.approx(2.0, rel=0.01)  # the global calibration
    model.observe(Request("z", "qa", 0.0), 1.0)  # a zero estimate has nothing to scale
    assert model.predict(r) == pytest.approx(2.0, rel=0.01)


def test_slo_earliest_deadline_first_within_a_class():
    clock = VirtualClock()
    p = policy("slo", clock, max_in_flight=1, max_lead=10.0)  # shares never bind here
    blocker = p.try_admit(req("r0"))
    for rid, pipe, deadline in [("a30", "a", 30.0), ("b20", "b", 20.0), ("a10", "a", 10.0),
                                ("a9", "qa", 9.0), ("a5", "qa", 5.0), ("a7", "qa", 7.0)]:
        assert p.try_admit(req(rid, pipe, deadline=deadline)) is None
    assert p.statistics().queue_depth == {"a": 2, "b": 1, "qa": 3}
    order, running = [], blocker
    while running is not None:
        clock.advance(1.0)
        p.release(running)
        admitted = p.poll()
        order += admitted
        running = admitted[0] if admitted else None
    assert ids(order) == ["a5", "a7", "a9", "a10", "b20", "a30"]
    assert p.statistics().rejected == {}


@pytest.mark.parametrize("lead, expected", [(2.0, ["i1", "i2", "b1", "b2"]),
                                            (0.0, ["i1", "b1", "i2", "b2"])])
def test_slo_higher_class_first_within_its_lead(lead, expected):
    clock = VirtualClock()
    slos = {"bulk": PipelineSLO(BIG, "batch"), "chat": PipelineSLO(BIG, "interactive")}
    p = policy("slo", clock, max_in_flight=1, slos=slos, max_lead=lead)
    running = p.try_admit(req("b0", "bulk"))
    for rid, pipe in [("b1", "bulk"), ("b2", "bulk"), ("i1", "chat"), ("i2", "chat")]:
        assert p.try_admit(req(rid, pipe)) is None
    order = []
    while running is not None:
        clock.advance(1.0)
        p.release(running)
        admitted = p.poll()
        order += admitted
        running = admitted[0] if admitted else None
    assert ids(order) == expected


def saturate(p, clock, pipelines, admissions, priorities=None):
    """Keep every pipeline 8 deep in the queue; run each ticket for exactly its cost.
    ``priorities``: a request class by pipeline (default: each pipeline's SLO class)."""
    running, counter = [], itertools.count()

    def refill():
        depth = p.statistics().queue_depth
        for pipe in pipelines:
            for _ in range(8 - depth.get(pipe, 0)):
                i = next(counter)
                ticket = p.try_admit(req(f"{pipe}{i}", pipe, clock(), cost=0.5 + (i % 11) / 10,
                                         priority=(priorities or {}).get(pipe)))
                running.extend([ticket] if ticket else [])

    refill()
    while p.statistics().admitted < admissions:
        done = min(running, key=lambda t: t.admitted_at + t.cost)
        running.remove(done)
        clock.now = max(clock.now, done.admitted_at + done.cost)
        p.release(done)
        running += p.poll()
        refill()
    return p.statistics()


@pytest.mark.parametrize("bulk_class, chat_class", [("batch", "interactive"),
                                                    ("standard", "standard")])
def test_slo_weighted_fair_share_between_saturated_pipelines(bulk_class, chat_class):
    clock = VirtualClock()
    slos = {"bulk": PipelineSLO(BIG, bulk_class, weight=1),
            "chat": PipelineSLO(BIG, chat_class, weight=4)}
    p = policy("slo", clock, max_in_flight=4, slos=slos)
    stats = saturate(p, clock, ["bulk", "chat"], admissions=2000)
    assert stats.rejected == {}
    assert stats.admitted_cost["chat"] / stats.admitted_cost["bulk"] == pytest.approx(4, rel=0.1)


def test_slo_lower_class_gets_everything_when_higher_is_idle():
    clock = VirtualClock()
    slos = {"bulk": PipelineSLO(BIG, "batch"), "chat": PipelineSLO(BIG, "interactive", 4)}
    p = policy("slo", clock, max_in_flight=4, slos=slos)
    stats = saturate(p, clock, ["bulk"], admissions=200)
    assert stats.admitted >= 200 and "chat" not in stats.admitted_cost
    assert clock.now == pytest.approx(stats.admitted_cost["bulk"] / 4, abs=2.0)  # 4 busy lanes


def test_slo_rejects_an_unmeetable_deadline_early_with_retry_after():
    clock = VirtualClock()
    heard = []
    p = policy("slo", clock, max_in_flight=1, slos={"qa": PipelineSLO(2000)},
               on_reject=heard.append)
    r1 = p.try_admit(req("r1"))
    assert p.try_admit(req("r2")) is None  # starts at 1.0, done at 2.0: just meets 2.0
    assert p.try_admit(req("r3")) is None  # would finish at 3.0, a second late
    assert [(r.request.id, r.reason, r.retry_after) for r in heard] == [
        ("r3", "deadline_unmeetable", pytest.approx(1.0))]
    assert p.statistics().queue_depth == {"qa": 1}
    # retrying after retry_after succeeds: the backlog ahead drained while the budget moved on
    clock.advance(1.0)
    p.release(r1)
    assert ids(p.poll()) == ["r2"]
    assert p.decide(req("r3", at=1.0)).verdict is Verdict.QUEUE


def test_slo_rejects_requests_that_can_no_longer_make_it_at_dispatch():
    clock = VirtualClock()
    heard = []
    p = policy("slo", clock, max_in_flight=1, slos={"qa": PipelineSLO(2000)},
               on_reject=heard.append)
    r1 = p.try_admit(req("r1"))
    assert p.try_admit(req("r2")) is None
    clock.advance(1.5)  # r1 overran its prediction: r2 would finish at 2.5 > 2.0
    p.release(r1)
    assert p.poll() == []
    assert [(r.request.id, r.reason, r.at) for r in heard] == [("r2", "deadline_expired", 1.5)]
    assert heard[0].retry_after == MIN_RETRY_AFTER  # the system is idle again
    s = p.statistics()
    assert (s.queued, s.in_flight, s.rejected) == (0, 0, {"deadline_expired": 1})


def test_slo_never_rejects_when_there_is_room():
    p = policy("slo", VirtualClock(), max_in_flight=1, slos={"qa": PipelineSLO(100)})
    assert p.try_admit(req("slow", cost=5.0)) is not None  # the prediction may be wrong


def test_slo_queue_bound_is_per_pipeline():
    clock = VirtualClock()
    p = policy("slo", clock, max_in_flight=1, max_queue=1)
    p.try_admit(req("r0", "bulk", cost=2.0))
    assert p.try_admit(req("b1", "bulk")) is None
    assert p.try_admit(req("b2", "bulk")) is None
    assert p.last_rejection.reason == "queue_full"
    assert p.last_rejection.retry_after == pytest.approx(2.0)
    assert p.try_admit(req("c1", "chat")) is None
    assert p.statistics().queue_depth == {"bulk": 1, "chat": 1}
    assert p.statistics().rejected == {"queue_full": 1}


def test_decide_changes_nothing():
    p = policy("fcfs", VirtualClock(), max_in_flight=1)
    assert p.decide(req("r1")).verdict is Verdict.ADMIT
    assert p.decide(req("r1")).verdict is Verdict.ADMIT
    assert p.statistics().admitted == 0


def test_statistics_are_a_frozen_snapshot():
    p = policy("fcfs", VirtualClock(), max_in_flight=1)
    p.try_admit(req("r1"))
    s = p.statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.admitted = 5
    p.try_admit(req("r2"))
    assert (s.queued, p.statistics().queued) == (0, 1)


def test_default_deadline_is_arrival_plus_the_slo_budget():
    p = policy("simultaneous", VirtualClock(), slos={"qa": PipelineSLO(1500)})
    assert p.try_admit(req("r1", at=2.0)).deadline == 3.5
    assert p.try_admit(req("r2", "other", at=2.0)).deadline == 62.0  # default_slo: 60 s
    assert p.try_admit(req("r3", at=2.0, deadline=2.2)).deadline == 2.2


def test_slo_from_yaml_config():
    slo = PipelineSLO.from_config("qa", {"p99_ms": 3000, "priority": "interactive"})
    assert (slo.pipeline, slo.p99_ms, slo.rank, slo.weight) == ("qa", 3000, 2, 1.0)
    assert PipelineSLO(10, priority=7).rank == 7


@pytest.mark.parametrize("make, message", [
    (lambda: make_policy("magic"),
     "unknown admission policy 'magic'; known policies: fcfs, simultaneous, slo"),
    (lambda: make_policy("fcfs", max_inflight=3),
     "admission policy 'fcfs' has no option 'max_inflight'; its options: clock, cost_model, "
     "default_slo, max_cost, max_in_flight, max_queue, on_reject, slos"),
    (lambda: make_policy("fcfs", max_in_flight=0),
     "admission policy 'fcfs': max_in_flight must be a positive integer or None, got 0"),
    (lambda: make_policy("fcfs", max_in_flight=None),
     "admission policy 'fcfs': set max_in_flight or max_cost (with neither, use 'simultaneous')"),
    (lambda: make_policy("slo", max_in_flight=None, max_cost=4.0),
     "admission policy 'slo': max_in_flight must be a positive integer (the parallelism behind "
     "its queueing-delay prediction), got None"),
    (lambda: make_policy("fcfs", max_queue=-1),
     "admission policy 'fcfs': max_queue must be a non-negative integer, got -1"),
    (lambda: PipelineSLO(-5, pipeline="x"),
     "slo for pipeline 'x': p99_ms must be a positive number of milliseconds, got -5"),
    (lambda: PipelineSLO(0, pipeline="x"),
     "slo for pipeline 'x': p99_ms must be a positive number of milliseconds, got 0"),
    (lambda: PipelineSLO(100, weight=0, pipeline="x"),
     "slo for pipeline 'x': weight must be a positive number, got 0"),
    (lambda: PipelineSLO(100, priority="urgent"),
     "slo: priority must be 'interactive', 'standard', 'batch' or an integer class "
     "(higher is more urgent), got 'urgent'"),
    (lambda: PipelineSLO.from_config("x", {"p95_ms": 100}),
     "slo for pipeline 'x': unknown key 'p95_ms'; known keys: p99_ms, priority, weight"),
    (lambda: Request("r1", "qa", 0.0, prompt_tokens=-3),
     "request 'r1': prompt_tokens must be a non-negative integer, got -3"),
    (lambda: Request("r1", "qa", 0.0, max_tokens=-1),
     "request 'r1': max_tokens must be a non-negative integer, got -1"),
    (lambda: Request("r1", "", 0.0),
     "request 'r1': pipeline must be a non-empty string, got ''"),
    (lambda: CostModel(decode_tps=0),
     "cost model: decode_tps must be a positive number of tokens per second, got 0"),
    (lambda: CostModel().observe(req("r1"), -1.0),
     "cost model: observed seconds must be a non-negative number, got -1.0"),
])
def test_bad_input_messages(make, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make()


def test_slo_reserve_keeps_lanes_for_an_active_higher_class():
    clock = VirtualClock()
    slos = {"chat": ctl.PipelineSLO(2000, "interactive", 4, "chat"),
            "bulk": ctl.PipelineSLO(60000, "batch", 1, "bulk")}
    policy = ctl.make_policy("slo", max_in_flight=4, reserve=2, slos=slos, clock=clock)
    assert policy.try_admit(ctl.Request("c0", "chat", 0.0, max_tokens=10)) is not None
    bulk = [policy.try_admit(ctl.Request(f"b{i}", "bulk", 0.0, max_tokens=10))
            for i in range(4)]
    # 1 chat + 1 bulk fill the unreserved lanes; the other bulk requests wait
    assert [t is not None for t in bulk] == [True, False, False, False]
    assert policy.try_admit(ctl.Request("c1", "chat", 0.0, max_tokens=10)) is not None
    assert policy.poll() == []  # 3 of 4 lanes busy, the last one is reserved
    clock.now = 20.0  # the interactive class has gone quiet: bulk may take the last lane
    assert [t.request.id for t in policy.poll()] == ["b1"]


def test_slo_overflow_lanes_go_to_the_top_class_over_a_less_urgent_one():
    """All lanes taken by bulk: a chat request takes an overflow lane (the engine pauses a
    bulk sequence for it) instead of waiting for a bulk one to finish; bulk never does,
    nor chat when nothing less urgent runs; the lanes come back on release."""
    clock = VirtualClock()
    slos = {"chat": ctl.PipelineSLO(2000, "interactive", 4, "chat"),
            "bulk": ctl.PipelineSLO(60000, "batch", 1, "bulk")}
    policy = ctl.make_policy("slo", max_in_flight=2, overflow=2, slos=slos, clock=clock)
    bulk = [policy.try_admit(ctl.Request(f"b{i}", "bulk", 0.0, max_tokens=10))
            for i in range(3)]
    assert [t is not None for t in bulk] == [True, True, False]  # b2 waits: no overflow
    chats = [policy.try_admit(ctl.Request(f"c{i}", "chat", 0.0, max_tokens=10))
             for i in range(3)]
    assert [t is not None for t in chats] == [True, True, False]  # 2 + 2 overflow lanes
    assert policy.statistics().in_flight == 4
    policy.release(bulk[0])  # back to 3 of 2 + 2: the waiting chat (top class) goes first
    (c2,) = policy.poll()
    assert c2.request.id == "c2"
    for t in (bulk[1], chats[0], chats[1], c2):
        policy.release(t)
    assert [t.request.id for t in policy.poll()] == ["b2"]
    # only chat in flight now: nothing less urgent to pause, so no overflow lane
    alone = ctl.make_policy("slo", max_in_flight=1, overflow=2, slos=slos, clock=clock)
    first = alone.try_admit(ctl.Request("c0", "chat", 0.0, max_tokens=10))
    assert first is not None
    assert alone.try_admit(ctl.Request("c1", "chat", 0.0, max_tokens=10)) is None


def test_slo_overflow_must_be_a_count():
    with pytest.raises(ValueError, match=r"^admission policy 'slo': overflow must be a "
                       r"non-negative integer, got -1$"):
        ctl.make_policy("slo", max_in_flight=4, overflow=-1)


def test_slo_reserve_must_leave_a_lane():
    with pytest.raises(ValueError, match=r"^admission policy 'slo': reserve must be a "
                       r"non-negative integer below max_in_flight \(4\), got 4$"):
        ctl.make_policy("slo", max_in_flight=4, reserve=4)
