"""Ray runtime semantics beyond the shared suite: process-safe twins of the shared tests
that need in-process state, backpressure, serialisation failures, stats format,
placement options and admission."""

import os
import subprocess
import sys
import threading
import time

import pytest

import tailrace as tr
from tailrace.control import make_policy
from tailrace.control.gate import AdmissionGate
from tailrace.runtime.ray import placement as placement_mod

RELEASE = threading.Event()  # in each host process; never set: the call is abandoned


@pytest.fixture(autouse=True)
def _ray(ray_session):
    return ray_session


def ray_run(p, **kw):
    return tr.run(p, runtime="ray", **kw)


def upper_with_sizes(xs):
    return [(x.upper(), len(xs)) for x in xs]


def test_batch_contract_calls_fn_with_lists_of_at_most_max_size():
    p = tr.Pipeline("t")
    p.source(list("abcde")).map(upper_with_sizes, batch={"max_size": 2}).sink()
    out = ray_run(p).outputs
    assert [x for x, _ in out] == list("ABCDE")
    assert max(n for _, n in out) <= 2


def slow_on_1(x):
    if x == 1:
        RELEASE.wait(5)  # in the actor: abandoned by the timeout, never slept in full
    return x


def test_timeout_sync_operator():
    p = tr.Pipeline("t")
    p.source([0, 1, 2]).map(slow_on_1, id="slow", timeout_ms=50).sink()
    result = ray_run(p)
    assert sorted(result.outputs) == [0, 2]
    [err] = result.errors
    assert (err.stage, err.input, err.error) == ("slow", 1, "StageTimeout")
    assert err.message == "operator took longer than timeout_ms=50"
    assert result.stats["slow"].timeouts == 1


def meet(args):
    """Wait (up to 5 s) until two callers have checked in: passes only if they overlap."""
    folder, x = args
    open(os.path.join(folder, f"{x}-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 5
    while len(os.listdir(folder)) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the other replica never ran at the same time")
        time.sleep(0.002)
    return os.getpid()


def test_blocking_replicas_run_in_parallel_actors(tmp_path):
    p = tr.Pipeline("t")
    p.source([(str(tmp_path), 1), (str(tmp_path), 2)], queue=2).map(
        meet, replicas=2, queue=2, blocking=True).sink()
    result = ray_run(p)
    assert not result.errors
    assert len(set(result.outputs)) == 2  # two replicas, two actor processes
    assert os.getpid() not in result.outputs


def test_unpicklable_function_is_rejected_before_any_actor_starts():
    lock = threading.Lock()
    p = tr.Pipeline("t")
    p.source([1]).map(lambda x: (lock, x)[1], id="locked").sink()
    before = placement_mod.host_pool().created
    with pytest.raises(tr.PlanError, match=(
            r"^stage 'locked': cannot be sent to a Ray actor: pickling its operator failed "
            r"\(TypeError: cannot pickle '_thread.lock' object\); define functions")):
        ray_run(p)
    assert placement_mod.host_pool().created == before


class Tagger(tr.Operator):
    def __init__(self, guard=None, tag="t"):
        self.tag = tag

    def process(self, record):
        return {**record, "tag": self.tag}


def test_custom_operator_with_an_unpicklable_argument_is_rejected():
    p = tr.Pipeline("t")
    p.source([{"a": 1}]).apply(Tagger, id="custom", guard=threading.Lock()).sink()
    with pytest.raises(tr.PlanError, match=r"^stage 'custom': cannot be sent to a Ray actor"):
        ray_run(p)
    p = tr.Pipeline("t")
    p.source([{"a": 1}]).apply(Tagger, id="custom", tag="ok").sink()
    assert ray_run(p).outputs == [{"a": 1, "tag": "ok"}]


def lock_on_2(x):
    return threading.Lock() if x == 2 else x


def test_a_record_that_cannot_cross_actors_becomes_an_error_record():
    p = tr.Pipeline("t")
    p.source(range(5)).map(lock_on_2, id="make").map(str, id="after").sink()
    result = tr.run(p, runtime="ray", fuse=False)
    assert sorted(result.outputs) == ["0", "1", "3", "4"]
    [err] = result.errors
    assert err.stage == "make" and err.error == "TypeError"
    assert err.message.startswith("record cannot be sent to the next Ray actor")
    # the same record meant for the driver's sink
    p = tr.Pipeline("t")
    p.source(range(5)).map(lock_on_2, id="make").sink(out := [], id="out")
    result = ray_run(p)
    assert out == [0, 1, 3, 4]
    [err] = result.errors
    assert (err.stage, err.message) == ("out", "record cannot be sent back to the driver")


def crawl(x):
    time.sleep(0.0003)
    return x


def test_a_slow_stage_throttles_the_source():
    """End-to-end credits: the source never runs ahead of the sink by more than the first
    edge's window (its bound, 64 records) plus one read chunk (8), however slow the
    middle stage: nothing piles up anywhere in between."""
    read = [0]
    done = [0]
    lead = [0]

    def source():
        for i in range(1500):
            read[0] += 1
            lead[0] = max(lead[0], read[0] - done[0])
            yield i

    def sink(x):
        done[0] += 1

    p = tr.Pipeline("t")
    p.source(source()).map(crawl, id="slow", queue=64).map(abs, id="after", queue=16).sink(sink)
    result = tr.run(p, runtime="ray", fuse=False)
    assert done[0] == 1500
    assert lead[0] <= 64 + 8
    for s in result.stats.stages:
        if s.queue_bound:
            assert s.max_queue_depth <= s.queue_bound, s.stage


def test_stats_have_the_local_rows_and_format():
    def build():
        p = tr.Pipeline("t")
        s = p.source(range(100), id="src").map(abs, id="a").filter(bool, id="f")
        t, f = s.branch(lambda x: x % 2 == 0, id="b")
        t.merge(f, id="m").map(str, id="s", replicas=2).sink()
        return p

    local, ray = tr.run(build()), ray_run(build())
    assert sorted(ray.outputs) == sorted(local.outputs)

    def rows(stats):
        return [(s.stage, s.op, s.records_in, s.records_out, s.errors, s.queue_bound,
                 s.replicas, s.fused_into) for s in stats.stages]

    assert rows(ray.stats) == rows(local.stats)
    ld, rd = local.stats.to_dict(), ray.stats.to_dict()
    assert set(ld) <= set(rd) and set(ld["stages"][0]) <= set(rd["stages"][0])
    assert rd["actor_restarts"] == 0 and rd["duplicates"] == 0
    assert ray.stats.scheduling_us.count == 100
    assert tr.format_stats(ray.stats).splitlines()[1] == tr.format_stats(
        local.stats).splitlines()[1]


def test_admission_gate_on_ray():
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=100))
    p = tr.Pipeline("qa")
    p.source(fields=["q"]).map(lambda r: {**r, "a": len(r["q"])}, id="work").sink()
    result = ray_run(p, input=[{"q": "x" * i} for i in range(20)], admission=gate)
    assert sorted(r["a"] for r in result.outputs) == list(range(20))
    stats = gate.statistics()
    assert stats.admitted == 20 and stats.in_flight == 0


