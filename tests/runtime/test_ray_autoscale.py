"""Elastic stages on Ray: ``replicas: {min, max}`` scales a stage's replicas on its
queue depth (and admission backlog) while the run goes on, and back when it idles;
every record still ends exactly once, also when a scaled-out replica's actor dies."""

import asyncio
import threading
import time
from collections import Counter
from contextlib import contextmanager
from itertools import groupby

import pytest

import tailrace as tr
from tailrace.errors import PlanError
from tailrace.runtime.ray import ActiveRuns, autoscale


def slow(x):
    time.sleep(0.01)
    return x * 2


def slower(x):
    time.sleep(0.02)
    return x * 2


def plus(x):
    return x + 1


@pytest.fixture
def quick(monkeypatch):
    """Scale decisions in fractions of a second (the defaults are 1 s up, 10 s down)."""
    monkeypatch.setattr(autoscale, "SCALE_UP_S", 0.2)
    monkeypatch.setattr(autoscale, "SCALE_DOWN_S", 0.5)


@contextmanager
def watching(stage: str, runs: ActiveRuns):
    """The stage's active replicas in the runs ``runs`` lists, sampled every 20 ms while
    the block runs."""
    seen: list = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for r in runs.describe():
                n = r.get("active_replicas", {}).get(stage)
                if n is not None:
                    seen.append(n)
            time.sleep(0.02)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        stop.set()
        watcher.join()


def test_a_busy_elastic_stage_scales_out_and_loses_nothing(ray_session, quick):
    n = 600
    p = tr.Pipeline("elastic")
    p.source(range(n)).map(slow, id="work", replicas={"min": 1, "max": 3}, queue=64) \
        .map(plus, id="post").sink(got := [])
    runs = ActiveRuns()
    with watching("work", runs) as seen:
        result = tr.run(p, runtime="ray", runs=runs)
    assert Counter(got) == Counter(x * 2 + 1 for x in range(n))
    assert result.stats.records_in == result.stats.records_out == n
    assert max(seen) >= 2, f"never scaled out: {sorted(set(seen))}"
    assert max(seen) <= 3  # the declared bound
    assert result.stats["work"].records_in == n  # summed over every replica it had
    assert result.stats["work"].replicas == max(seen)  # the table shows the replicas it had
    events = result.stats.scale_events  # each scaling, in order, as the run reports it
    assert events and all(stage == "work" for _, stage, _ in events)
    assert max(k for _, _, k in events) == max(seen)
    assert [t for t, _, _ in events] == sorted(t for t, _, _ in events)


def test_a_fixed_stage_is_never_scaled(ray_session, quick):
    p = tr.Pipeline("fixed")
    p.source(range(200)).map(slow, id="work", replicas=1, queue=64).sink(got := [])
    runs = ActiveRuns()
    with watching("work", runs) as seen:
        result = tr.run(p, runtime="ray", runs=runs)
    assert sorted(got) == [x * 2 for x in range(200)]
    assert not seen  # not elastic: nothing to report
    assert result.stats.scale_events == ()


def test_scaled_out_replicas_retire_when_idle_and_return_under_load(ray_session, quick):
    """A served-style run: load, a pause (back to min), load again (out again)."""
    async def feed():
        for x in range(300):
            yield x
        await asyncio.sleep(3.0)  # idle: the extra replicas retire
        for x in range(300, 600):
            yield x

    p = tr.Pipeline("waves")
    p.source(feed()).map(slow, id="work", replicas={"min": 1, "max": 2}, queue=64) \
        .sink(got := [])
    runs = ActiveRuns()
    with watching("work", runs) as seen:
        result = tr.run(p, runtime="ray", runs=runs)
    assert sorted(got) == [x * 2 for x in range(600)]
    steps = [k for k, _ in groupby(seen)]
    assert steps[:4] == [1, 2, 1, 2], f"expected out, in, out again: {steps}"
    reported = [k for _, _, k in result.stats.scale_events]
    assert reported[:3] == [2, 1, 2], f"the run's own scale events: {reported}"


