"""Dispatch policies: the choice rules, and load balance under skewed request sizes."""

from __future__ import annotations

import random

import pytest

from tailrace.engines.base import GenerationRequest
from tailrace.engines.pool.dispatch import (
    Affinity,
    LeastOutstandingWork,
    LoadTable,
    PrefixAffinity,
    PrefixIndex,
    ReplicaLoad,
    RoundRobin,
    affinity_of,
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


def test_a_replica_takes_calls_up_to_its_concurrency_while_healthy():
    assert ReplicaLoad(0, outstanding_work=10_000, in_flight=3, max_concurrency=4).can_take(10)
    full = ReplicaLoad(0, in_flight=4, max_concurrency=4)
    assert not full.can_take(0) and not ReplicaLoad(1, healthy=False).can_take(0)
    assert LeastOutstandingWork().choose([full], 50) is None


def test_round_robin_rotates_and_skips_down_or_full_replicas():
    rr = RoundRobin()
    loads = [ReplicaLoad(0), ReplicaLoad(1, in_flight=1), ReplicaLoad(2)]
    assert [rr.choose(loads, 1) for _ in range(4)] == [0, 2, 0, 2]
    assert rr.choose([ReplicaLoad(0, healthy=False)], 1) is None


def test_make_dispatch_by_name():
    assert isinstance(make_dispatch("least_work"), LeastOutstandingWork)
    assert make_dispatch("round_robin") is not make_dispatch("round_robin")  # own state
    assert isinstance(make_dispatch("prefix_affinity"), PrefixAffinity)
    with pytest.raises(ValueError, match="unknown dispatch policy 'x'; known: least_work, "
                                         "prefix_affinity, round_robin"):
        make_dispatch("x")


@pytest.mark.parametrize(("kw", "match"), [
    ({"name": "prefix_affinity", "affinity_slack": -1}, "affinity_slack must be an integer >= 0"),
    ({"name": "prefix_affinity", "affinity_slack": "lots"},
     "affinity_slack must be an integer >= 0 .*got 'lots'"),
    ({"name": "least_work", "affinity_slack": 10},
     "affinity_slack applies to dispatch: prefix_affinity, not 'least_work'"),
])
def test_bad_affinity_options_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        make_dispatch(**kw)


# -- prefix_affinity -------------------------------------------------------------------

def conversation(turns: int, tag: str = "") -> GenerationRequest:
    """A chat whose ``turns``-th user message is the last (long turns: ~100 tokens each)."""
    msgs: list[dict[str, str]] = [{"role": "system", "content": f"{tag} be brief " * 40}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"{tag} question {t} " * 30})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"{tag} answer {t} " * 30})
    return GenerationRequest(messages=tuple(msgs))


def two(work0: int = 0, work1: int = 0) -> list[ReplicaLoad]:
    return [ReplicaLoad(0, outstanding_work=work0, max_concurrency=4),
            ReplicaLoad(1, outstanding_work=work1, max_concurrency=4)]


def test_affinity_keys_chain_chat_messages_and_prompt_blocks():
    a, b = affinity_of(conversation(1)), affinity_of(conversation(2))
    assert b.keys[:len(a.keys)] == a.keys and len(b.keys) == len(a.keys) + 2  # turn 2
    # extends turn 1's messages by an answer and a question
    assert not set(affinity_of(conversation(1, "other")).keys) & set(a.keys)
    assert list(b.tokens) == sorted(b.tokens) and b.tokens[-1] > a.tokens[-1]
    p1 = affinity_of(GenerationRequest(prompt="x" * 600 + "tail one"), block_chars=256)
    p2 = affinity_of(GenerationRequest(prompt="x" * 600 + "tail two"), block_chars=256)
    assert len(p1.keys) == 3 and p1.keys[:2] == p2.keys[:2] and p1.keys[2] != p2.keys[2]
    assert affinity_of(GenerationRequest(prompt="hi", session="s1")).session == "s1"


def test_affinity_sends_a_conversation_to_the_replica_holding_its_history():
    pa = PrefixAffinity(slack=1000)
    first = pa.choose(two(work0=0, work1=10), 100, affinity_of(conversation(1, "a")))
    assert first == 0
    # replica 0 is now busier, so least work says 1: the history's replica still wins
    assert LeastOutstandingWork().choose(two(work0=600, work1=0), 100) == 1
    assert pa.choose(two(work0=600, work1=0), 100, affinity_of(conversation(2, "a"))) == 0
    assert pa.choose(two(work0=900, work1=0), 100, affinity_of(conversation(3, "a"))) == 0
    # an unrelated conversation goes by least work
    assert pa.choose(two(work0=600, work1=0), 100, affinity_of(conversation(1, "b"))) == 1
    assert pa.affine == 2 and pa.fallbacks == 0


