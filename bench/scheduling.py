"""Scheduling overhead: arrival -> admission decision -> first operator start (local runtime).

Records arrive one at a time (each waits until the previous one left the pipeline, so
nothing queues behind other work) into a 3-stage pipeline, with and without the SLO
admission gate in front. The runtime records, per record, the time from arrival at the
source to the start of the first operator (``stats.scheduling_us``); the gate's share is
included when it is on. Targets: median <= 50 us, p99 <= 500 us.

    python bench/scheduling.py
"""

from __future__ import annotations

import argparse
import asyncio

import tailrace as tr
from tailrace.control import PipelineSLO, make_policy
from tailrace.control.gate import AdmissionGate


def noop(x):
    return x


def measure(n: int, gate: AdmissionGate | None) -> tr.RunStats:
    done = None

    async def arrivals():
        nonlocal done
        done = asyncio.Event()
        for i in range(n):
            done.clear()
            yield {"i": i}
            await done.wait()

    p = tr.Pipeline("sched")
    (p.source(arrivals()).map(noop, id="a").map(noop, id="b").map(noop, id="c")
     .sink(lambda r: done.set()))
    return tr.run(p, fuse=False, admission=gate).stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000)
    args = ap.parse_args()
    print(f"scheduling overhead, local runtime, {args.n} lone records, 3 unfused stages")
    for label, gate in [
        ("no admission", None),
        ("slo admission gate", AdmissionGate(make_policy(
            "slo", max_in_flight=64, slos={"sched": PipelineSLO(2000, "interactive", 1)}))),
    ]:
        s = measure(args.n, gate).scheduling_us
        print(f"  {label:<20} p50 {s.p50:7.1f} us   p99 {s.p99:7.1f} us   "
              f"(targets: p50 <= 50 us, p99 <= 500 us; {s.count} records)")


if __name__ == "__main__":
    main()
