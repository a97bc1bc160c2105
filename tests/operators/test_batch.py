import tailrace as tr


def test_batch(run):
    p = tr.Pipeline("t")
    p.source([1, 2, 3, 4, 5]).batch(2).sink()
    assert run(p).outputs == [[1, 2], [3, 4], [5]]


def test_batch_output_field(run):
    p = tr.Pipeline("t")
    p.source([{"a": 1}, {"a": 2}]).batch(8, max_wait_ms=10_000, output="items").sink()
    # the partial batch is flushed at end of input, not after the 10 s wait
    assert run(p).outputs == [{"items": [{"a": 1}, {"a": 2}]}]
