"""PipelineService and ServingHub without HTTP: routing, errors, drain, bounds, stats."""

from __future__ import annotations

import asyncio

import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.errors import PlanError
from tailrace.serving import (
    PipelineService,
    RecordDropped,
    RequestFailed,
    ServiceError,
    ServiceOverloaded,
    ServiceUnavailable,
    ServingHub,
)
from tests.serving import fakes


def shout_pipeline(name: str = "shout") -> tr.Pipeline:
    p = tr.Pipeline(name)
    p.source(fields=["text"]).map(fakes.shout, id="shout").sink()
    return p


def held_pipeline(name: str = "held") -> tr.Pipeline:
    p = tr.Pipeline(name)
    p.source(fields=["text"]).map(fakes.held, id="held", blocking=True).sink()
    return p


@pytest.fixture
def gate_closed():
    fakes.GATE.clear()
    fakes.ENTERED.clear()
    yield fakes.GATE
    fakes.GATE.set()


def test_outputs_return_to_their_callers():
    svc = PipelineService(shout_pipeline()).start()
    try:
        async def main():
            return await asyncio.gather(*[svc.submit({"text": f"r{i}"}) for i in range(50)])

        outs = asyncio.run(main())
        assert outs == [{"text": f"r{i}", "loud": f"R{i}"} for i in range(50)]
        stats = svc.stats()  # live snapshot while running
        assert stats["shout"].records_out == 50 and stats.records_in == 50
        assert svc.ready and svc.pending == 0 and svc.name == "shout"
    finally:
        svc.stop()
    assert not svc.ready


def test_error_record_raises_request_failed_with_the_record():
    svc = PipelineService(shout_pipeline()).start()
    try:
        with pytest.raises(RequestFailed, match="stage 'shout': ValueError: no boom") as ei:
            asyncio.run(svc.submit({"text": "boom"}))
        assert ei.value.status == 500 and ei.value.code == "ValueError"
        assert ei.value.record.to_dict()["input"] == {"text": "boom"}  # transient fields gone
        with pytest.raises(RequestFailed, match="stage 'shout': KeyError"):
            asyncio.run(svc.submit({"other": 1}))
        with pytest.raises(ServiceError, match="a record must be a JSON object, got list"):
            asyncio.run(svc.submit([1, 2]))  # type: ignore[arg-type]
    finally:
        svc.stop()


def test_not_started_and_stopped_services_are_unavailable():
    svc = PipelineService(shout_pipeline())
    with pytest.raises(ServiceUnavailable, match="'shout' is not started; call start"):
        asyncio.run(svc.submit({"text": "a"}))
    svc.start()
    svc.stop()
    with pytest.raises(ServiceUnavailable, match="stopping or stopped") as ei:
        asyncio.run(svc.submit({"text": "a"}))
    assert ei.value.status == 503 and ei.value.retry_after == 1.0
    with pytest.raises(ServiceError, match="start\\(\\) called twice"):
        svc.start()


def test_stop_drains_every_waiting_caller(gate_closed):
    svc = PipelineService(held_pipeline()).start()

    async def main():
        tasks = [asyncio.ensure_future(svc.submit({"text": str(i)})) for i in range(5)]
        await asyncio.get_running_loop().run_in_executor(None, fakes.ENTERED.wait, 5)
        stopper = asyncio.get_running_loop().run_in_executor(None, svc.stop)
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks)  # stop waits for the drain
        gate_closed.set()
        await stopper
        return await asyncio.gather(*tasks)

    outs = asyncio.run(main())
    assert [o["text"] for o in outs] == ["0", "1", "2", "3", "4"]
    assert all(o["held"] for o in outs)


def test_max_pending_rejects_instead_of_queueing_without_bound(gate_closed):
    svc = PipelineService(held_pipeline(), max_pending=2).start()
    try:
        async def main():
            first = [asyncio.ensure_future(svc.submit({"text": str(i)})) for i in range(2)]
            await asyncio.sleep(0)
            with pytest.raises(ServiceOverloaded, match="2 requests already waiting") as ei:
                await svc.submit({"text": "x"})
            assert ei.value.status == 429 and ei.value.retry_after == 1.0
            gate_closed.set()
            return await asyncio.gather(*first)

        assert len(asyncio.run(main())) == 2
    finally:
        svc.stop()


def test_max_pending_bounds_the_feed_even_when_callers_give_up(gate_closed):
    """Records of callers that gave up stay in the feed until the source takes them: they
    keep their slot, so a stuck pipeline cannot make the feed grow past ``max_pending``."""
    p = tr.Pipeline("stuck")
    p.source(fields=["text"]).map(fakes.held, id="held", blocking=True, queue=1).sink()
    svc = PipelineService(p, max_pending=4).start()
    try:
        async def main():
            depths, refused = [], 0
            for _ in range(3):
                tasks = [asyncio.ensure_future(svc.submit({"text": str(i)})) for i in range(4)]
                for _ in range(5):
                    await asyncio.sleep(0.01)
                    depths.append(svc._queue.qsize())
                for t in tasks:
                    t.cancel()
                for r in await asyncio.gather(*tasks, return_exceptions=True):
                    refused += isinstance(r, ServiceOverloaded)
            return depths, refused

        depths, refused = asyncio.run(main())
        assert max(depths) <= 4 and svc.queued <= 4
        assert refused >= 4  # the later rounds find the feed full
    finally:
        gate_closed.set()
        svc.stop()
    assert svc.queued == 0 and svc.pending == 0


