"""PipelineService on its callers' own event loop (``start(loop)``, as ``tailrace serve``
runs it): answers without a thread hop, loads engines off the loop, drains on ``aclose``;
and the request feed handing a burst to the pipeline as one micro-batch."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.serving import PipelineService, ServiceError, ServingHub
from tests.serving import fakes


def shout(name: str = "shout") -> tr.Pipeline:
    p = tr.Pipeline(name)
    p.source(fields=["text"]).map(fakes.shout, id="shout").sink()
    return p


async def started_here(svc: PipelineService) -> PipelineService:
    svc.start(asyncio.get_running_loop())
    deadline = time.monotonic() + 30
    while not svc.ready:
        assert svc.failure is None and time.monotonic() < deadline, svc.failure
        await asyncio.sleep(0.01)
    return svc


def test_a_service_on_the_callers_loop_answers_and_drains():
    async def main():
        svc = await started_here(PipelineService(shout()))
        outs = await asyncio.gather(*(svc.submit({"text": f"t{i}"}) for i in range(20)))
        assert [o["loud"] for o in outs] == [f"T{i}" for i in range(20)]
        assert svc.stats().records_out == 20
        threads = {t.name for t in threading.enumerate()}
        assert not any(n.startswith("tailrace-serve") for n in threads)  # no thread of its own
        await svc.aclose(10)
        assert not svc.ready and svc.failure is None
        with pytest.raises(ServiceError, match="stopping or stopped"):
            await svc.submit({"text": "late"})

    asyncio.run(main())


def test_start_loop_must_be_called_inside_that_loop():
    loop = asyncio.new_event_loop()
    try:
        svc = PipelineService(shout())
        with pytest.raises(ServiceError, match=r"start\(loop\) must be called from inside"):
            svc.start(loop)
        assert not svc.started
    finally:
        loop.close()


def test_engines_load_off_the_loop(monkeypatch):
    # building the run (which loads engines) happens in a worker thread: the loop that
    # serves HTTP keeps running while a slow engine loads
    from tailrace.runtime import local

    real = local.LocalRun.__init__
    built_on: list[str] = []

    def slow_init(self, *a, **kw):
        built_on.append(threading.current_thread().name)
        time.sleep(0.3)
        real(self, *a, **kw)

    monkeypatch.setattr(local.LocalRun, "__init__", slow_init)

    async def main():
        svc = PipelineService(shout())
        svc.start(asyncio.get_running_loop())
        ticks = 0
        while not svc.ready:
            ticks += 1
            await asyncio.sleep(0.01)
        assert ticks >= 10  # the loop went on while the run was built
        assert built_on and built_on[0] != threading.current_thread().name
        assert (await svc.submit({"text": "a"}))["loud"] == "A"
        await svc.aclose()

    asyncio.run(main())


def test_a_burst_crosses_the_pipeline_as_one_micro_batch():
    # requests that arrived together are one batch for the stages (one metered call),
    # not one batch each; every caller still gets its own answer
    async def main():
        svc = await started_here(PipelineService(shout()))
        outs = await asyncio.gather(*(svc.submit({"text": f"b{i}"}) for i in range(16)))
        assert [o["loud"] for o in outs] == [f"B{i}" for i in range(16)]
        stage = svc.stats()["shout"]
        await svc.aclose()
        return stage

    stage = asyncio.run(main())
    assert stage.records_in == 16 and stage.batch_size.max == 16


def test_a_burst_under_admission_is_still_admitted_one_by_one():
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=64))

    async def main():
        svc = await started_here(PipelineService(shout(), admission=gate))
        outs = await asyncio.gather(*(svc.submit({"text": f"c{i}"}) for i in range(10)))
        assert sorted(o["loud"] for o in outs) == sorted(f"C{i}" for i in range(10))
        await svc.aclose()

    try:
        asyncio.run(main())
        assert gate.statistics().in_flight == 0
    finally:
        gate.close()


def test_a_hub_started_on_a_loop_skips_services_already_running():
    thread_svc = PipelineService(shout("a")).start()
    try:
        assert thread_svc.wait_ready(30)

        async def main():
            hub = ServingHub([thread_svc, PipelineService(shout("b"))])
            hub.start(asyncio.get_running_loop())  # "a" runs on; "b" starts here
            b = hub.services["b"]
            deadline = time.monotonic() + 30
            while not b.ready:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert (await b.submit({"text": "x"}))["loud"] == "X"
            assert (await thread_svc.submit({"text": "y"}))["loud"] == "Y"
            await hub.aclose(10)
            assert not b.ready and not thread_svc.ready

        asyncio.run(main())
    finally:
        thread_svc.stop()


def test_a_lone_request_skips_the_queue_and_a_full_stage_sends_it_back_to_it():
    # while the source is idle a request goes straight to the first stage (counted as
    # read, never queued); when that stage is full it waits in the feed like any other
    p = tr.Pipeline("narrow")
    p.source(fields=["text"]).map(fakes.held, id="held", blocking=True, queue=1).sink()

    async def main():
        fakes.GATE.clear()
        svc = await started_here(PipelineService(p))
        first = asyncio.ensure_future(svc.submit({"text": "a"}))
        await asyncio.sleep(0)
        assert svc.queued == 0 and svc.stats()["source"].records_in == 1
        assert await asyncio.to_thread(fakes.ENTERED.wait, 10)  # "a" holds the stage
        rest = [asyncio.ensure_future(svc.submit({"text": t})) for t in "bcd"]
        await asyncio.sleep(0.05)
        assert svc.queued >= 1  # the stage's one slot is taken: these wait in the feed
        fakes.GATE.set()
        outs = await asyncio.gather(first, *rest)
        assert [o["held"] for o in outs] == [True] * 4
        assert svc.stats()["source"].records_in == 4 and svc.queued == 0
        await svc.aclose()

    try:
        asyncio.run(main())
    finally:
        fakes.GATE.set()
