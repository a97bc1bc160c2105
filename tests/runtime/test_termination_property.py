"""Property: on random DAGs (map, filter, flat_map, branch, merge, fan-out, replicas,
tiny queues) every sink receives exactly the multiset a reference interpreter
computes — nothing lost, nothing duplicated — and the run terminates."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tailrace as tr


def f_map(x):
    return (x * 7 + 3) % 101


def f_filter(x):
    return x % 3 != 0


def f_flat(x):
    return [x, x + 1] if x % 2 == 0 else [x]


def f_branch(x):
    return x % 4 < 2


def contract(draw):
    c = {}
    if draw(st.booleans()):
        c["queue"] = draw(st.integers(1, 8))
    mode = draw(st.sampled_from(["inline", "inline", "replicas", "blocking"]))
    if mode == "replicas":
        c["replicas"] = draw(st.integers(2, 3))
    elif mode == "blocking":
        c["blocking"] = True
    return c


def build(draw):
    data = draw(st.lists(st.integers(0, 1000), max_size=300))
    p = tr.Pipeline("prop")
    open_streams = [(p.source(data), list(data))]  # (stream, expected records)
    for _ in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, len(open_streams) - 1))
        s, exp = open_streams[i]
        action = draw(st.sampled_from(["map", "filter", "flat_map", "branch", "merge", "tee"]))
        if action == "map":
            open_streams[i] = (s.map(f_map, **contract(draw)), [f_map(x) for x in exp])
        elif action == "filter":
            open_streams[i] = (s.filter(f_filter, **contract(draw)),
                               [x for x in exp if f_filter(x)])
        elif action == "flat_map":
            open_streams[i] = (s.flat_map(f_flat, **contract(draw)),
                               [y for x in exp for y in f_flat(x)])
        elif action == "branch":
            t, f = s.branch(f_branch, **contract(draw))
            open_streams[i] = (t, [x for x in exp if f_branch(x)])
            open_streams.append((f, [x for x in exp if not f_branch(x)]))
        elif action == "merge" and len(open_streams) > 1:
            j = draw(st.integers(0, len(open_streams) - 1).filter(lambda j: j != i))
            s2, exp2 = open_streams[j]
            merged = s.merge(s2, **contract(draw))
            open_streams[i] = (merged, exp + exp2)
            del open_streams[j]
        elif action == "tee":
            open_streams.append((s.map(f_map), [f_map(x) for x in exp]))
    sinks = []
    for s, exp in open_streams:
        out: list = []
        s.sink(out)
        sinks.append((out, exp))
    return p, sinks


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data())
def test_random_dags_deliver_exact_multisets(run, data):
    p, sinks = build(data.draw)
    result = run(p)
    assert not result.errors
    for out, expected in sinks:
        assert Counter(out) == Counter(expected)
    assert result.stats.records_out == sum(len(e) for _, e in sinks)
    # no channel ever held more records than its bound
    for st_ in result.stats.stages:
        if st_.queue_bound:
            assert st_.max_queue_depth <= st_.queue_bound
