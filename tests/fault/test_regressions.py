"""Regression tests: failures the fault suite found, shrunk to a few lines each.

Ctrl-C cases run in a child process (a SIGINT there cannot reach the test session) with
a time limit, so a run that hangs fails the test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import tailrace as tr
from tailrace.request import request_of


def _child(code: str, timeout: float = 30.0) -> str:
    """Run ``code`` in a fresh interpreter; its stdout, or a failure if it hangs."""
    try:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child process did not finish within {timeout:g} s (a hang)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_ctrl_c_gives_every_admission_ticket_back():
    """Invariant 2 under shutdown: Ctrl-C while the first record is in an operator, with
    an fcfs gate; the ticket of the record in flight stayed taken (in_flight 1)."""
    out = _child("""
        import os, signal, time
        import tailrace as tr
        from tailrace.control import AdmissionGate, make_policy

        def op(x):
            if x["i"] == 0:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
            return x

        gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=1))
        p = tr.Pipeline("p")
        p.source([{"i": i} for i in range(8)]).map(op).sink([])
        try:
            tr.run(p, admission=gate)
        except tr.RunInterrupted:
            print("interrupted")
        end = time.monotonic() + 10
        while gate.statistics().in_flight and time.monotonic() < end:
            time.sleep(0.01)
        print("in_flight", gate.statistics().in_flight)
    """)
    assert out.split() == ["interrupted", "in_flight", "0"]


def test_ctrl_c_leaves_no_request_waiting_at_the_gate():
    """Invariant 2 under shutdown: after Ctrl-C with fcfs (one in flight, room for 8 to
    wait), the gate showed a request still waiting (``queued`` 1) on an idle gate: a
    cancelled waiter stayed in the policy's waiting line until the next arrival."""
    out = _child("""
        import os, signal, time
        import tailrace as tr
        from tailrace.control import AdmissionGate, make_policy

        def op(x):
            if x["i"] == 0:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
            return x

        gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=8))
        p = tr.Pipeline("p")
        p.source([{"i": i} for i in range(5)]).map(op).sink([])
        try:
            tr.run(p, admission=gate)
        except tr.RunInterrupted:
            print("interrupted")
        end = time.monotonic() + 10
        while (gate.statistics().in_flight or gate.statistics().queued) \
                and time.monotonic() < end:
            time.sleep(0.01)
        s = gate.statistics()
        print("in_flight", s.in_flight, "queued", s.queued)
    """)
    assert out.split() == ["interrupted", "in_flight", "0", "queued", "0"]


def test_ctrl_c_ends_a_run_whose_timed_async_stage_feeds_a_full_channel():
    """Invariant 4 under shutdown: Ctrl-C while records queue for a one-record channel
    behind an async stage with ``timeout_ms``; the run never returned (its worker, blocked
    in ``Channel.put``, did not see the cancellation: ``asyncio.wait_for`` on Python 3.11
    can swallow a cancellation that arrives as the awaited call completes)."""
    out = _child("""
        import os, signal
        import tailrace as tr

        def first(x):
            if x == 0:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
            return x

        async def amap(x):
            return x

        p = tr.Pipeline("p")
        p.source(range(2)).map(first).map(amap, timeout_ms=30).batch(1, queue=1).sink([])
        try:
            tr.run(p, fuse=False)
        except tr.RunInterrupted:
            print("interrupted")
    """, timeout=20)
    assert out.split() == ["interrupted"]


def test_ctrl_c_cancels_the_blocking_calls_it_abandons():
    """Invariant 4 under shutdown: Ctrl-C while a blocking call under ``timeout_ms`` runs;
    the run returned without setting the call's ``_cancel`` (as a timeout does), so a call
    that honours cancellation ran on after the run, up to its own limit (8 s here)."""
    out = _child("""
        import os, signal, threading, time
        import tailrace as tr

        def slow(x):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while this call runs
            req = x.get("_request")
            cancel = req.cancel if req is not None else None
            end = time.monotonic() + 8
            while time.monotonic() < end and not (cancel is not None and cancel.is_set()):
                time.sleep(0.005)  # honours cooperative cancellation
            return x

        def ours():
            return [t.name for t in threading.enumerate() if t.name.startswith("tailrace")]

        p = tr.Pipeline("p")
        p.source([{"i": 0}]).map(slow, blocking=True, timeout_ms=10_000).sink([])
        try:
            tr.run(p)
        except tr.RunInterrupted:
            print("interrupted")
        end = time.monotonic() + 5
        while time.monotonic() < end and ours():
            time.sleep(0.01)
        print("left", len(ours()))
    """)
    assert out.split() == ["interrupted", "left", "0"]


