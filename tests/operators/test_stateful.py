import tailrace as tr


def running_sum(state, value):
    total = (state or 0) + value
    return total, total


def test_stateful_pairs(run):
    p = tr.Pipeline("t")
    p.source([("a", 1), ("b", 5), ("a", 2)]).stateful(running_sum).sink()
    assert run(p).outputs == [("a", 1), ("b", 5), ("a", 3)]


def test_stateful_key_field(run):
    p = tr.Pipeline("t")
    recs = [{"u": "x", "n": 1}, {"u": "y", "n": 1}, {"u": "x", "n": 4}]
    p.source(recs).stateful(running_sum, key="u", input="n", output="total").sink()
    assert [r["total"] for r in run(p).outputs] == [1, 1, 5]


def test_state_is_fresh_per_run(run):
    p = tr.Pipeline("t")
    p.source([("k", 1)]).stateful(running_sum).sink()
    assert run(p).outputs == run(p).outputs == [("k", 1)]
