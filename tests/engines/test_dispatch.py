"""Dispatch policies: the choice rules, and load balance under skewed request sizes."""

from __future__ import annotations

import random

import pytest

from tailrace.engines.pool.dispatch import (
    LeastOutstandingWork,
    ReplicaLoad,
    RoundRobin,
    make_dispatch,
)


def test_least_work_picks_the_fewest_outstanding_tokens_then_fewest_calls_then_id():
    pick = LeastOutstandingWork().choose
    assert pick([ReplicaLoad(0, outstanding_work=50, max_concurrency=4),
                 ReplicaLoad(1, outstanding_work=20, in_flight=3, max_concurrency=4)], 10) == 1
    assert pick([ReplicaLoad(0, outstanding_work=20, in_flight=2, max_concurrency=4),
                 ReplicaLoad(1, outstanding_work=20, in_flight=1, max_concurrency=4)], 10) == 1
    assert pick([ReplicaLoad(3), ReplicaLoad(2)], 10) == 2


def test_least_work_skips_down_and_full_replicas_and_says_none_when_all_are():
    pick = LeastOutstandingWork().choose
    loads = [ReplicaLoad(0, healthy=False), ReplicaLoad(1, outstanding_work=900),
             ReplicaLoad(2, in_flight=1, max_concurrency=1)]
    assert pick(loads, 10) == 1
    assert pick(loads[:1] + loads[2:], 10) is None
    assert pick([], 10) is None


def test_a_work_limit_refuses_more_but_an_idle_replica_takes_anything():
    full = ReplicaLoad(0, outstanding_work=90, in_flight=1, max_concurrency=4, max_work=100)
    idle = ReplicaLoad(1, max_work=100)
    assert full.can_take(10) and not full.can_take(11)
    assert idle.can_take(10_000)
    assert LeastOutstandingWork().choose([full], 50) is None


def test_round_robin_rotates_and_skips_down_or_full_replicas():
    rr = RoundRobin()
    loads = [ReplicaLoad(0), ReplicaLoad(1, in_flight=1), ReplicaLoad(2)]
    assert [rr.choose(loads, 1) for _ in range(4)] == [0, 2, 0, 2]
    assert rr.choose([ReplicaLoad(0, healthy=False)], 1) is None


def test_make_dispatch_by_name():
    assert isinstance(make_dispatch("least_work"), LeastOutstandingWork)
    assert make_dispatch("round_robin") is not make_dispatch("round_robin")  # own state
    with pytest.raises(ValueError, match="unknown dispatch policy 'x'; known: least_work, "
                                         "round_robin"):
        make_dispatch("x")


def simulate(policy, seed: int, n_calls: int = 2000, replicas: int = 4):
    """Calls of lognormal sizes arrive (Poisson, ~85% load) onto replicas that each run
    their calls first come first served at 1000 tokens/s. Returns (mean spread of
    outstanding work at dispatch, p99 latency, makespan)."""
    rng = random.Random(seed)
    sizes = [min(int(rng.lognormvariate(5.0, 1.3)) + 8, 20_000) for _ in range(n_calls)]
    rate = 1000.0
    gap = sum(sizes) / n_calls / rate / replicas / 0.85
    free_at = [0.0] * replicas
    running: list[list[tuple[float, int]]] = [[] for _ in range(replicas)]  # (finish, size)
    t, spreads, latencies = 0.0, [], []
    for size in sizes:
        t += rng.expovariate(1.0 / gap)
        for r in running:
            r[:] = [c for c in r if c[0] > t]
        loads = [ReplicaLoad(i, outstanding_work=sum(s for _, s in r), in_flight=len(r),
                             max_concurrency=10_000) for i, r in enumerate(running)]
        work = [x.outstanding_work for x in loads]
        spreads.append(max(work) - min(work))
        i = policy.choose(loads, size)
        free_at[i] = max(t, free_at[i]) + size / rate
        running[i].append((free_at[i], size))
        latencies.append(free_at[i] - t)
    latencies.sort()
    return (sum(spreads) / len(spreads), latencies[int(0.99 * len(latencies))], max(free_at))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_least_work_balances_skewed_sizes_better_than_round_robin(seed):
    lw_spread, lw_p99, lw_makespan = simulate(make_dispatch("least_work"), seed)
    rr_spread, rr_p99, rr_makespan = simulate(make_dispatch("round_robin"), seed)
    assert lw_spread < 0.6 * rr_spread
    assert lw_makespan < rr_makespan
    assert lw_p99 < rr_p99