def test_a_batch_stage_under_a_timeout_emits_its_records_unchanged():
    """A ``batch`` stage with ``timeout_ms`` put the runtime's per-attempt cancel event
    (``_cancel``) into the records of its lists; on Ray such a list cannot be sent back
    to the driver and became an error record whose input is a string."""
    p = tr.Pipeline("b")
    out: list = []
    p.source([{"a": 1}, {"a": 2}]).batch(2, output="items", timeout_ms=1000).sink(out)
    result = tr.run(p)
    assert not result.errors
    assert out == [{"items": [{"a": 1}, {"a": 2}]}]


def test_a_request_whose_flat_map_emits_nothing_is_answered():
    """Invariant 1 in serving: a record a ``flat_map`` turns into nothing ends there, but
    its caller was never answered (it waited for ``timeout_s``, 300 s by default); a
    filter's drop is answered at once."""
    from tailrace.serving import PipelineService
    from tailrace.serving.errors import ServiceError, ServiceTimeout

    p = tr.Pipeline("none")
    p.source().flat_map(lambda r: []).sink()
    svc = PipelineService(p, timeout_s=60).start()
    try:
        assert svc.wait_ready(30)

        async def ask() -> BaseException | None:
            try:
                await asyncio.wait_for(svc.submit({"q": 1}), 5)
            except (ServiceError, TimeoutError) as e:
                return e
            return None

        answer = asyncio.run(ask())
        assert isinstance(answer, ServiceError), f"no answer: {answer!r}"
        assert not isinstance(answer, ServiceTimeout)
    finally:
        svc.stop()


def _keep(x):
    return x % 4 != 0


def _double(x):
    return 2 * x


@pytest.mark.slow
def test_ray_killing_an_actor_that_feeds_a_filter_loses_nothing_and_ends(ray_session):
    """Invariant 1 on Ray: the actor of ``map -> filter`` (fused; the map has a queue
    bound) is killed once the first output arrived; the run never finished and some of
    the filter's outputs never arrived (4 runs of 4)."""
    from tailrace.runtime.ray import ActiveRuns

    ray = ray_session
    got: list = []
    killed: list = []
    runs = ActiveRuns()

    def sink(x):
        got.append(x)
        if not killed:
            [run] = [r for r in runs.describe() if r["pipeline"] == "kill-filter"]
            name = run["stages"]["double"][0][0]
            ray.kill(ray.get_actor(name), no_restart=False)
            killed.append(name)

    p = tr.Pipeline("kill-filter")
    p.source(range(11)).map(_double, id="double", queue=10).filter(_keep).sink(sink)
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("r", tr.run(p, runtime="ray",
                                                                     runs=runs)),
                           daemon=True)
    job.start()
    job.join(60)
    assert killed
    assert not job.is_alive(), f"the run hung; outputs so far: {sorted(got)}"
    assert sorted(got) == [y for y in map(_double, range(11)) if _keep(y)]


def test_a_batch_under_admission_does_not_hand_out_admission_tickets():
    """Under admission, the records inside a ``batch`` stage's lists kept the runtime's
    ``_admission`` ticket all the way into the user's output (the sink strips it from
    top-level records only)."""
    from tailrace.control import AdmissionGate, make_policy

    p = tr.Pipeline("b")
    out: list = []
    p.source([{"a": 1}, {"a": 2}]).batch(2, output="items").sink(out)
    tr.run(p, admission=AdmissionGate(make_policy("simultaneous")))
    assert out == [{"items": [{"a": 1}, {"a": 2}]}]


