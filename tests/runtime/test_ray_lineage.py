"""Exactly once by lineage on Ray: a stage actor killed mid-run is replayed, and the
replay behaves differently from the first execution (a ``flat_map`` that emits three
children instead of one, a ``filter`` that keeps what it dropped). Every input must end
exactly once (outputs of one complete execution, an error, or a drop), never mixed,
duplicated or lost. The ledger and the lineage runner are also tested on their own."""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import pytest

import tailrace as tr
from tailrace.api.records import ErrorRecord
from tailrace.compiler import compile_pipeline
from tailrace.engines import open_engine
from tailrace.operators import BuildContext
from tailrace.runtime.lineage import Trace, ids
from tailrace.runtime.ray import ActiveRuns
from tailrace.runtime.ray.ledger import Ledger
from tailrace.runtime.ray.messages import Commit, Delivery, Failures
from tailrace.runtime.stage import StageWorker

N = 4_000
_FIRST: dict[str, int] = {}


def first_pid(folder: str) -> int:
    """The pid of the first process that ran the stage in this test (a file in
    ``folder``): a restarted actor is another process."""
    if folder not in _FIRST:
        path = os.path.join(folder, "first")
        try:
            with open(path, "x") as f:
                f.write(str(os.getpid()))
        except FileExistsError:
            pass
        with open(path) as f:
            _FIRST[folder] = int(f.read() or os.getpid())
    return _FIRST[folder]


def executed(folder: str, x: int) -> int:
    """Log that this process ran the stage on ``x``; returns the pid."""
    pid = os.getpid()
    with open(os.path.join(folder, f"exec-{pid}"), "a") as f:
        f.write(f"{x}\n")
    return pid


def executions(folder: str) -> dict[int, set[int]]:
    """Input -> the pids that ran the stage on it."""
    out: dict[int, set[int]] = defaultdict(set)
    for name in os.listdir(folder):
        if name.startswith("exec-"):
            pid = int(name[5:])
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    if line.endswith("\n"):  # not the line a killed process was writing
                        out[int(line)].add(pid)
    return out


class Fan:
    """flat_map: one child in the stage's first process, three in a restarted one;
    inputs ending in 3 fail."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, x: int) -> list:
        pid = executed(self.folder, x)
        if x % 10 == 3:
            raise ValueError(f"bad input {x}")
        if pid == first_pid(self.folder):
            return [(x, "first", 0)]
        return [(x, "replay", k) for k in range(3)]


class Coin:
    """filter: keeps even inputs in the stage's first process, every input in a restarted
    one."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, x: int) -> bool:
        pid = executed(self.folder, x)
        return pid != first_pid(self.folder) or x % 2 == 0


def keep(x):
    return x % 10 != 7


def post(x):
    return x


def killer(ray, active: ActiveRuns, pipeline: str, victim: str, after: int, got: list,
           killed: list):
    """A sink that kills the actor running ``victim`` (of a run ``active`` lists) once
    ``after`` records arrived."""

    def sink(x):
        got.append(x)
        if len(got) >= after and not killed:
            [run] = [r for r in active.describe() if r["pipeline"] == pipeline]
            [(name, _node)] = run["stages"][victim]
            ray.kill(ray.get_actor(name), no_restart=False)
            killed.append(name)

    return sink