def test_killing_a_scaled_out_replica_loses_and_duplicates_nothing(ray_session, quick):
    ray = ray_session
    n = 1500
    got: list = []
    killed: list = []
    runs = ActiveRuns()

    def sink(x):
        got.append(x)
        if len(got) == 500 and not killed:
            [run] = [r for r in runs.describe() if r["pipeline"] == "elastic-kill"]
            hosts = run["stages"]["work"]
            if len(hosts) > 1:
                ray.kill(ray.get_actor(hosts[-1][0]), no_restart=False)
                killed.append(hosts[-1][0])

    p = tr.Pipeline("elastic-kill")
    p.source(range(n)).map(slow, id="work", replicas={"min": 1, "max": 2}, queue=64) \
        .map(plus, id="post").sink(sink)
    result = tr.run(p, runtime="ray", runs=runs)
    assert killed, "the stage never scaled out before 500 outputs"
    assert Counter(got) == Counter(x * 2 + 1 for x in range(n))
    assert result.stats.records_out == n


@pytest.mark.parametrize("bounds, message", [
    ({"min": 2, "max": 1}, "'replicas.max' must be an integer >= 'replicas.min' (2)"),
    ({"min": 1}, "'replicas' must be a positive integer or a mapping like {min: 1, max: 4}"),
    ({"min": 1, "max": 2, "step": 1}, "a mapping like {min: 1, max: 4}"),
])
def test_bad_bounds_are_refused(bounds, message):
    p = tr.Pipeline("bad")
    with pytest.raises(PlanError, match=message.replace("{", r"\{").replace("(", r"\(")
                       .replace(")", r"\)")):
        p.source([1]).map(plus, replicas=bounds).sink([])
        tr.compile_pipeline(p)



def slow_request(r):
    time.sleep(0.03)
    return {**r, "y": r["x"] * 10}


def test_a_served_elastic_stage_scales_under_admission_and_answers_everyone(ray_session,
                                                                              quick):
    """Requests through ``PipelineService(runtime="ray")`` and a gate: the stage scales
    out while they queue, every caller gets its own answer, every ticket comes back."""
    from tailrace.control import AdmissionGate, make_policy
    from tailrace.serving import PipelineService

    gate = AdmissionGate(make_policy("fcfs", max_in_flight=16, max_queue=1000))
    p = tr.Pipeline("elastic-svc")
    p.source(fields=["x"]).map(slow_request, id="work", replicas={"min": 1, "max": 3},
                               queue=16).sink()
    runs = ActiveRuns()
    svc = PipelineService(p, admission=gate, runtime="ray", timeout_s=120, runs=runs).start()
    try:
        assert svc.wait_ready(120), svc.failure

        async def main():
            return await asyncio.gather(*(svc.submit({"x": i}) for i in range(150)))

        with watching("work", runs) as seen:
            got = asyncio.run(main())
        assert got == [{"x": i, "y": 10 * i} for i in range(150)]
        assert max(seen) >= 2, f"never scaled out: {sorted(set(seen))}"
        deadline = time.monotonic() + 30
        while gate.statistics().in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gate.statistics().in_flight == 0 and svc.pending == 0
    finally:
        svc.stop()
        gate.close()


def test_a_replica_waiting_for_placement_holds_up_no_other_stage(ray_session, quick,
                                                                 monkeypatch):
    """A scale-out that waits (its actor pending until the Ray autoscaler adds a node:
    here it never comes) neither stops the other elastic stages from scaling nor the run
    from ending."""
    orig = autoscale.Elastic.scale_out
    pending: list = []

    async def placing(self, i):
        if self.run.plan.stages[i].id == "first":
            pending.append(i)
            await asyncio.sleep(1000)  # never placed
        await orig(self, i)

    monkeypatch.setattr(autoscale.Elastic, "scale_out", placing)
    p = tr.Pipeline("elastic-two")
    p.source(range(600)).map(slow, id="first", replicas={"min": 1, "max": 2}, queue=64) \
        .map(slower, id="second", replicas={"min": 1, "max": 2}, queue=64).sink(got := [])
    result = tr.run(p, runtime="ray")
    assert sorted(got) == [x * 4 for x in range(600)]
    assert pending, "the first stage never tried to scale out"
    assert result.stats["first"].replicas == 1
    assert result.stats["second"].replicas == 2
