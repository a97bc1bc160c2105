"""Stages in the driver on Ray (``placement: {where: driver}``; a served run's default for
single-replica inline stages fed by the driver): no actor hop, the same outputs, error
records, drops, statistics and admission as on a stage host."""

from __future__ import annotations

import asyncio

import pytest

import tailrace as tr
from tailrace.compiler import compile_pipeline
from tailrace.control import AdmissionGate, make_policy
from tailrace.errors import PlanError
from tailrace.runtime.ray import ActiveRuns
from tailrace.runtime.ray.placement import driver_stages, parse_placement
from tailrace.serving import PipelineService
from tailrace.serving.errors import RecordDropped, RequestFailed


def double(r):
    if r["x"] == 3:
        raise ValueError("three is not allowed")
    return {**r, "y": r["x"] * 2}


def odd(r):
    return r["x"] % 2 == 1


def twice(r):
    return [{**r, "k": 0}, {**r, "k": 1}]


def served_pipeline():
    p = tr.Pipeline("drv")
    p.source(fields=["x"]).map(double, id="double").filter(odd, id="odd").sink()
    return p


# -- which stages run in the driver (no Ray needed) -------------------------------------------
def test_served_runs_put_inline_stages_fed_by_the_driver_there_batch_runs_do_not():
    plan = compile_pipeline(served_pipeline())
    [i] = [i for i, s in enumerate(plan.stages) if s.ops[0].id == "double"]
    assert driver_stages(plan, parse_placement(plan, None), served=True) == {i}
    assert driver_stages(plan, parse_placement(plan, None), served=False) == set()
    host = parse_placement(plan, {"double": {"where": "host"}})
    assert driver_stages(plan, host, served=True) == set()
    drv = parse_placement(plan, {"double": {"where": "driver"}})
    assert driver_stages(plan, drv, served=False) == {i}


def test_only_a_stage_after_driver_stages_follows_them_there():
    p = tr.Pipeline("t")
    p.source([1]).map(double, id="a", blocking=True).map(double, id="b").sink()
    plan = compile_pipeline(p)
    # b is inline but fed by a, which runs blocking code on a host
    assert driver_stages(plan, parse_placement(plan, None), served=True) == set()


@pytest.mark.parametrize("contract, why", [
    ({"replicas": 2}, "it has several replicas"),
    ({"blocking": True}, "it runs thread code"),
    ({"placement": {"where": "driver", "num_cpus": 1}}, "it reserves resources"),
])
def test_where_driver_on_a_stage_that_cannot_is_refused_naming_it(contract, why):
    p = tr.Pipeline("t")
    placement = contract.pop("placement", {"where": "driver"})
    p.source([1]).map(double, id="m", placement=placement, **contract).sink()
    with pytest.raises(PlanError, match=why) as e:
        parse_placement(compile_pipeline(p), None)
    assert "stage 'm'" in str(e.value) or e.value.stage == "m"


def test_where_driver_after_a_host_stage_is_refused():
    p = tr.Pipeline("t")
    p.source([1]).map(double, id="a", blocking=True).map(double, id="b").sink()
    with pytest.raises(PlanError, match="a stage before it runs in an actor"):
        parse_placement(compile_pipeline(p), {"b": {"where": "driver"}})


def test_unknown_where_is_refused():
    p = tr.Pipeline("t")
    p.source([1]).map(double, id="m").sink()
    with pytest.raises(PlanError, match="placement where must be one of driver, host"):
        parse_placement(compile_pipeline(p), {"m": {"where": "gpu"}})


# -- runs on Ray --------------------------------------------------------------------------------
@pytest.fixture
def ray(ray_session):
    return ray_session


def test_batch_run_with_where_driver_answers_like_hosts(ray):
    """A fan-out in the driver feeding a stage on a host: lineage, errors and statistics
    as on hosts; a lambda (which no actor could receive) runs there."""
    out: list = []
    seen: list = []

    def watch(x):
        seen.extend(r["in_driver"] for r in runs.describe())
        out.append(x)

    p = tr.Pipeline("t")
    (p.source([{"x": i} for i in range(6)])
     .map(lambda r: {**r, "lam": True}, id="lam", placement={"where": "driver"})
     .flat_map(twice, id="fan", placement={"where": "driver"})
     .map(double, id="double", blocking=True)
     .sink(watch))
    runs = ActiveRuns()
    result = tr.run(p, runtime="ray", fuse=False, runs=runs)
    assert sorted((r["x"], r["k"]) for r in out) == [(x, k) for x in range(6) if x != 3
                                                      for k in (0, 1)]
    assert all(r["lam"] and r["y"] == 2 * r["x"] for r in out)
    assert sorted((e.stage, e.input["x"], e.error) for e in result.errors) == [
        ("double", 3, "ValueError"), ("double", 3, "ValueError")]
    assert seen and seen[0] == ["lam", "fan"]
    assert result.stats["fan"].records_in == 6 and result.stats["fan"].records_out == 12
    assert result.stats["lam"].records_out == 6


async def started(svc):
    """Start ``svc`` on this loop and wait until its run is installed."""
    svc.start(asyncio.get_running_loop())
    while not svc.ready:
        assert svc.failure is None, svc.failure
        await asyncio.sleep(0.05)


def test_served_run_answers_errors_and_drops_from_the_driver(ray):
    """The default of a served run: its inline head stage runs in the driver (no actor);
    an answer, an error record and a filter's drop reach their callers; the gate gets
    every ticket back."""
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=16))
    runs = ActiveRuns()
    svc = PipelineService(served_pipeline(), runtime="ray", admission=gate, runs=runs)

    async def main():
        await started(svc)
        [run] = runs.describe()
        assert run["in_driver"] == ["double", "odd"] and run["stages"] == {}
        outs = await asyncio.gather(*(svc.submit({"x": x}) for x in (1, 5, 7)))
        with pytest.raises(RequestFailed, match="three is not allowed"):
            await svc.submit({"x": 3})
        with pytest.raises(RecordDropped):
            await svc.submit({"x": 2})
        stats = svc.stats()
        await svc.aclose()
        return outs, stats

    outs, stats = asyncio.run(main())
    assert [o["y"] for o in outs] == [2, 10, 14]
    assert stats["double"].records_in == 5 and stats["double"].errors == 1
    assert gate.statistics().in_flight == 0


def test_served_run_where_host_keeps_its_stages_on_actors(ray):
    runs = ActiveRuns()
    svc = PipelineService(served_pipeline(), runtime="ray", runs=runs,
                          placement={"*": {"where": "host"}})

    async def main():
        await started(svc)
        [run] = runs.describe()
        out = await svc.submit({"x": 5})
        await svc.aclose()
        return run, out

    run, out = asyncio.run(main())
    assert out["y"] == 10
    assert run["in_driver"] == [] and set(run["stages"]) == {"double", "odd"}
