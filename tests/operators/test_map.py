import tailrace as tr


def test_map(run):
    out = []
    p = tr.Pipeline("t")
    p.source([1, 2, 3]).map(lambda x: x * 10).sink(out)
    run(p)
    assert out == [10, 20, 30]


def test_map_fields(run):
    p = tr.Pipeline("t")
    p.source([{"q": "a"}, {"q": "b"}]).map(str.upper, input="q", output="Q").sink()
    assert run(p).outputs == [{"q": "a", "Q": "A"}, {"q": "b", "Q": "B"}]


def test_map_field_in_place(run):
    p = tr.Pipeline("t")
    p.source([{"q": " a "}]).map(str.strip, input="q").sink()
    assert run(p).outputs == [{"q": "a"}]


def test_map_async_function(run):
    async def double(x):
        return 2 * x

    p = tr.Pipeline("t")
    p.source(range(5)).map(double, replicas=2).sink()
    assert sorted(run(p).outputs) == [0, 2, 4, 6, 8]


def test_map_batch_contract_calls_fn_with_lists(run):
    calls = []

    def upper_all(xs):
        calls.append(len(xs))
        return [x.upper() for x in xs]

    p = tr.Pipeline("t")
    p.source(list("abcde")).map(upper_all, batch={"max_size": 2}).sink()
    assert run(p).outputs == list("ABCDE")
    assert max(calls) <= 2 and sum(calls) == 5