def broken_build(x):
    return x


class Broken(tr.Operator):
    def __init__(self):
        raise ValueError("model file missing")


def test_a_stage_that_fails_to_build_on_its_actor_raises_the_original_error():
    p = tr.Pipeline("t")
    p.source([1]).apply(Broken, id="broken").sink()
    with pytest.raises(ValueError, match="model file missing"):
        ray_run(p)


@pytest.mark.parametrize("placement, message", [
    ({"nope": {}}, r"^placement names unknown stage 'nope'; stages: source, sq, sink$"),
    ({"sq": {"strategy": "scatter"}},
     r"^stage 'sq': placement strategy must be one of pack, spread, got 'scatter'$"),
    ({"sq": {"num_cpus": -1}},
     r"^stage 'sq': placement num_cpus must be a non-negative number, got -1$"),
    ({"sq": {"gpus": 1}},
     r"^stage 'sq': unknown placement option\(s\) gpus; known: num_cpus, num_gpus, memory, "
     r"resources, strategy, where$"),
])
def test_bad_placement_is_a_plan_error(placement, message):
    p = tr.Pipeline("t")
    p.source([1]).map(abs, id="sq").sink()
    with pytest.raises(tr.PlanError, match=message):
        ray_run(p, placement=placement)


def test_address_and_placement_need_the_ray_runtime():
    p = tr.Pipeline("t")
    p.source([1]).sink()
    with pytest.raises(tr.PlanError, match="address= and placement= apply to runtime='ray'"):
        tr.run(p, address="127.0.0.1:6379")


def test_the_local_runtime_never_imports_ray():
    code = ("import sys, tailrace as tr; p = tr.Pipeline('t'); p.source([1]).map(abs).sink();"
            "tr.run(p); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
