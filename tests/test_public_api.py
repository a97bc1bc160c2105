import tailrace as tr


def test_exported_names_are_pinned():
    assert sorted(tr.__all__) == [
        "BatchSpec", "Contract", "ErrorRecord", "InputError", "Operator", "Pipeline", "Plan",
        "PlanError", "RunInterrupted", "RunResult", "RunStats", "StageSpec", "StageStats",
        "StageTimeout", "Stream", "TailraceError", "compile_pipeline", "format_stats", "run",
    ]
    for name in tr.__all__:
        assert hasattr(tr, name)


def test_architecture_example():
    p = tr.Pipeline("double")
    p.source(range(10)).map(lambda x: 2 * x).sink(out := [])
    result = tr.run(p)
    assert out == [2 * x for x in range(10)]
    assert result.stats["map"].records_out == 10
    assert result.stats.records_in == result.stats.records_out == 10
