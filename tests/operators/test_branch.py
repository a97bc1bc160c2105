import tailrace as tr


def test_branch(run):
    big, small = [], []
    p = tr.Pipeline("t")
    trues, falses = p.source(range(6)).branch(lambda x: x >= 3)
    trues.sink(big)
    falses.sink(small)
    run(p)
    assert big == [3, 4, 5]
    assert small == [0, 1, 2]


def test_branch_field(run):
    p = tr.Pipeline("t")
    t, f = p.source([{"n": 5}, {"n": 1}]).branch(lambda n: n > 2, input="n")
    t.map(lambda r: {**r, "big": True}).merge(f).sink()
    assert sorted(run(p).outputs, key=lambda r: r["n"]) == [{"n": 1}, {"n": 5, "big": True}]
