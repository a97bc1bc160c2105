"""Run a scenario on each target and collect what the invariants are checked against.

``run_local`` (``tr.run``), ``run_service`` (``PipelineService``) and ``run_ray``
(``tr.run(runtime="ray")``) each return a ``Report``: the problems found, one line each.
Runs happen on a worker thread with a watchdog, so a hang fails the example instead of
the suite; hung operator calls are released when the run is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import tailrace as tr
from tailrace.errors import RunInterrupted
from tailrace.request import REQUEST, Request
from tailrace.runtime.trace_out import TraceWriter

from .account import Observed, account, drop_problems, queue_problems, reply_problems
from .harness import (
    PROBES,
    Ledger,
    Probe,
    Scenario,
    build,
    forget_attempts,
    inputs,
    lineages,
    stage_id,
    tool_spec,
    tools_field,
    tools_step,
)

STALL_S = 4.0  # no operator call, output or error for this long: the run hangs
RAY_STALL_S = 30.0  # the same on Ray, where operator calls are not seen (actor restarts)
DEADLINE_S = 5.0  # for things that must happen "soon": threads ending, tickets returning
_runs = itertools.count(1)


#: the kind of an invariant violation, by a word of its message; each kind fails with its
#: own exception type, so Hypothesis reports (and shrinks) distinct bugs separately
KINDS = (("nobody wrote", "Foreign"), ("hung", "Hang"), ("never answered", "Unanswered"),
         ("request ", "Answer"), ("told of drops", "Drops"), ("never ended", "Lost"),
         ("ended ", "Duplicate"), ("never entered", "Phantom"),
         ("ticket", "Ticket"), ("gate", "Ticket"), ("threads", "Leak"), ("tasks", "Leak"),
         ("child process", "Leak"), ("held", "Unbounded"), ("unexplained", "Unexplained"),
         ("dropped", "Drops"))
_BROKEN: dict[str, type] = {}


def broken(kind: str) -> type:
    """The AssertionError subclass for one kind of violation."""
    if kind not in _BROKEN:
        _BROKEN[kind] = type(f"{kind}Invariant", (AssertionError,), {})
    return _BROKEN[kind]


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    interrupted: bool = False

    def check(self, sc: Scenario) -> None:
        if self.problems:
            first = self.problems[0]
            kind = next((k for word, k in KINDS if word in first), "Other")
            raise broken(kind)("invariants broken:\n  " + "\n  ".join(self.problems))


# -- invariant 4: nothing left running -------------------------------------------------------
def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this process."""
    me, out = os.getpid(), set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(d))
    return out


_LEAKED_TASKS: list[str] = []


class _TrackingLoop(asyncio.SelectorEventLoop):
    """Notes the tasks still pending when a loop's main coroutine returns (``asyncio.run``
    then cancels them silently: a leak the suite wants to see)."""

    _main_done = False

    def run_until_complete(self, future: Any) -> Any:
        try:
            return super().run_until_complete(future)
        finally:
            if not self._main_done:
                self._main_done = True
                left = [t for t in asyncio.all_tasks(self) if not t.done()]
                if left:
                    _LEAKED_TASKS.append(", ".join(repr(t.get_coro()) for t in left[:5]))


class _TrackingPolicy(asyncio.DefaultEventLoopPolicy):
    _loop_factory = _TrackingLoop


class LeakWatch:
    """A baseline of threads and child processes, and every loop's leftover tasks."""

    def __enter__(self) -> LeakWatch:
        self.threads = {t.ident for t in threading.enumerate()}
        self.children = child_pids()
        self.policy = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(_TrackingPolicy())
        _LEAKED_TASKS.clear()
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.set_event_loop_policy(self.policy)

    def problems(self, *, tasks: bool = True) -> list[str]:
        out = []
        if tasks and _LEAKED_TASKS:
            out.append(f"tasks still pending when their run ended: {_LEAKED_TASKS}")
        threads: list[str] = []
        kids: set[int] = set()
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            threads = [t.name for t in threading.enumerate() if t.ident not in self.threads
                       and t.name.startswith("tailrace") and t.is_alive()]
            kids = child_pids() - self.children
            if not threads and not kids:
                return out
            time.sleep(0.02)
        if threads:
            out.append(f"threads still running {DEADLINE_S:g} s after the run: {threads}")
        if kids:
            out.append(f"child processes left: {sorted(kids)}")
        return out


