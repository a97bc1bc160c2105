"""One admission gate for the cluster: ``ClusterGate`` clients in several processes share
one ``GateActor`` (its policy, its max_in_flight); tickets are given back exactly once."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

import tailrace as tr
from tailrace.control import AdmissionRejected
from tailrace.request import REQUEST, Request
from tailrace.runtime.ray.gate import ClusterGate, GateUnavailable
from tailrace.serving import PipelineService


@pytest.fixture(autouse=True)
def _ray(ray_session):
    return ray_session


@pytest.fixture
def make_gate():
    made = []

    def make(policy="fcfs", **options):
        g = ClusterGate(policy, name=f"test-{uuid.uuid4().hex[:8]}", **options)
        made.append(g)
        return g

    yield make
    for g in made:
        g.shutdown()


def wait_until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


async def until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def hold_tickets(name: str, n: int, hold_s: float) -> list[tuple[float, float]]:
    """In another process: ``n`` concurrent admissions through gate ``name``, each held
    ``hold_s``; their (admitted, released) wall-clock times."""

    async def one(gate):
        ticket = await gate.admit("p", {"text": "hi"})
        start = time.time()
        await asyncio.sleep(hold_s)
        end = time.time()
        gate.done(ticket)
        return start, end

    async def main():
        gate = ClusterGate(name=name)  # finds the actor the test created
        try:
            return await asyncio.gather(*(one(gate) for _ in range(n)))
        finally:
            gate.close()

    return asyncio.run(main())


def test_two_processes_never_exceed_max_in_flight_together(ray_session, make_gate):
    gate = make_gate("fcfs", max_in_flight=2, max_queue=100)
    task = ray_session.remote(num_cpus=0)(hold_tickets)
    spans = [s for part in ray_session.get([task.remote(gate.name, 6, 0.03)
                                             for _ in range(2)], timeout=120)
             for s in part]
    assert len(spans) == 12
    # a client's span lies inside the actor's (admitted before, released after)
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    assert most <= 2
    wait_until(lambda: gate.statistics().in_flight == 0)
    st = gate.statistics()
    assert st.admitted == st.completed == 12
    assert gate.counters()["held"] == 0


def test_fcfs_order_and_429_with_retry_after_through_the_actor(make_gate):
    gate = make_gate("fcfs", max_in_flight=1, max_queue=2)

    async def main():
        first = await gate.admit("p", {"text": "a"})
        order = []

        async def queued(i):
            t = await gate.admit("p", {"text": "b"})
            order.append(i)
            gate.done(t)

        waiters = []
        for i in range(2):  # queued in this order
            waiters.append(asyncio.ensure_future(queued(i)))
            await until(lambda i=i: gate.statistics().queued >= i + 1)
        with pytest.raises(AdmissionRejected) as e:
            await gate.admit("p", {"text": "c"})
        assert e.value.reason == "queue_full" and e.value.retry_after > 0
        gate.done(first)
        await asyncio.gather(*waiters)
        return order

    assert asyncio.run(main()) == [0, 1]
    wait_until(lambda: gate.statistics().in_flight == 0)


def test_slo_admits_the_urgent_class_first(make_gate):
    gate = make_gate("slo", max_in_flight=1)

    async def main():
        first = await gate.admit("p", {"text": "a"})
        order = []

        async def queued(cls):
            t = await gate.admit("p", {"text": "b", REQUEST: Request(asked={"priority": cls})})
            order.append(cls)
            gate.done(t)

        waiters = []
        for i, cls in enumerate(["batch", "interactive"]):
            waiters.append(asyncio.ensure_future(queued(cls)))
            await until(lambda i=i: gate.statistics().queued >= i + 1)
        gate.done(first)
        await asyncio.gather(*waiters)
        return order

    assert asyncio.run(main()) == ["interactive", "batch"]


def test_a_second_release_is_a_counted_no_op(make_gate):
    gate = make_gate("fcfs", max_in_flight=1)

    async def main():
        t = await gate.admit("p", {"text": "a"})
        gate.done(t)
        gate.done(t)
        return await gate.admit("p", {"text": "b"})  # admitted: one slot, given back once

    t2 = asyncio.run(main())
    wait_until(lambda: gate.counters()["repeated_releases"] == 1)
    st = gate.statistics()
    assert st.in_flight == 1 and st.completed == 1
    gate.done(t2)
    wait_until(lambda: gate.statistics().in_flight == 0)
    assert gate.counters() == {"released": 2, "repeated_releases": 1, "cancelled": 0,
                               "expired": 0, "held": 0, "waiting": 0, "owners": 1}


def test_a_caller_cancelled_while_queued_leaves_nothing_behind(make_gate):
    gate = make_gate("fcfs", max_in_flight=1)

    async def main():
        first = await gate.admit("p", {"text": "a"})
        waiter = asyncio.ensure_future(gate.admit("p", {"text": "b"}))
        await until(lambda: gate.statistics().queued >= 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await until(lambda: gate.counters()["cancelled"] >= 1)
        gate.done(first)

    asyncio.run(main())
    wait_until(lambda: gate.statistics().in_flight == 0)
    st = gate.statistics()
    # as in AdmissionGate, the policy still admits the abandoned request when a slot
    # frees, and the gate gives that ticket straight back: nothing held, nothing queued
    assert st.queued == 0 and st.admitted == st.completed == 2
    assert gate.counters()["held"] == 0 and gate.counters()["released"] == 1


def test_a_killed_gate_actor_fails_admissions_at_once(make_gate):
    gate = make_gate("fcfs", max_in_flight=1)
    gate.shutdown()

    async def main():
        return await asyncio.wait_for(gate.admit("p", {"text": "a"}), 30)

    with pytest.raises(GateUnavailable, match="is unavailable"):
        asyncio.run(main())
    with pytest.raises(GateUnavailable):
        gate.statistics()


def double(r):
    return {**r, "y": 2 * r["x"]}


def test_a_ray_pipeline_service_admits_through_the_cluster_gate(make_gate):
    gate = make_gate("fcfs", max_in_flight=2)
    p = tr.Pipeline("gated")
    p.source(fields=["x"]).map(double, id="double").sink()
    svc = PipelineService(p, admission=gate, runtime="ray", timeout_s=60).start()
    try:
        assert svc.wait_ready(120), svc.failure

        async def main():
            return await asyncio.gather(*(svc.submit({"x": i}) for i in range(6)))

        assert asyncio.run(main()) == [{"x": i, "y": 2 * i} for i in range(6)]
    finally:
        svc.stop()
    wait_until(lambda: gate.statistics().in_flight == 0)
    assert gate.statistics().admitted == 6
    assert gate.counters()["released"] == 6 and gate.counters()["repeated_releases"] == 0


def test_serve_gate_cluster_needs_ray_and_an_admission_policy(tmp_path, capsys):
    from tailrace.cli.main import main

    pipe = tmp_path / "p.yaml"
    pipe.write_text("name: p\n")
    assert main(["serve", str(pipe), "--gate", "cluster", "--admission", "fcfs"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tailrace: error: --gate cluster puts the admission policy in a Ray actor: it needs "
        "--runtime ray and --admission fcfs|slo|simultaneous")


def test_build_gate_for_the_cluster_shares_one_actor_by_name():
    from tailrace.cli.serve import build_gate

    name = f"test-{uuid.uuid4().hex[:8]}"
    a = build_gate("fcfs", [], 1, cluster=name)
    b = build_gate("fcfs", [], 1, cluster=name)
    try:
        assert isinstance(a, ClusterGate) and isinstance(b, ClusterGate)

        async def main():
            t = await a.admit("p", {"text": "x"})
            waiter = asyncio.ensure_future(b.admit("p", {"text": "y"}))
            await until(lambda: a.statistics().queued == 1)  # b waits behind a's ticket
            a.done(t)
            b.done(await waiter)

        asyncio.run(main())
        wait_until(lambda: b.statistics().in_flight == 0)
        assert a.statistics().admitted == 2
    finally:
        a.shutdown()


def test_a_served_request_gets_503_when_the_gate_actor_is_gone(make_gate):
    from tailrace.serving.errors import RequestFailed

    gate = make_gate("fcfs", max_in_flight=2)
    p = tr.Pipeline("gated-503")
    p.source(fields=["x"]).map(double, id="double").sink()
    svc = PipelineService(p, admission=gate, runtime="ray", timeout_s=60).start()
    try:
        assert svc.wait_ready(120), svc.failure
        gate.shutdown()
        with pytest.raises(RequestFailed) as e:
            asyncio.run(svc.submit({"x": 1}))
        assert e.value.status == 503 and e.value.code == "gate_unavailable"
        assert e.value.retry_after == 1.0 and "is unavailable" in str(e.value)
    finally:
        svc.stop()


class Holder:
    """A driver-like process that takes a ticket and keeps it."""

    def __init__(self, name: str) -> None:
        self.gate = ClusterGate(name=name, lease_s=2.0)

    async def take(self) -> str:
        return (await self.gate.admit("p", {"text": "mine"})).request.id


def test_a_dead_clients_tickets_are_freed_when_its_lease_runs_out(ray_session, make_gate):
    gate = make_gate("fcfs", max_in_flight=1, lease_s=2.0)
    holder = ray_session.remote(num_cpus=0)(Holder).remote(gate.name)
    ray_session.get(holder.take.remote(), timeout=60)
    assert gate.statistics().in_flight == 1

    async def main():
        waiter = asyncio.ensure_future(gate.admit("p", {"text": "next"}))
        await asyncio.sleep(3.0)  # > lease_s: a live holder keeps its ticket (it renews)
        assert not waiter.done()
        ray_session.kill(holder)  # its process dies, holding the ticket
        gate.done(await asyncio.wait_for(waiter, 30))

    asyncio.run(main())
    wait_until(lambda: gate.statistics().in_flight == 0)
    assert gate.counters()["expired"] == 1
