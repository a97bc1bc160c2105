"""Fault tolerance on Ray: a stage's actor is killed in the middle of a 10,000-record
run; it restarts, unacknowledged records are replayed, and the sink still receives the
expected multiset exactly (no loss, no duplicates), with the restart in the stats."""

from collections import Counter

import pytest

import tailrace as tr
from tailrace.runtime.ray import active_runs

N = 10_000


def work(x):
    return x * 3 + 1


def post(x):
    return x % 7_919


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["work", "post"])  # fed by the driver / by an actor
def test_killing_a_stage_actor_mid_run_loses_and_duplicates_nothing(ray_session, victim):
    ray = ray_session
    got: list = []
    killed: list = []

    def sink(x):
        got.append(x)
        if len(got) == 3_000 and not killed:  # well inside the run: ~7,000 still to come
            [run] = [r for r in active_runs() if r["pipeline"] == "fault"]
            [(name, _node)] = run["stages"][victim]
            ray.kill(ray.get_actor(name), no_restart=False)
            killed.append(name)

    p = tr.Pipeline("fault")
    p.source(range(N)).map(work, id="work").map(post, id="post", queue=256).sink(sink)
    result = tr.run(p, runtime="ray")

    assert killed, "the stage actor was never killed"
    assert Counter(got) == Counter(post(work(x)) for x in range(N))
    assert not result.errors
    stats = result.stats
    assert stats.records_in == stats.records_out == N
    assert stats[victim].restarts >= 1  # the replica was rebuilt on the restarted actor
    assert stats.actor_restarts >= 1
    if victim == "work":  # post's actor lived: its counts are exact
        assert stats["post"].records_in >= N  # every record, plus the replayed ones
        assert stats.duplicates == stats["post"].records_out - N  # dropped by the sink