# -- invariant 2: tickets released exactly once ----------------------------------------------
class CountingGate:
    """Wraps an admission gate: counts ``admit()`` and ``done()`` per ticket."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate
        self.admitted: dict[int, Any] = {}
        self.released: Counter = Counter()
        self.problems: list[str] = []
        self._lock = threading.Lock()

    async def admit(self, pipeline: str, record: Any) -> Any:
        ticket = await self.gate.admit(pipeline, record)
        with self._lock:
            self.admitted[ticket.seq] = ticket
        return ticket

    def done(self, ticket: Any, service_seconds: float | None = None) -> None:
        with self._lock:
            self.released[ticket.seq] += 1
            if ticket.seq not in self.admitted:
                self.problems.append(f"done() on ticket {ticket.seq}, never admitted")
            if self.released[ticket.seq] > 1:
                self.problems.append(f"ticket {ticket.seq} released "
                                     f"{self.released[ticket.seq]} times")
                return  # the policy would raise: keep the run going, the report has it
        self.gate.done(ticket, service_seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gate, name)

    def balance(self, wait: bool = True) -> list[str]:
        """Invariant 2, waited for (``wait``; False: checked once, for a caller on the
        service's own loop, which must not block it): every admitted ticket released
        once, gate empty."""
        end = time.monotonic() + (DEADLINE_S if wait else 0.0)
        while True:
            stats = self.gate.statistics()
            with self._lock:
                unreleased = sorted(s for s in self.admitted if self.released[s] == 0)
            if not unreleased and stats.in_flight == 0 and stats.queued == 0:
                break
            if time.monotonic() > end:
                return self.problems + [
                    f"after the run: gate in_flight={stats.in_flight} queued={stats.queued}; "
                    f"{len(unreleased)} of {len(self.admitted)} admitted tickets never "
                    f"released"]
            time.sleep(0.01)
        return list(self.problems)


# -- running -----------------------------------------------------------------------------------
class _Watched:
    """``fn()`` on a daemon thread; ``wait`` returns False if it stalls (no progress)."""

    def __init__(self, fn: Any, progress: Any) -> None:
        self.box: dict[str, Any] = {}
        self.progress = progress
        self.thread = threading.Thread(target=self._main, args=(fn,), daemon=True,
                                       name="fault-suite-run")
        self.thread.start()

    def _main(self, fn: Any) -> None:
        try:
            self.box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - examined by the caller
            self.box["error"] = e

    def wait(self, stall_s: float = STALL_S) -> bool:
        last, since = None, time.monotonic()
        while self.thread.is_alive():
            self.thread.join(0.05)
            now = self.progress()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > stall_s:
                return False
        return True


class _Here:
    """``fn()`` on this thread (where a SIGINT reaches it); a watchdog thread releases
    hung calls and closes the gate if it stalls, so a stuck run can still end."""

    def __init__(self, fn: Any, progress: Any, rescue: Any) -> None:
        self.box: dict[str, Any] = {}
        self.stalled = False
        done = threading.Event()

        def watch() -> None:
            last, since = None, time.monotonic()
            while not done.wait(0.05):
                now = progress()
                if now != last:
                    last, since = now, time.monotonic()
                elif time.monotonic() - since > STALL_S and not self.stalled:
                    self.stalled = True
                    rescue()

        dog = threading.Thread(target=watch, daemon=True, name="fault-suite-watchdog")
        dog.start()
        try:
            self.box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - examined by the caller
            self.box["error"] = e
        finally:
            done.set()
            dog.join()

    def wait(self) -> bool:
        return not self.stalled


def _setup(sc: Scenario) -> tuple[int, Probe, Ledger, str]:
    run = next(_runs)
    probe = PROBES[run] = Probe(sc)
    tmp = tempfile.mkdtemp(prefix="tailrace-fault-")
    return run, probe, Ledger(os.path.join(tmp, "ledger.jsonl")), tmp


def _teardown(run: int, probe: Probe, tmp: str) -> None:
    probe.release.set()
    PROBES.pop(run, None)
    forget_attempts(run)
    with contextlib.suppress(OSError):
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)


def run_local(sc: Scenario, *, here: bool = False) -> Report:
    """The scenario through ``tr.run`` (local runtime); ``here``: on this thread (the
    main thread of a child process, for Ctrl-C), else on a watched worker thread."""
    report = Report()
    run, probe, ledger, tmp = _setup(sc)
    outputs: list = []
    errors: list = []
    gate = CountingGate(sc.admission.gate()) if sc.admission is not None else None
    # every other scenario also records a trace (``--trace-out``): a line per record
    trace_path = os.path.join(tmp, "trace.jsonl") if sc.seed % 2 == 0 else None
    trace = TraceWriter.open(trace_path) if trace_path is not None else None
    try:
        with LeakWatch() as leaks:
            if trace is None:
                p = build(sc, ledger, run, data=inputs(sc.n), sink=outputs.append)
                bound: dict[str, Any] = {}
            else:  # a trace follows records bound at run time (as ``tailrace run``'s)
                p = build(sc, ledger, run, data=None, sink=None)
                bound = {"input": inputs(sc.n), "output": outputs.append, "trace": trace}

            def call() -> Any:
                return tr.run(p, fuse=sc.fuse, errors=errors.append, admission=gate, **bound)

            def progress() -> tuple:
                return probe.calls, len(outputs), len(errors)

            def rescue() -> None:
                probe.release.set()
                if gate is not None:
                    gate.close()  # rejects the waiters: lets a run stuck at the door end

            job: Any = _Here(call, progress, rescue) if here else _Watched(call, progress)
            finished = job.wait()  # hung calls stay hung: the runtime must cancel them
            if not finished:
                report.problems.append(f"the run hung (no progress for {STALL_S:g} s)")
                rescue()
                if not here:
                    job.thread.join(DEADLINE_S)
                return report
            err = job.box.get("error")
            if isinstance(err, RunInterrupted):
                report.interrupted = True
                if not probe.interrupted:
                    report.problems.append("RunInterrupted without an interrupt")
                stats = err.result.stats
            elif err is not None:
                report.problems.append(f"tr.run raised {type(err).__name__}: {err}")
                return report
            else:
                if probe.interrupted:
                    report.problems.append("an operator raised KeyboardInterrupt, the run "
                                           "went on as if nothing happened")
                stats = job.box["result"].stats
            obs = Observed(set(range(sc.n)), outputs, errors, ledger.entries(),
                           complete=not report.interrupted)
            report.problems += account(sc, obs)
            report.problems += queue_problems(stats)
            if not report.interrupted:
                report.problems += drop_problems(sc, obs, stats)
            if gate is not None:
                report.problems += gate.balance()
            if trace is not None:
                trace.close()
                report.problems += trace_problems(sc, trace_path, errors,
                                                  complete=not report.interrupted)
            report.problems += leaks.problems(tasks=not report.interrupted)
    finally:
        if gate is not None:
            gate.close()
        if trace is not None:
            trace.close()
        _teardown(run, probe, tmp)
    return report


def trace_problems(sc: Scenario, path: str, errors: list, *, complete: bool) -> list[str]:
    """A run's trace has one line per input record (when it ran to its end), each well
    formed, and as many ``rejected`` lines as admission turned records away."""
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    out = []
    if complete and len(lines) != sc.n:
        out.append(f"trace: {len(lines)} lines for {sc.n} input records")
    keys = {"t", "pipeline", "prompt_tokens", "max_tokens", "output_tokens", "latency_s",
            "outcome"}
    bad = [x for x in lines if set(x) != keys or x["outcome"] not in ("ok", "error",
                                                                       "rejected")]
    if bad:
        out.append(f"trace: malformed line {bad[0]}")
    if complete:
        rejected = sum(1 for e in errors if getattr(e, "stage", None) == "admission")
        if sum(x["outcome"] == "rejected" for x in lines) != rejected:
            out.append(f"trace: {sum(x['outcome'] == 'rejected' for x in lines)} rejected "
                       f"lines, {rejected} admission rejections")
    return out


def run_in_child(sc: Scenario, timeout: float = 30.0) -> Report:
    """``run_local(sc, here=True)`` in a child process (``tests/fault/interrupt.py``): a
    Ctrl-C there cannot reach the test session."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.fault.interrupt", repr(sc)],
                              cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Report([f"the child process running the scenario hung ({timeout:g} s)"])
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return Report([f"the child process exited with {proc.returncode}: "
                       f"{proc.stderr.strip()[-2000:]}"])
    out = json.loads(lines[-1])
    return Report(out["problems"], out["interrupted"])