@pytest.mark.slow
def test_a_flat_map_that_fans_out_differently_on_replay_delivers_one_execution_per_input(
        ray_session, tmp_path):
    got: list = []
    killed: list = []
    active = ActiveRuns()
    p = tr.Pipeline("fan-replay")
    (p.source(range(N)).filter(keep, id="keep").flat_map(Fan(str(tmp_path)), id="fan")
     .map(post, id="post", queue=256)
     .sink(killer(ray_session, active, "fan-replay", "fan", 500, got, killed)))
    result = tr.run(p, runtime="ray", runs=active)

    assert killed, "the stage actor was never killed"
    runs = executions(str(tmp_path))
    replayed = [x for x, pids in runs.items() if len(pids) > 1]
    assert replayed, "no input was running when the actor died: nothing was replayed"
    outputs: dict[int, list] = defaultdict(list)
    for x, how, k in got:
        outputs[x].append((how, k))
    errors = Counter(e.input for e in result.errors)
    assert all(e.stage == "fan" and e.error == "ValueError" for e in result.errors)
    for x in range(N):
        if x % 10 == 7:  # dropped by the filter: no output, no error
            assert x not in outputs and x not in errors, x
        elif x % 10 == 3:  # failed: one error record, even when replayed
            assert errors[x] == 1 and x not in outputs, x
        else:  # the outputs of exactly one complete execution
            assert sorted(outputs[x]) in ([("first", 0)],
                                          [("replay", 0), ("replay", 1), ("replay", 2)]), x
    assert set(errors) == {x for x in range(N) if x % 10 == 3}
    assert result.stats.actor_restarts >= 1


@pytest.mark.slow
def test_a_filter_that_keeps_more_on_replay_delivers_each_record_once(ray_session, tmp_path):
    got: list = []
    killed: list = []
    active = ActiveRuns()
    p = tr.Pipeline("coin-replay")
    (p.source(range(N)).filter(Coin(str(tmp_path)), id="coin")
     .map(post, id="post", queue=256)
     .sink(killer(ray_session, active, "coin-replay", "coin", 500, got, killed)))
    result = tr.run(p, runtime="ray", runs=active)

    assert killed, "the stage actor was never killed"
    runs = executions(str(tmp_path))
    first = min(runs[0])  # the first process ran the first input, and only it
    assert any(len(pids) > 1 for pids in runs.values()), "nothing was replayed"
    assert not result.errors
    counts = Counter(got)
    assert max(counts.values()) == 1, "a record was delivered twice"
    # kept by an execution that completed: every even input, and every input a
    # restarted process ran (the first process's drop of it was never delivered)
    expected = {x for x in range(N) if x % 2 == 0 or runs[x] - {first}}
    assert set(counts) == expected


def pair(x):
    return [2 * x, 2 * x + 1]


def test_a_fan_out_fused_with_a_branch_numbers_children_across_both_ports(ray_session):
    p = tr.Pipeline("fan-branch")
    t, f = p.source(range(50)).flat_map(pair, id="fan").branch(lambda x: x % 2 == 0, id="b")
    t.merge(f, id="m").sink(out := [])
    result = tr.run(p, runtime="ray")
    assert len(result.plan.stages) == 3  # source, fan+b, m+sink
    assert sorted(out) == list(range(100))


# -- the lineage runner, on its own -------------------------------------------------------
def _replica(p: tr.Pipeline) -> tuple[StageWorker, None]:
    """The first operator stage, built as a host builds it (its sink runs in the driver)."""
    stage = next(s for s in compile_pipeline(p).stages if s.ops[0].op.kind != "source")
    ops = [o for o in stage.ops if o.op.kind != "sink"]
    rts = [o.op.build(o.params, BuildContext(o.contract, open_engine)) for o in ops]
    return StageWorker(stage, rts), None


def run_chain(w: StageWorker, fans: None, batch: list, errors: list, esrc: list):
    """The worker's chain with a lineage trace: port -> (records, input positions)."""
    trace = Trace()
    ports = w.run_chain(batch, errors, trace)
    esrc.extend(trace.esrc)
    return {port: (recs, trace.src.get(port)) for port, recs in ports.items()}, trace.fanned


def fail_on_4(x):
    if x == 4:
        raise ValueError("four")
    return x * 10


def children(x):
    return [x] * (x % 3)


def test_lineage_through_a_fused_chain_with_errors_drops_and_fan_out():
    p = tr.Pipeline("t")
    (p.source([0]).map(fail_on_4, id="m").filter(lambda x: x != 20, id="f")
     .flat_map(children, id="fm").sink(id="out"))
    rep, fans = _replica(p)
    errors: list = []
    esrc: list = []
    batch = list(range(7))  # 0, 10, 20 (dropped), 30, 4 fails, 50, 60
    ports, fanned = run_chain(rep, fans, batch, errors, esrc)
    recs, src = ports[None]
    assert fanned
    assert recs == [10, 50, 50]  # 0, 30 and 60 have no children (x % 3 == 0)
    lin = range(100, 107)
    assert list(ids(lin, src, True)) == [(101, 0), (105, 0), (105, 1)]
    assert [e.input for e in errors] == [4] and esrc == [4]
    assert list(ids(lin, esrc, True, errors=True)) == [(104, -1)]