def test_a_caller_is_answered_after_its_record_is_counted(monkeypatch):
    """The runtime counts a record and frees its ticket after handing it to the sink;
    answering waits for that, so stats and the gate read right after an answer are
    complete (a race seen as ``records_out`` one short)."""
    from tailrace.serving import service as service_mod

    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2))
    svc = PipelineService(shout_pipeline(), admission=gate).start()
    seen = []
    answer = service_mod._answer

    def spy(waiter, value, exc):
        seen.append((svc.local_run.records_out, gate.statistics().in_flight))
        answer(waiter, value, exc)

    monkeypatch.setattr(service_mod, "_answer", spy)
    try:
        for i in range(3):
            asyncio.run(svc.submit({"text": f"r{i}"}))
        assert seen == [(1, 0), (2, 0), (3, 0)]
        assert svc.stats().records_out == 3
    finally:
        svc.stop()
        gate.close()


@pytest.mark.parametrize("contract", [{}, {"retries": 1}], ids=["fused", "careful"])
def test_a_record_a_filter_drops_is_answered_at_once(contract):
    p = tr.Pipeline("drop")
    (p.source(fields=["text"]).filter(lambda r: r["text"] != "skip", id="keep", **contract)
     .sink())
    svc = PipelineService(p, timeout_s=30).start()
    try:
        async def main():
            kept = asyncio.ensure_future(svc.submit({"text": "a"}))
            with pytest.raises(RecordDropped, match="pipeline 'drop': stage 'keep' "
                                                    "dropped this record") as ei:
                await svc.submit({"text": "skip"})
            assert ei.value.status == 422 and ei.value.code == "record_dropped"
            return await kept

        assert asyncio.run(main()) == {"text": "a"}
        assert svc.pending == 0
    finally:
        svc.stop()


def test_a_record_that_loses_its_request_id_is_answered_at_once_with_the_reason():
    """It used to wait for timeout_s: the stage that dropped the request is named now."""
    p = tr.Pipeline("lost")
    p.source(fields=["text"]).map(lambda r: {"text": r["text"]}, id="fresh").sink()
    svc = PipelineService(p, timeout_s=60).start()
    try:
        with pytest.raises(RecordDropped, match="stage 'fresh' dropped this record .* "
                                                "without keeping its '_request'"):
            asyncio.run(asyncio.wait_for(svc.submit({"text": "a"}), 10))
        assert svc.pending == 0
    finally:
        svc.stop()


def test_admission_rejection_carries_retry_after(gate_closed):
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=0))
    svc = PipelineService(held_pipeline(), admission=gate).start()
    try:
        async def main():
            first = asyncio.ensure_future(svc.submit({"text": "a"}))
            await asyncio.get_running_loop().run_in_executor(None, fakes.ENTERED.wait, 5)
            with pytest.raises(RequestFailed, match="stage 'admission': AdmissionRejected") as ei:
                await svc.submit({"text": "b"})
            gate_closed.set()
            return ei.value, await first

        err, out = asyncio.run(main())
        assert err.status == 429 and err.code == "admission_rejected"
        assert err.retry_after is not None and err.retry_after > 0
        assert out["held"] is True
        assert gate.statistics().rejected == {"queue_full": 1}
    finally:
        svc.stop()
        gate.close()


def test_unservable_pipelines_are_plan_errors():
    p = tr.Pipeline("closed")
    p.source([1, 2]).map(lambda x: x).sink()
    with pytest.raises(PlanError, match="'closed' cannot be served: it needs exactly one "
                                        "source declared without data"):
        PipelineService(p)
    q = tr.Pipeline("kept")
    q.source(fields=["text"]).map(lambda x: x).sink([])
    with pytest.raises(PlanError, match="'kept' cannot be served: no sink without a target"):
        PipelineService(q)
    with pytest.raises(ValueError, match="max_pending must be a positive integer, got 0"):
        PipelineService(shout_pipeline(), max_pending=0)


def test_hub_names_and_pools():
    a, b = PipelineService(shout_pipeline("a")), PipelineService(shout_pipeline("b"))
    hub = ServingHub([a, b])
    assert list(hub.services) == ["a", "b"] and hub.gate is None and not hub.ready
    assert isinstance(hub.pools(), dict)
    with pytest.raises(PlanError, match="two pipelines are named 'a'"):
        ServingHub([a, PipelineService(shout_pipeline("a"))])
    with pytest.raises(ValueError, match="max_body_bytes must be a positive integer"):
        ServingHub([a], max_body_bytes=0)
    hub.start()
    try:
        assert all(s.wait_ready(10) for s in hub.services.values()) and hub.ready
    finally:
        hub.stop()


def test_a_service_that_fails_to_start_says_why():
    p = tr.Pipeline("broken")
    p.source(fields=["text"]).apply(fakes.Broken, id="load").sink()
    svc = PipelineService(p).start()
    assert svc.wait_ready(10) is False and not svc.ready
    assert isinstance(svc.failure, RuntimeError)
    with pytest.raises(ServiceUnavailable, match="'broken' failed: RuntimeError: model file "
                                                 "vanished"):
        asyncio.run(svc.submit({"text": "a"}))
    svc.stop()  # a no-op on a failed service