SERVICE_TIMEOUT_S = 60.0  # a caller's own limit; the suite notices silence long before


def run_service(sc: Scenario, *, here: bool = False, ray: Any = None) -> Report:
    """The scenario through a ``PipelineService``: one request per input record.

    here: the service runs on the callers' own loop (``start(loop)``, as under
          ``tailrace serve``) instead of a thread of its own.
    ray:  the ``ray`` module: the service runs on Ray (``runtime="ray"``). Operators in
          actors cannot reach the test's probe, so once the first answer (output, error
          record or drop) arrives, the callers of ``sc.cancel`` cancel and the actor of
          ``sc.kill``'s stage is killed (it restarts; producers replay).
    """
    from tailrace.serving import PipelineService
    from tailrace.serving.errors import (
        RecordDropped,
        RequestFailed,
        ServiceOverloaded,
        ServiceTimeout,
        ServiceUnavailable,
    )

    report = Report()
    run, probe, ledger, tmp = _setup(sc)
    outputs: list = []
    errors: list = []
    dropped: list = []
    gate = CountingGate(sc.admission.gate()) if sc.admission is not None else None
    svc = None
    try:
        with LeakWatch() as leaks:
            p = build(sc, ledger, run, data=None, sink=None)
            runs = None  # Ray: the ActiveRuns that lists the service's run
            if ray is not None:
                from tailrace.runtime.ray import ActiveRuns

                runs = ActiveRuns()
            svc = PipelineService(p, admission=gate, timeout_s=SERVICE_TIMEOUT_S,
                                  max_pending=sc.max_pending or 1024,
                                  runtime="local" if ray is None else "ray", runs=runs,
                                  placement=placement(sc, p))
            _observe(svc, outputs, errors, dropped)
            skipped: set[int] = set()  # Ray: cancelled before the source took them
            if ray is not None:
                _on_first_answer(svc, runs, sc, probe, ray, skipped)
            if not here:
                svc.start()
                if not svc.wait_ready(30 if ray is None else 120):
                    report.problems.append(f"the service never became ready: {svc.failure!r}")
                    return report
            answers: dict[int, Any] = {}
            stopper: list[threading.Thread] = []
            sent = with_urgency(sc, inputs(sc.n))
            requests = {r["lid"]: q for r, q in sent}  # their replies are read after

            async def main() -> None:
                loop = asyncio.get_running_loop()
                if here:
                    svc.start(loop)
                    ready_by = time.monotonic() + 30
                    while not svc.ready:
                        if svc.failure is not None or time.monotonic() > ready_by:
                            report.problems.append(
                                f"the service never became ready: {svc.failure!r}")
                            return
                        await asyncio.sleep(0.01)
                tasks = {r["lid"]: asyncio.create_task(svc.submit(r, request=q))
                         for r, q in sent}

                def cancel(lid: int) -> None:
                    with contextlib.suppress(RuntimeError):  # this loop ended: all answered
                        loop.call_soon_threadsafe(tasks[lid].cancel)

                probe.on_cancel = cancel
                await asyncio.sleep(0)  # every submit has handed its record over
                if sc.stop:
                    t = threading.Thread(target=svc.stop, args=(30.0,), name="fault-stop")
                    t.start()
                    stopper.append(t)
                last, since = None, time.monotonic()
                stall_s = STALL_S if ray is None else RAY_STALL_S  # no probe calls on Ray
                answer_s = ANSWER_S if ray is None else RAY_ANSWER_S
                pending = set(tasks.values())
                while pending:
                    _, pending = await asyncio.wait(pending, timeout=0.05)
                    now = (probe.calls, len(outputs), len(errors), len(dropped), len(pending))
                    if now != last:
                        last, since = now, time.monotonic()
                    elif time.monotonic() - since > stall_s or (
                            time.monotonic() - since > answer_s and not sc.stop
                            and _all_ended(sc, {lid for lid, t in tasks.items()
                                                if not _overloaded(t)},
                                           outputs, errors, ledger)):
                        break  # stuck, or every record ended and some callers wait on
                for lid, t in tasks.items():
                    if not t.done():
                        answers[lid] = "never answered"
                        t.cancel()
                    elif t.cancelled():
                        answers[lid] = "cancelled"
                    elif t.exception() is not None:
                        answers[lid] = t.exception()
                    else:
                        answers[lid] = t.result()
                await asyncio.gather(*tasks.values(), return_exceptions=True)
                if here:  # the service lives on this loop: check it before the loop ends
                    await checks(lambda: asyncio.sleep(0.02))
                    for t in stopper:
                        await asyncio.to_thread(t.join, 40)
                    await svc.aclose(30.0)

            async def checks(pause: Any) -> None:
                cancelled = {lid for _, lid in sc.cancel}
                entered = set()
                for lid, a in sorted(answers.items()):
                    if isinstance(a, ServiceOverloaded) or lid in skipped:
                        continue  # turned away, or its caller left, before it entered
                    entered.add(lid)
                    if isinstance(a, dict | RequestFailed | RecordDropped):
                        if isinstance(a, dict) and a.get("lid") != lid:
                            report.problems.append(f"request {lid} got another's answer: {a}")
                        elif isinstance(a, dict) and lid not in cancelled:
                            report.problems += reply_problems(sc, a, requests[lid])
                        if isinstance(a, RequestFailed) and a.status == 429 \
                                and not (a.retry_after or 0) > 0:
                            report.problems.append(f"request {lid}: a 429 without a "
                                                   f"retry-after: {a!r}")
                    elif a == "cancelled" and lid in cancelled:
                        pass
                    elif isinstance(a, str | ServiceTimeout | ServiceUnavailable):
                        report.problems.append(f"request {lid}: {a if isinstance(a, str) else a!r}")
                    else:
                        report.problems.append(f"request {lid} failed oddly: {a!r}")
                def observed() -> Observed:
                    return Observed(entered, list(outputs), list(errors), ledger.entries(),
                                    cancelled=cancelled, transient=SERVING_FIELDS,
                                    tools=True)

                end = time.monotonic() + DEADLINE_S  # records of callers who left run on
                while time.monotonic() < end and any(
                        "never ended" in x for x in account(sc, observed())):
                    await pause()
                obs = observed()
                report.problems += account(sc, obs)
                hook_drops = sorted(p for r in dropped for p in lineages(r))
                failed = {(e.stage, p) for e in errors for p in _paths(e.input)}
                silent = sorted({path for _, stage, path in obs.ledger
                                 if (stage, path) not in failed})
                told = sorted(set(hook_drops) - set(silent))  # a sibling's output may answer
                if ray is not None:  # Ray names the request's source record: a prefix
                    told = [t for t in told if not any(s[:len(t)] == t for s in silent)]
                if told:  # first: the service need not hear of every drop
                    report.problems.append(f"the service was told of drops {told} that no filter "
                                           f"or flat_map made (they ended {silent} silently)")
                if gate is not None and not sc.stop:
                    # a record's output is seen (hook) a moment before the runtime gives
                    # its ticket back (a blocking stage hands the result to the loop
                    # first): wait for the gate to settle, then a ticket still out leaked
                    # on Ray a ticket comes back with the end-to-end ack, after any actor
                    # restart and replay: under load that took longer than DEADLINE_S
                    # (chaos profile, load 4 on 2 cores); a leaked one never comes back
                    settle_by = time.monotonic() + (DEADLINE_S if ray is None
                                                    else RAY_STALL_S)
                    while gate.balance(wait=False) and time.monotonic() < settle_by:
                        await pause()  # never a blocking wait: the service may share the loop
                    report.problems += [f"while idle: {x}" for x in gate.balance(wait=False)]
                report.problems += queue_problems(svc.stats())

            if not here:
                asyncio.run(main())
                asyncio.run(checks(lambda: asyncio.sleep(0.02)))
            else:
                asyncio.run(main())
            for t in stopper:
                t.join(40)
            if not here:
                svc.stop(30.0)
            if svc.failure is not None:
                report.problems.append(f"the service failed: {svc.failure!r}")
            if gate is not None:
                report.problems += [f"after stop: {x}" for x in gate.balance()]
            report.problems += leaks.problems()
    finally:
        if svc is not None and not here:
            svc.stop(5.0)
        if gate is not None:
            gate.close()
        _teardown(run, probe, tmp)
    return report


