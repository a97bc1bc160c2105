"""A lone query (nothing else in flight, nothing else ready on the caller's loop) runs
the idle inline first stage on the caller's own stack, both ways a service is started:
no task switch on the run's loop (``start(loop)``), no thread hand-off to a service on
its own thread (``start()``, which borrows the run while its loop waits). Each record is
metered exactly as the stage's worker would meter it; records that are not alone, or
that find the run busy, take the queue as before; a timeout is still honoured."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import tailrace as tr
from tailrace.serving import PipelineService, ServiceTimeout, ServiceUnavailable

ran_on: list = []


def note(record: dict) -> dict:
    ran_on.append((threading.current_thread().name, asyncio.current_task()))
    return {**record, "y": record["x"] + 1}


def four_steps(name: str = "lone") -> tr.Pipeline:
    p = tr.Pipeline(name)
    s = p.source(fields=["x"]).map(note, id="a")
    for step in ("b", "c", "d"):
        s = s.map(lambda r: r, id=step)
    s.sink()
    return p


async def started(svc: PipelineService, here: bool) -> PipelineService:
    if here:
        svc.start(asyncio.get_running_loop())
    else:
        svc.start()
    deadline = time.monotonic() + 30
    while not svc.ready:
        assert svc.failure is None and time.monotonic() < deadline, svc.failure
        await asyncio.sleep(0.01)
    return svc


async def close(svc: PipelineService) -> None:
    await svc.aclose()


@pytest.mark.parametrize("here", [True, False], ids=["callers-loop", "own-thread"])
def test_a_lone_query_runs_on_the_callers_stack_and_is_metered_as_usual(here):
    ran_on.clear()

    async def main():
        svc = await started(PipelineService(four_steps()), here)
        me = (threading.current_thread().name, asyncio.current_task())
        for i in range(5):  # the first may find the run still settling in: it queues
            await svc.submit({"x": i})
        await asyncio.sleep(0.05)
        ran_on.clear()
        for i in range(20):
            assert await svc.submit({"x": i}) == {"x": i, "y": i + 1}
        st = svc.stats()
        await close(svc)
        return me, st

    me, st = asyncio.run(main())
    assert ran_on == [me] * 20  # the caller's own task, on the caller's thread
    assert st.records_in == st.records_out == 25 and st.errors == 0
    assert st.latency_us.count == 25 and st.scheduling_us.count == 25
    for op in ("a", "b", "c", "d", "sink"):
        m = st[op]
        assert (m.records_in, m.records_out, m.service_us.count) == (25, 25, 25)
        assert (m.batch_size.count, m.batch_size.max) == (25, 1)
    assert st["a"].queue_wait_us.count == 25


def test_a_burst_from_another_thread_is_not_run_by_its_callers():
    ran_on.clear()

    async def main():
        svc = await started(PipelineService(four_steps()), here=False)
        outs = await asyncio.gather(*(svc.submit({"x": i}) for i in range(16)))
        await close(svc)
        return outs

    outs = asyncio.run(main())
    assert outs == [{"x": i, "y": i + 1} for i in range(16)]
    assert {name for name, _ in ran_on} == {"tailrace-serve-lone"}  # the service's loop


def test_callers_on_many_threads_share_a_borrowed_run_safely():
    # several threads submit lone queries at once: each either borrows the idle run or
    # queues; every record is answered once, counted once, in each caller's order
    svc = PipelineService(four_steps()).start()
    assert svc.wait_ready(30)
    got: dict[int, list] = {}

    def caller(t: int) -> None:
        async def go():
            return [(await svc.submit({"x": t * 1000 + i}))["y"] for i in range(200)]

        got[t] = asyncio.run(go())

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    st = svc.stats()
    svc.stop()
    assert {t: ys for t, ys in got.items()} == {
        t: [t * 1000 + i + 1 for i in range(200)] for t in range(4)}
    assert st.records_out == 800 and st["a"].records_in == st["sink"].records_out == 800
    bs = st["a"].batch_size  # calls, of some records each: 800 records in all
    assert st["a"].service_us.count == 800 and round(bs.mean * bs.count) == 800


def test_a_lone_query_still_times_out():
    def slow(record: dict) -> dict:
        time.sleep(1.0)
        return record

    p = tr.Pipeline("slow")
    p.source(fields=["x"]).map(slow, id="slow", blocking=True).sink()

    async def main():
        svc = await started(PipelineService(p, timeout_s=0.2), here=True)
        t0 = time.monotonic()
        with pytest.raises(ServiceTimeout, match="no output within 0.2 s"):
            await svc.submit({"x": 1})
        waited = time.monotonic() - t0
        await close(svc)
        return waited

    assert 0.15 < asyncio.run(main()) < 0.9


def test_a_runtime_failure_in_a_step_run_by_its_caller_ends_the_run(monkeypatch):
    from tailrace.runtime.local.executor import LocalRun

    step = LocalRun._step
    calls = []

    def failing(self, *a, **kw):
        calls.append(1)
        step(self, *a, **kw)
        if len(calls) == 3:
            raise RuntimeError("a bug in the runtime")

    monkeypatch.setattr(LocalRun, "_step", failing)

    async def main():
        svc = await started(PipelineService(four_steps()), here=True)
        for i in range(3):  # the third is answered (its sink wrote it), then the run ends
            await svc.submit({"x": i})
        for _ in range(100):
            if svc.failure is not None:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ServiceUnavailable):
            await svc.submit({"x": 9})
        failure = svc.failure
        await close(svc)
        return failure

    failure = asyncio.run(main())
    assert isinstance(failure, RuntimeError) and "a bug in the runtime" in str(failure)
