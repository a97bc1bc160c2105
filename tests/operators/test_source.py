import tailrace as tr


def test_source_bound_at_run_time(run):
    p = tr.Pipeline("t")
    p.source().map(abs).sink()
    assert run(p, input=[-1, -2]).outputs == [1, 2]


def test_async_source(run):
    async def gen():
        for i in range(3):
            yield i

    p = tr.Pipeline("t")
    p.source(gen()).sink()
    assert run(p).outputs == [0, 1, 2]


def test_failing_source_reports_error_and_keeps_what_it_read(run):
    def gen():
        yield 1
        raise ValueError("corrupt input")

    p = tr.Pipeline("t")
    p.source(gen()).sink()
    result = run(p)
    assert result.outputs == [1]
    assert [(e.stage, e.error, e.message) for e in result.errors] == [
        ("source", "ValueError", "corrupt input")]