def test_affinity_falls_back_to_least_work_beyond_the_slack_or_when_full():
    pa = PrefixAffinity(slack=500)
    assert pa.choose(two(), 100, affinity_of(conversation(1, "a"))) == 0
    assert pa.choose(two(work0=501, work1=0), 100, affinity_of(conversation(2, "a"))) == 1
    assert pa.fallbacks == 1
    # now both replicas hold turn 1's prefix; turn 2's full history lives on 1 only
    assert pa.choose(two(work0=0, work1=400), 100, affinity_of(conversation(3, "a"))) == 1
    full = [ReplicaLoad(0, max_concurrency=4), ReplicaLoad(1, in_flight=4, max_concurrency=4)]
    assert pa.choose(full, 100, affinity_of(conversation(4, "a"))) == 0


def test_a_short_shared_prefix_does_not_attract():
    pa = PrefixAffinity(slack=10_000)
    pa.choose(two(), 10, Affinity(keys=(1, 2), tokens=(10, 20)))  # on 0, 10 tokens shared
    assert pa.choose(two(work0=50), 10, Affinity(keys=(1, 3), tokens=(10, 20))) == 1


def test_the_prefix_index_forgets_least_recently_used_prompts():
    ix = PrefixIndex(capacity=2)
    ix.add((1, 2))
    ix.add((1, 3))
    assert ix.match((1, 2, 5)) == 2 and len(ix) == 2
    ix.add((1, 2))  # used again: now the most recent
    ix.add((7, 8))  # evicts (1, 3)
    assert ix.match((1, 3)) == 1 and ix.match((1, 2)) == 2 and ix.match((7, 8)) == 2
    ix.add((9,))  # evicts (1, 2): key 1 leaves with its last prompt
    assert ix.match((1, 2)) == 0 and len(ix) == 2


def test_policy_capacity_bounds_what_each_replica_is_credited_with():
    pa = PrefixAffinity(slack=10_000, capacity=2)
    convs = [affinity_of(conversation(1, tag)) for tag in "abc"]
    for c in convs:
        assert pa.choose(two(work1=1), 10, c) == 0  # all onto replica 0 (least work)
    # conversation a was pushed out of replica 0's two remembered prompts
    assert pa.preferred(two(), affinity_of(conversation(2, "a"))) == []
    assert pa.preferred(two(), affinity_of(conversation(2, "c"))) == [0]
    pa.forget(0)  # replica 0 restarted
    assert pa.preferred(two(), affinity_of(conversation(2, "c"))) == []


def test_sessions_are_sticky_within_the_slack():
    pa = PrefixAffinity(slack=300)
    s = Affinity(session="user-7")
    assert pa.choose(two(work0=5, work1=0), 10, s) == 1
    assert pa.choose(two(work0=0, work1=300), 10, s) == 1  # sticky, though 0 is idle
    assert pa.choose(two(work0=0, work1=301), 10, s) == 0  # beyond the slack: moves
    assert pa.choose(two(work0=200, work1=0), 10, s) == 0  # and sticks to its new replica
    assert pa.choose(two(work0=200, work1=0), 10, Affinity(session="other")) == 1


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



@pytest.mark.parametrize("seed", range(20))
def test_the_load_table_chooses_what_a_scan_chooses_through_any_changes(seed):
    """The pool's ``LoadTable`` (a heap with stale entries) against the scan over plain
    loads, after each of many random changes: health, calls in flight, work, ties."""
    rng = random.Random(seed)
    n = rng.choice([1, 3, 40])
    loads = [ReplicaLoad(i, healthy=rng.random() < 0.8, max_concurrency=rng.randint(1, 3))
             for i in range(n)]
    table, policy = LoadTable(loads), LeastOutstandingWork()
    for _ in range(600):
        x = loads[rng.randrange(n)]
        x = x._replace(healthy=rng.random() < 0.9, in_flight=rng.randint(0, x.max_concurrency),
                       outstanding_work=rng.choice([0, 5, 5, 17, rng.randrange(100)]))
        loads[x.id] = x
        table.set(x)
        assert policy.choose(table, 1) == policy.choose(list(loads), 1)
        assert table.free == sum(y.can_take(0) for y in loads)
        assert list(table) == loads and len(table._heap) <= 2 * n + 65
