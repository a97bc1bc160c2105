"""Scheduling delay of one admission through the cluster's gate actor (``ClusterGate``),
next to the in-process ``AdmissionGate`` and a bare async-actor round trip.

A lone request at a time (capacity always free): the delay is ``await gate.admit(...)``
from call to ticket; the ticket then goes straight back (``done``, fire and forget for the
cluster gate: its submission, and the actor's work on it, fall outside the timing but
share the actor and the CPUs with the next admission). The bare round trip is
``await actor.ping.remote()`` on the same gate actor, once with no arguments and once
with ``admit``'s arguments and a reply of its size (what Ray's serialization alone adds),
so the cluster gate's own cost is the difference. The four ways run interleaved in
rounds, ``--runs`` rounds of ``--n`` requests each; per way: median [min - max] over the
rounds of each round's p50 and p99.

    python bench/gate_actor.py               # n = 2,000, 5 runs
    python bench/gate_actor.py --n 500 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

import ray

from tailrace.control import AdmissionGate, make_policy
from tailrace.runtime.ray.gate import ClusterGate


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def lone(n: int, one) -> list[float]:
    """``n`` delays of ``one()``, which returns the seconds it measured."""
    return [await one() for _ in range(n)]


async def main(n: int, runs: int) -> None:
    cluster = ClusterGate("fcfs", name="bench", max_in_flight=8)
    local = AdmissionGate(make_policy("fcfs", max_in_flight=8))
    record = {"text": "a question of some forty characters ok?"}

    async def via_cluster():
        t0 = time.perf_counter()
        ticket = await cluster.admit("qa", record)
        took = time.perf_counter() - t0
        cluster.done(ticket)
        return took

    async def via_local():
        t0 = time.perf_counter()
        ticket = await local.admit("qa", record)
        took = time.perf_counter() - t0
        local.done(ticket)
        return took

    async def bare():
        t0 = time.perf_counter()
        await cluster.actor.ping.remote()
        return time.perf_counter() - t0

    async def bare_args():  # admit's arguments, and a reply of its size
        t0 = time.perf_counter()
        await cluster.actor.ping.remote("0123456789ab-0", "qa", 10, None)
        return time.perf_counter() - t0

    ways = {"in-process AdmissionGate": via_local, "bare actor round trip": bare,
            "  with admit's arguments": bare_args, "ClusterGate (gate actor)": via_cluster}
    for one in ways.values():  # warm up
        await lone(200, one)
    p50s: dict[str, list[float]] = {k: [] for k in ways}
    p99s: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(runs):
        for name, one in ways.items():
            xs = await lone(n, one)
            p50s[name].append(pct(xs, 0.5) * 1e3)
            p99s[name].append(pct(xs, 0.99) * 1e3)
    cluster.shutdown()
    local.close()

    def show(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} [{min(xs):.3f} - {max(xs):.3f}]"

    print(f"{platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, Ray {ray.__version__}; n = {n}, {runs} runs; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'way':28} {'p50 ms':>26} {'p99 ms':>26}")
    for name in ways:
        print(f"{name:28} {show(p50s[name]):>26} {show(p99s[name]):>26}")
    for base in ("bare actor round trip", "  with admit's arguments"):
        extra = [c - b for c, b in zip(p50s["ClusterGate (gate actor)"], p50s[base],
                                       strict=True)]
        print(f"ClusterGate p50 over {base.strip()}: {show(extra)} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2_000, help="requests per way and run")
    ap.add_argument("--runs", type=int, default=5, help="rounds (each way once a round)")
    a = ap.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        asyncio.run(main(a.n, a.runs))
    finally:
        ray.shutdown()