def test_lineage_of_identical_objects_and_a_branch():
    p = tr.Pipeline("t")
    s = p.source([0]).filter(lambda x: x == "a", id="f")
    t, f = s.branch(lambda x: True, id="b")
    t.sink(id="t")
    f.sink(id="x")
    rep, fans = _replica(p)
    a = "a"
    ports, fanned = run_chain(rep, fans, [a, "b", a, "c"], [], [])
    assert not fanned
    recs, src = ports["true"]
    assert recs == ["a", "a"] and src == [0, 2] and ports["false"] == ([], [])


# -- the ledger, on its own ---------------------------------------------------------------
def d(key, records, lin):
    return Delivery(9, key, records, lin, 0.0, 0.0)


def test_ledger_keeps_the_first_delivery_of_each_id_and_drops_replays():
    led = Ledger()
    assert led.offer(d((0, 0), ["a", "b"], range(0, 2))) == [d((0, 0), ["a", "b"], range(2))]
    # a replay that dropped record 0 and kept record 2 this time
    [e] = led.offer(d((0, 0), ["B", "C"], [1, 2]))
    assert (e.records, list(e.lineage)) == (["C"], [2])
    assert led.dropped == 1
    led.settle((0, 0))
    assert led.offer(d((0, 0), ["late"], [5])) == []  # a straggler after the batch ended


def test_ledger_delivers_one_complete_fan_out_execution_per_input():
    led = Ledger()
    route = (0, 0)
    first, replay = route + ((3, 111),), route + ((3, 222),)
    # the first execution delivered one child of input 0 and died before committing
    assert led.offer(d(first, ["x0"], [(0, 0)])) == []
    # the replay emits three children of input 0 and one of input 1, then commits
    assert led.offer(d(replay, ["r0", "r1", "r2", "s0"], [(0, 0), (0, 1), (0, 2), (1, 0)])) \
        == []
    [e] = led.commit(Commit(3, route, 222, [0, 1]))
    assert e.records == ["r0", "r1", "r2", "s0"]
    # a late commit of another execution of the same inputs wins nothing
    assert led.commit(Commit(3, route, 111, [0, 1])) == []
    assert led.offer(d(first, ["x1"], [(1, 0)])) == []
    led.settle(route)
    assert led.dropped == 2


def test_ledger_an_input_ends_once_as_an_error_or_an_output():
    led = Ledger()
    err = Failures(2, (0, 0), [ErrorRecord("m", 5, "ValueError", "no")], [5])
    assert led.offer(err) == [err]
    assert led.offer(d((0, 0), [5], [5])) == []  # the replay succeeded: too late
    # copies on two routes (a port feeding two stages) are two records, not replays
    assert led.offer(d((0, 0, 4), ["p"], [6])) and led.offer(d((0, 0, 7), ["q"], [6]))
    # but an error of the copied record's ancestor, after its copies were delivered, is
    assert led.offer(Failures(2, (0, 0), [ErrorRecord("m", 6, "ValueError", "no")],
                              [6])) == []


def test_ledger_nested_fan_outs_wait_for_both_commits():
    led = Ledger()
    route = (0, 0)
    inner = route + ((1, 11),)
    entry = d(inner + ((2, 22),), ["g"], [((0, 0), 0)])
    assert led.offer(entry) == []
    assert led.commit(Commit(2, inner, 22, [(0, 0)])) == []  # the outer one is pending
    assert led.commit(Commit(1, route, 11, [0])) == [entry]
    assert led.offer(d((0, 0, 4), ["p"], [3])) and not led.offer(d((0, 0, 4), ["p"], [3]))