def _waits_for_cancel(x):
    """A blocking predicate that honours cooperative cancellation (like ``generate``)."""
    req = request_of(x)
    cancel = req.cancel if req is not None else None
    deadline = time.monotonic() + 30
    while not (cancel is not None and cancel.is_set()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return True


def test_a_timed_out_branch_call_is_cancelled_like_any_other():
    """Invariant 4: a blocking ``branch`` with ``timeout_ms`` did not give its predicate
    the record's ``_cancel`` (``map``, ``filter`` and ``flat_map`` do), so an abandoned
    call that would stop when cancelled ran on after the run."""
    p = tr.Pipeline("br")
    yes, no = p.source([{"a": 1}]).branch(_waits_for_cancel, blocking=True, timeout_ms=30)
    yes.sink([])
    no.sink([])
    result = tr.run(p)
    assert [e.error for e in result.errors] == ["StageTimeout"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _tailrace_threads():
        time.sleep(0.01)
    assert not _tailrace_threads()


def _tailrace_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tailrace")]


def test_records_that_are_not_dicts_never_hang_under_admission():
    """Known defect of issue 11: under an fcfs gate, ``source(range(200))`` never
    returned (the ticket rode in the record, so a plain value never gave it back). Every
    record must end, as an output or an error record."""
    out = _child("""
        import tailrace as tr
        from tailrace.control import AdmissionGate, make_policy

        gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=10_000))
        p = tr.Pipeline("plain")
        p.source(range(200)).map(lambda x: x + 1).sink(out := [])
        result = tr.run(p, admission=gate)
        print(len(out) + len(result.errors), gate.statistics().in_flight)
    """)
    assert out.split() == ["200", "0"]


def test_admission_at_the_source_keeps_a_bounded_number_of_tasks():
    """Invariant 3 with admission (known defect of issue 11): the source created one task
    per input record up front (5,000 records: 5,000 tasks waiting at the gate)."""
    from tailrace.control import AdmissionGate, make_policy

    peak = [0]

    def look(x):  # runs on the run's event loop (an inline stage)
        peak[0] = max(peak[0], len(asyncio.all_tasks()))
        return x

    gate = AdmissionGate(make_policy("fcfs", max_in_flight=4, max_queue=100_000))
    p = tr.Pipeline("many")
    out: list = []
    p.source([{"i": i} for i in range(5_000)]).map(look, queue=16).sink(out)
    tr.run(p, admission=gate)
    assert len(out) == 5_000
    assert peak[0] <= 2_000, f"{peak[0]} tasks alive at once for 5,000 records"


def test_an_escalate_verifier_that_raises_fails_its_own_record_only():
    """A budgeted route (``escalate``) whose verifier raises for one record (an injected
    ``always`` fault) failed the whole micro-batch: every record, those already verified
    and counted solved included, ended with that record's InjectedFault."""
    from .harness import Faults, Scenario, Step
    from .runners import run_local

    sc = Scenario(n=12, seed=0, steps=(Step("flat_map"),
                                       Step("escalate", faults=Faults(always=10, first=15)),
                                       Step("map")))
    run_local(sc).check(sc)


# -- defects in src found by the tools step (issue 27), fixed
def test_a_request_without_options_gets_its_reply():
    """``PipelineService.submit``: "after the answer its reply holds what the answering
    stage reported". A request that names its answering stage (``answers``) and offers
    tools, but sets no options (``Request.options`` None, as a Python caller may), got
    ``reply.finish`` None and ``reply.usage`` None for an answer that is a tool call; with
    ``options={}`` (what the OpenAI wire always sends) it is ``tool_calls``. The fault
    suite's requests set ``options={}`` until this is fixed (runners.with_urgency)."""
    from tailrace.engines.tool_calls import check_tools
    from tailrace.request import Request
    from tailrace.serving import PipelineService

    from .harness import Step, tool_engine

    p = tr.Pipeline("reply", engines={"llm": tool_engine(Step("tools"))})
    p.source(None, id="src").apply("generate", id="tools0", engine="llm", output="tools0",
                                   prompt="0 1 tools0 {path}").sink(None, id="out")
    spec = check_tools([{"type": "function", "function": {"name": "lookup"}}], "required",
                       None)
    svc = PipelineService(p, timeout_s=10)
    svc.start()
    qs = [Request(answers="tools0", tools=spec,
                  messages=[{"role": "user", "content": "question"}]) for _ in range(2)]

    async def ask() -> list:  # together: neither is a lone request (see the next test)
        return await asyncio.gather(*(svc.submit({"path": (i,)}, request=q)
                                      for i, q in enumerate(qs)))

    try:
        assert svc.wait_ready(10)
        outs = asyncio.run(ask())
    finally:
        svc.stop(5)
    assert all(o["tools0"].startswith("<tool_call>") for o in outs), outs
    assert [(q.reply.finish, q.reply.usage is not None) for q in qs] == \
        [("tool_calls", True)] * 2


def test_a_lone_request_from_another_thread_reaches_a_blocking_first_stage():
    """``PipelineService`` on a thread of its own, one request at a time from a caller's
    loop (``await svc.submit(...)``, nothing else ready there): the caller takes the idle
    loop's lock (``own_loop``) and offers the record to the first stage; that stage is
    not an inline chain ending in a sink (here a ``blocking`` map; a ``generate`` stage
    alike), so ``Channel.put_nowait`` wakes its worker's future from the caller's thread
    and the service's loop sleeps on in ``select``: no answer until something else wakes
    it (here: ``ServiceTimeout``). The fault suite misses it: its callers create every
    request's task before any runs, so none is ever alone."""
    import time as _time

    from tailrace.serving import PipelineService
    from tailrace.serving.errors import ServiceTimeout

    p = tr.Pipeline("lone")
    p.source(None, id="src").map(lambda r: {**r, "y": 1}, id="m", blocking=True) \
        .sink(None, id="out")
    svc = PipelineService(p, timeout_s=1.0)
    svc.start()
    answers: list = []

    async def ask() -> None:
        for i in range(3):
            _time.sleep(0.05)  # the service's loop goes idle (waits in select)
            try:
                answers.append(await svc.submit({"x": i}))
            except ServiceTimeout as e:
                answers.append(e)
                return

    try:
        assert svc.wait_ready(10)
        asyncio.run(ask())
    finally:
        svc.stop(5)
    assert answers == [{"x": i, "y": 1} for i in range(3)], answers