#: the one non-user field of served records: submit() adds the request; the service
#: strips it from the caller's answer
SERVING_FIELDS = frozenset({REQUEST})


def with_urgency(sc: Scenario, records: list[dict]) -> list[tuple[dict, Request]]:
    """The records, each with its request, asking its own priority and deadline
    (``sc.urgency``) where the scenario gives any, as ``tailrace serve`` sets them; with
    a ``tools`` step, a chat request offering client tools (``tool_spec``) to the first
    one, which answers it (one stage answers a request)."""
    out = []
    t = tools_step(sc)
    for i, r in enumerate(records):
        own = sc.urgency[i] if i < len(sc.urgency) else None
        u = ({k: v for k, v in zip(("priority", "deadline_ms"), own, strict=True)
              if v is not None} if own is not None else None)
        # options: {} (as the OpenAI wire sends) for odd records, None (a Python caller)
        # for even ones: the answering stage reports its reply either way
        chat: dict[str, Any] = {} if t is None else {
            "tools": tool_spec(sc.seed, r["lid"]), "answers": tools_field(t),
            "options": {} if i % 2 else None,
            "messages": [{"role": "user", "content": f"question {r['lid']}"}]}
        out.append((r, Request(asked=u or None, **chat)))
    return out
ANSWER_S = 1.0  # how long callers may wait for an answer once their records ended
#: the same on Ray: a record's end (a filter's verdict) is answered once it is acknowledged
#: end to end, which waits for a killed actor's restart and the replay
RAY_ANSWER_S = 15.0


