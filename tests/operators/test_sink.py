import tailrace as tr


def test_sink_list_and_callable(run):
    seen = []
    p = tr.Pipeline("t")
    s = p.source([1, 2])
    s.sink(seen.append)
    out = []
    s.sink(out)
    run(p)
    assert seen == out == [1, 2]


def test_sink_bound_at_run_time(run):
    p = tr.Pipeline("t")
    p.source(range(3)).sink()
    got = []
    result = run(p, output=got)
    assert got == [0, 1, 2] and result.outputs is None


def test_raising_sink_gives_error_records(run):
    def picky(x):
        if x == 1:
            raise OSError("disk full")

    p = tr.Pipeline("t")
    p.source([0, 1, 2]).sink(picky, id="store")
    result = run(p)
    assert [(e.stage, e.input, e.error) for e in result.errors] == [("store", 1, "OSError")]
    assert result.stats.records_out == 2
