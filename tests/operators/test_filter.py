import tailrace as tr


def test_filter(run):
    p = tr.Pipeline("t")
    p.source(range(10)).filter(lambda x: x % 2).sink()
    assert run(p).outputs == [1, 3, 5, 7, 9]


def test_filter_field(run):
    p = tr.Pipeline("t")
    p.source([{"n": 1}, {"n": 0}]).filter(bool, input="n").sink()
    assert run(p).outputs == [{"n": 1}]
