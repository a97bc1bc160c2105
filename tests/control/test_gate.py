"""Admission at pipeline ingress in the local runtime: the gate shared by pipelines."""

import threading
import time

import tailrace as tr
from tailrace.control import make_policy
from tailrace.control.gate import AdmissionGate
from tailrace.request import REQUEST


class Concurrency:
    """Counts records between the first and last stage (what admission bounds)."""

    def __init__(self):
        self.now = self.peak = 0
        self.lock = threading.Lock()

    def enter(self, r):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(0.002)  # hold the slot briefly so overlap is possible
        return r

    def leave(self, r):
        with self.lock:
            self.now -= 1
        return r


def pipeline(name, c):
    p = tr.Pipeline(name)
    (p.source(fields=["q"]).map(c.enter, id="work", replicas=4)
     .map(c.leave, id="done").sink())
    return p


def test_fcfs_limit_bounds_in_flight_and_loses_nothing():
    c = Concurrency()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=100))
    result = tr.run(pipeline("qa", c), input=[{"q": str(i)} for i in range(20)],
                    admission=gate)
    assert sorted(r["q"] for r in result.outputs) == sorted(str(i) for i in range(20))
    assert all(REQUEST not in r for r in result.outputs)  # the ticket left with it
    assert c.peak <= 2
    stats = gate.statistics()
    assert stats.admitted == 20 and stats.in_flight == 0
    assert result.stats.scheduling_us.count == 20


def test_rejections_are_error_records():
    c = Concurrency()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=1, max_queue=0))
    result = tr.run(pipeline("qa", c), input=[{"q": str(i)} for i in range(10)],
                    admission=gate)
    assert len(result.outputs) + len(result.errors) == 10
    assert result.errors, "a queue of 0 behind 1 slot must reject some of 10 arrivals"
    err = result.errors[0]
    assert (err.stage, err.error) == ("admission", "AdmissionRejected")
    assert err.to_dict()["input"] == {"q": err.input["q"]}
    assert gate.statistics().rejected == {"queue_full": len(result.errors)}


def test_simultaneous_admits_everything():
    c = Concurrency()
    gate = AdmissionGate(make_policy("simultaneous"))
    result = tr.run(pipeline("qa", c), input=[{"q": str(i)} for i in range(10)],
                    admission=gate)
    assert len(result.outputs) == 10 and not result.errors


def test_two_pipelines_share_one_gate():
    c = Concurrency()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2, max_queue=100))
    results = {}

    def go(name):
        results[name] = tr.run(pipeline(name, c), input=[{"q": str(i)} for i in range(10)],
                               admission=gate)

    threads = [threading.Thread(target=go, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(len(results[n].outputs) == 10 for n in ("a", "b"))
    assert c.peak <= 2  # the limit held across both pipelines
    assert gate.statistics().admitted == 20
