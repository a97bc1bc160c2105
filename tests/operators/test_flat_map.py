import tailrace as tr


def test_flat_map(run):
    p = tr.Pipeline("t")
    p.source(["a b", "", "c"]).flat_map(str.split).sink()
    assert run(p).outputs == ["a", "b", "c"]


def test_flat_map_fields(run):
    p = tr.Pipeline("t")
    p.source([{"id": 1, "s": "x y"}]).flat_map(str.split, input="s", output="w").sink()
    assert run(p).outputs == [{"id": 1, "s": "x y", "w": "x"}, {"id": 1, "s": "x y", "w": "y"}]
