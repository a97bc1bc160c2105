import tailrace as tr


def test_key_by(run):
    p = tr.Pipeline("t")
    p.source(["ab", "c"]).key_by(len).sink()
    assert run(p).outputs == [(2, "ab"), (1, "c")]
