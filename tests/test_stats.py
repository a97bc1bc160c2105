import pytest

from tailrace.observability import Histogram


def test_histogram_percentiles_are_within_bucket_precision():
    h = Histogram()
    for v in range(1, 10001):
        h.record(float(v))
    s = h.statistics()
    assert s.count == 10000 and s.min == 1 and s.max == 10000
    assert s.p50 == pytest.approx(5000, rel=0.04)
    assert s.p99 == pytest.approx(9900, rel=0.04)
    assert s.mean == pytest.approx(5000.5)


def test_weighted_records_and_merge():
    a, b = Histogram(), Histogram()
    a.record(10.0, n=99)
    b.record(1000.0, n=1)
    a.merge(b)
    s = a.statistics()
    assert s.count == 100 and s.p50 == pytest.approx(10, rel=0.04)
    assert s.max == 1000


def test_empty_and_zero():
    h = Histogram()
    assert h.statistics().count == 0
    h.record(0.0)
    assert h.statistics().p99 == 0.0


def test_a_replicated_stage_reports_its_queue_depth():
    import time

    import tailrace as tr

    def slow(x):
        time.sleep(0.001)
        return x

    p = tr.Pipeline("depth")
    p.source(range(300)).map(slow, id="slow", replicas=2, queue=64).sink(out := [])
    stats = tr.run(p).stats["slow"]
    assert len(out) == 300 and stats.replicas == 2
    assert 0 < stats.max_queue_depth <= 64  # the fast source filled the bounded channel