def _all_ended(sc: Scenario, lids: set, outputs: list, errors: list, ledger: Ledger) -> bool:
    """Whether every record of these requests ended in the pipeline (rejected ones too)."""
    obs = Observed(lids, list(outputs), list(errors), ledger.entries(),
                   transient=SERVING_FIELDS)
    return not any("never ended" in x for x in account(sc, obs))


def _overloaded(task: asyncio.Task) -> bool:
    from tailrace.serving.errors import ServiceOverloaded

    return task.done() and not task.cancelled() and \
        isinstance(task.exception(), ServiceOverloaded)


def _paths(x: Any) -> list:
    try:
        return lineages(x)
    except ValueError:
        return []


def _on_first_answer(svc: Any, runs: Any, sc: Scenario, probe: Probe, ray: Any,
                     skipped: set) -> None:
    """Ray: when the service hears its first answer, the callers of ``sc.cancel`` cancel
    (``probe.on_cancel``) and the actor of ``sc.kill``'s stage (of its run, which the
    ``ActiveRuns`` ``runs`` lists) is killed. A cancelled record the source had not taken
    yet never enters: its lid goes to ``skipped``."""
    victim = stage_id(sc.kill, sc.steps[sc.kill]) if sc.kill is not None else None
    lids = sorted({lid for _, lid in sc.cancel})
    done: list = []
    hooks = {h: getattr(svc, h) for h in ("_on_output", "_on_error", "_on_drop")}

    def first() -> None:
        if done:
            return
        done.append(None)
        for lid in lids:
            if probe.on_cancel is not None:
                probe.on_cancel(lid)
        if victim is not None:
            for r in runs.describe():
                actors = r["stages"].get(victim) or next(iter(r["stages"].values()), [])
                for name, _node in actors[-1:]:  # the newest replica (scaled out, if any)
                    ray.kill(ray.get_actor(name), no_restart=False)

    def hooked(fn: Any) -> Any:
        def call(*a: Any) -> None:
            fn(*a)
            first()
        return call

    for h, fn in hooks.items():
        setattr(svc, h, hooked(fn))
    taken = svc._feed._taken

    def take(record: Any) -> bool:
        ok = taken(record)
        if not ok:
            skipped.add(record["lid"])
        return ok

    svc._feed._taken = take


