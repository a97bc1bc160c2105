"""Admission on Ray: bounded at the source, any record type, and every ticket given back
exactly once whatever ends the record (output, error, drop, a replay after an actor was
killed, an interrupted run)."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.runtime.ray import ActiveRuns
from tailrace.runtime.ray.driver import ADMISSION_WAITS


@pytest.fixture(autouse=True)
def _ray(ray_session):
    return ray_session


class CountingGate(AdmissionGate):
    """A gate that counts, per ticket, how often it was given back, and the most
    records waiting in ``admit`` at once."""

    def __init__(self, n: int) -> None:
        super().__init__(make_policy("fcfs", max_in_flight=n, max_queue=100_000))
        self.issued: list = []
        self.returned: Counter = Counter()
        self.waiting = 0
        self.most_waiting = 0
        self._count = threading.Lock()

    async def admit(self, pipeline, record):
        with self._count:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            t = await super().admit(pipeline, record)
        finally:
            with self._count:
                self.waiting -= 1
        self.issued.append(t)
        return t

    def done(self, ticket, service_seconds=None):
        self.returned[ticket.seq] += 1
        super().done(ticket, service_seconds)

    def assert_balanced(self) -> None:
        deadline = time.monotonic() + 10  # a cancelled waiter's ticket is freed by the gate
        while self.statistics().in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.statistics().in_flight == 0
        assert sorted(self.returned) == sorted(t.seq for t in self.issued)
        assert set(self.returned.values()) <= {1}, "a ticket was given back twice"


def test_records_that_are_not_dicts_run_under_admission():
    gate = CountingGate(4)
    p = tr.Pipeline("plain")
    p.source(range(200)).map(abs, id="work").sink(out := [])
    result = tr.run(p, runtime="ray", admission=gate)
    assert sorted(out) == list(range(200)) and not result.errors
    assert len(gate.issued) == 200
    gate.assert_balanced()


def test_the_source_stops_reading_while_admission_waits_pile_up():
    """At most ``ADMISSION_WAITS`` records wait at the gate: not one task per record."""
    read = [0]

    def source():
        for i in range(1_000):
            read[0] += 1
            yield i

    gate = CountingGate(2)
    p = tr.Pipeline("bounded")
    p.source(source()).map(abs, id="work").sink(out := [])
    tr.run(p, runtime="ray", admission=gate)
    assert len(out) == 1_000 and read[0] == 1_000
    assert ADMISSION_WAITS // 2 < gate.most_waiting <= ADMISSION_WAITS
    gate.assert_balanced()


def test_filter_drops_give_their_tickets_back():
    gate = CountingGate(2)
    p = tr.Pipeline("drops")
    p.source(range(300)).filter(lambda x: x % 10 == 0, id="keep").map(abs, id="work").sink(
        out := [])
    result = tr.run(p, runtime="ray", admission=gate, fuse=False)
    assert sorted(out) == list(range(0, 300, 10))
    assert result.stats["keep"].dropped == 270
    gate.assert_balanced()


def boom(x):
    if x % 5 == 1:
        raise ValueError("odd one")
    return x


def twice(x):
    return [x, -x - 1]


@pytest.mark.slow
def test_tickets_come_back_once_through_errors_drops_and_a_killed_actor(ray_session):
    ray = ray_session
    gate = CountingGate(8)
    got: list = []
    killed: list = []
    runs = ActiveRuns()

    def sink(x):
        got.append(x)
        if len(got) == 150 and not killed:
            [run] = [r for r in runs.describe() if r["pipeline"] == "lifecycle"]
            [(name, _node)] = run["stages"]["fan"]
            ray.kill(ray.get_actor(name), no_restart=False)
            killed.append(name)

    p = tr.Pipeline("lifecycle")
    (p.source(range(400)).map(boom, id="boom").filter(lambda x: x % 5 != 2, id="keep")
     .flat_map(twice, id="fan", queue=64).map(abs, id="after", queue=64).sink(sink))
    result = tr.run(p, runtime="ray", admission=gate, runs=runs)
    assert killed, "the stage actor was never killed"
    assert sorted(got) == sorted(v for x in range(400) if x % 5 not in (1, 2)
                                 for v in (x, x + 1))
    assert sorted(e.input for e in result.errors) == [x for x in range(400) if x % 5 == 1]
    assert len(gate.issued) == 400
    gate.assert_balanced()


def test_an_interrupted_run_gives_every_ticket_back():
    gate = CountingGate(4)
    seen: list = []

    def sink(x):
        seen.append(x)
        if len(seen) == 30:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C

    p = tr.Pipeline("interrupted")
    p.source(range(10_000)).map(abs, id="work").sink(sink)
    with pytest.raises(tr.RunInterrupted):
        tr.run(p, runtime="ray", admission=gate)
    assert 30 <= len(gate.issued) < 10_000
    gate.assert_balanced()
