"""Batcher: size, wait and token-budget triggers on a virtual clock; FIFO; oversize items."""

from __future__ import annotations

import pytest

from tailrace.engines.pool.batching import Batcher


def test_a_full_batch_is_ready_at_once():
    b = Batcher(max_batch_size=3, max_wait_ms=10)
    for i in range(3):
        assert not b.ready(now=0.0)
        b.add(i, tokens=1, now=0.0)
    assert b.ready(now=0.0)
    assert b.take(now=0.0) == [0, 1, 2]
    assert len(b) == 0 and not b.ready(now=1.0) and b.next_deadline() is None


def test_a_partial_batch_waits_for_its_oldest_item_deadline():
    b = Batcher(max_batch_size=8, max_wait_ms=5)
    b.add("a", tokens=1, now=1.000)
    b.add("b", tokens=1, now=1.004)
    assert b.next_deadline() == pytest.approx(1.005)
    assert not b.ready(now=1.0049)
    assert b.ready(now=1.005)
    assert b.take(now=1.005) == ["a", "b"]


def test_zero_wait_sends_at_once():
    b = Batcher(max_batch_size=8, max_wait_ms=0)
    b.add("a", tokens=1, now=2.0)
    assert b.ready(now=2.0) and b.take(now=2.0) == ["a"]


def test_the_token_budget_splits_batches_and_triggers_them():
    b = Batcher(max_batch_size=8, max_wait_ms=100, max_batch_tokens=100)
    for name, tokens in [("a", 40), ("b", 40), ("c", 40)]:
        b.add(name, tokens, now=0.0)
    assert b.ready(now=0.0)  # 120 queued tokens fill a batch before the wait is over
    assert b.take(now=0.0) == ["a", "b"]
    assert not b.ready(now=0.0) and b.statistics().queued_tokens == 40
    assert b.take(now=0.1) == ["c"]


def test_an_item_over_the_budget_goes_alone_instead_of_getting_stuck():
    b = Batcher(max_batch_size=8, max_wait_ms=1, max_batch_tokens=100)
    b.add("small", 10, now=0.0)
    b.add("huge", 500, now=0.0)
    b.add("tail", 10, now=0.0)
    assert b.take(now=0.0) == ["small"]
    assert b.take(now=0.0) == ["huge"]
    assert b.take(now=0.0) == ["tail"]


def test_batches_keep_arrival_order_and_never_exceed_the_size():
    b = Batcher(max_batch_size=4, max_wait_ms=1)
    for i in range(10):
        b.add(i, tokens=1, now=i * 1e-4)
    batches = []
    while len(b):
        batches.append(b.take(now=1.0))
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    stats = b.statistics()
    assert (stats.batches, stats.items, stats.queued) == (3, 10, 0)
    assert stats.mean_batch_size == pytest.approx(10 / 3)


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1, got 0"),
    ({"max_wait_ms": -1}, "max_wait_ms must be >= 0, got -1"),
    ({"max_batch_tokens": 0}, "max_batch_tokens must be >= 1 or None, got 0"),
])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Batcher(**kw)


def test_drain_empties_the_queue_without_counting_a_batch():
    b = Batcher(max_batch_size=4, max_wait_ms=1)
    b.add("a", 1, now=0.0)
    b.add("b", 1, now=0.0)
    assert b.drain() == ["a", "b"]
    assert len(b) == 0 and b.statistics().batches == 0 and b.next_deadline() is None


def test_urgent_items_go_first_then_by_deadline_then_arrival():
    b = Batcher(max_batch_size=2, max_wait_ms=5)
    b.add("batch-1", tokens=10, now=0.0)
    b.add("batch-2", tokens=10, now=0.001)
    b.add("late", tokens=10, now=0.002, priority=2, deadline=9.0)
    b.add("soon", tokens=10, now=0.003, priority=2, deadline=5.0)
    assert b.next_deadline() == 0.005  # the oldest item's wait still bounds the batch
    assert b.take(now=0.003) == ["soon", "late"]
    assert b.take(now=0.003) == ["batch-1", "batch-2"]  # unranked: first come, first served
    assert len(b) == 0 and b.next_deadline() is None


def test_a_batch_holds_one_class():
    """Its answers come back together: an urgent item never shares a batch (and its wait
    for the batch's end) with a less urgent one; deadlines within a class do mix."""
    b = Batcher(max_batch_size=4, max_wait_ms=0)
    b.add("bulk-1", tokens=10, now=0.0)
    b.add("chat-1", tokens=10, now=0.001, priority=2, deadline=9.0)
    b.add("bulk-2", tokens=10, now=0.002)
    b.add("chat-2", tokens=10, now=0.003, priority=2, deadline=5.0)
    assert b.take(now=0.003) == ["chat-2", "chat-1"]
    assert b.take(now=0.003) == ["bulk-1", "bulk-2"]
    b.add("low", tokens=1, now=1.0, priority=-1)
    b.add("plain", tokens=1, now=1.0)
    assert b.take(now=1.0) == ["plain"] and b.take(now=1.0) == ["low"]
    assert b.statistics().batches == 4


def test_without_classes_the_order_is_unchanged():
    b = Batcher(max_batch_size=3, max_wait_ms=0)
    for i in range(3):
        b.add(i, tokens=1, now=float(i), priority=0)
    assert b.take(now=3.0) == [0, 1, 2]