def _observe(svc: Any, outputs: list, errors: list, dropped: list) -> None:
    """Hear every output, error record and drop of the service's run, answered or not."""
    on_output, on_error, on_drop = svc._on_output, svc._on_error, svc._on_drop

    def output(record: Any) -> None:
        outputs.append(record)
        on_output(record)

    def error(err: Any) -> None:
        errors.append(err)
        on_error(err)

    def drop(stage: str, records: list) -> None:
        dropped.extend(records)
        on_drop(stage, records)

    svc._on_output, svc._on_error, svc._on_drop = output, error, drop


def run_ray(sc: Scenario, ray: Any) -> Report:
    """The scenario through ``tr.run(runtime="ray")``; ``kill`` kills a stage's actor
    once the first output reached the driver."""
    from tailrace.runtime.ray import ActiveRuns

    report = Report()
    run, probe, ledger, tmp = _setup(sc)
    outputs: list = []
    errors: list = []
    killed: list = []
    runs = ActiveRuns()
    victim = stage_id(sc.kill, sc.steps[sc.kill]) if sc.kill is not None else None

    def sink(x: Any) -> None:
        outputs.append(x)
        if victim is not None and not killed:
            killed.append(None)
            for r in runs.describe():
                actors = r["stages"].get(victim) or next(iter(r["stages"].values()), [])
                for name, _node in actors[-1:]:  # the newest replica (scaled out, if any)
                    ray.kill(ray.get_actor(name), no_restart=False)
                    killed[0] = name

    gate = CountingGate(sc.admission.gate()) if sc.admission is not None else None
    try:
        with LeakWatch() as leaks:
            p = build(sc, ledger, run, data=inputs(sc.n), sink=sink)
            job = _Watched(lambda: tr.run(p, runtime="ray", fuse=sc.fuse,
                                          errors=errors.append, admission=gate, runs=runs,
                                          placement=placement(sc, p)),
                           lambda: (len(outputs), len(errors)))
            if not job.wait(stall_s=30.0):
                report.problems.append("the Ray run hung (no output for 30 s)")
                return report
            err = job.box.get("error")
            if err is not None:
                report.problems.append(f"tr.run raised {type(err).__name__}: {err}")
                return report
            stats = job.box["result"].stats
            obs = Observed(set(range(sc.n)), outputs, errors, ledger.entries())
            report.problems += account(sc, obs)
            report.problems += queue_problems(stats)
            if gate is not None:
                report.problems += gate.balance()
            report.problems += leaks.problems()
    finally:
        if gate is not None:
            gate.close()
        _teardown(run, probe, tmp)
    return report


def placement(sc: Scenario, p: Any) -> dict | None:
    """The run's ``placement`` for ``sc.where`` (None: the runtime's default)."""
    if not sc.where:
        return None
    if sc.where == "host":
        return {"*": {"where": "host"}}
    from tailrace.compiler import compile_pipeline
    from tailrace.runtime.ray.placement import driver_stages

    plan = compile_pipeline(p, fuse=sc.fuse)
    return {plan.stages[i].ops[0].id: {"where": "driver"}
            for i in driver_stages(plan, {}, served=True)}


def without(sc: Scenario, **kw: Any) -> Scenario:
    return replace(sc, **kw)
