import tailrace as tr


def test_merge(run):
    p = tr.Pipeline("t")
    a = p.source([1, 2], id="a")
    b = p.source([3], id="b")
    p.merge(a, b).sink()
    assert sorted(run(p).outputs) == [1, 2, 3]


def test_fan_out_gives_each_consumer_every_record(run):
    x, y = [], []
    p = tr.Pipeline("t")
    s = p.source(range(3))
    s.map(lambda v: v + 10).sink(x)
    s.sink(y)
    run(p)
    assert x == [10, 11, 12] and y == [0, 1, 2]
