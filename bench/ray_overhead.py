"""Ray runtime overhead: per-record cost of one hop between actors, next to the local
runtime's, and scheduling delay (arrival to first operator start) on Ray.

Chains of no-op stages, unfused, so every stage is its own Ray actor replica and every
edge a push of a micro-batch between processes: 1 stage (source -> a -> sink: 2 hops)
and 3 stages (4 hops). The per-hop cost is the difference divided by the 2 extra hops
and the records, so the fixed costs (placing the run, reading the source, the sink) cancel.
The same is done with the local runtime in the same process. A plain Ray baseline (3
async actors passing batches, no tailrace) gives the floor on this machine. Scheduling
delay is measured with lone records (one in flight at a time) and under load.

    python bench/ray_overhead.py              # N = 200,000, micro-batches of 100 and 1,000
    python bench/ray_overhead.py --n 50000    # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

import tailrace as tr

TARGETS = {"hop": "<= 5 us per record per hop", "sched": "<= 1 ms median (Ray)"}


def noop(x):
    return x


def chain(n: int, stages: int, queue: int) -> tr.Pipeline:
    p = tr.Pipeline(f"chain{stages}")
    s = p.source(range(n), id="src")
    for k in range(stages):
        s = s.map(noop, id=f"op{k}", queue=queue)
    s.sink(out := [], id="out", queue=queue)
    p.out = out  # type: ignore[attr-defined]
    return p


def timed(n: int, stages: int, runtime: str, queue: int) -> tuple[float, object]:
    p = chain(n, stages, queue)
    t0 = time.perf_counter()
    result = tr.run(p, runtime=runtime, fuse=False)
    dt = time.perf_counter() - t0
    assert len(p.out) == n and not result.errors, "records lost"  # type: ignore[attr-defined]
    return dt, result


def per_hop(n: int, runtime: str, queue: int, repeat: int) -> tuple[float, float, object]:
    """(us per record per hop from the 1- vs 3-stage difference, us per record per hop of
    the 3-stage chain with everything included, the last 3-stage result)."""
    t1 = min(timed(n, 1, runtime, queue)[0] for _ in range(repeat))
    runs = [timed(n, 3, runtime, queue) for _ in range(repeat)]
    t3 = min(dt for dt, _ in runs)
    return (t3 - t1) / (2 * n) * 1e6, t3 / (4 * n) * 1e6, runs[-1][1]


def plain_ray(n: int, batch: int) -> float:
    """us per record per hop: 3 async actors, each awaiting the next, batches of ``batch``."""
    import ray

    @ray.remote
    class Hop:
        def __init__(self, nxt=None):
            self.nxt = nxt

        async def push(self, b):
            if self.nxt is not None:
                await self.nxt.push.remote(b)
            return len(b)

    c = Hop.remote()
    b = Hop.remote(c)
    a = Hop.remote(b)
    ray.get(a.push.remote([0]))
    data = list(range(batch))

    async def go() -> float:
        t0 = time.perf_counter()
        inflight: list = []
        for _ in range(n // batch):
            inflight.append(a.push.remote(data))
            if len(inflight) >= 8:
                await inflight.pop(0)
        for r in inflight:
            await r
        return time.perf_counter() - t0

    dt = asyncio.run(go())
    for h in (a, b, c):
        ray.kill(h)
    return dt / ((n // batch) * batch * 3) * 1e6


def plain_round_trip(m: int) -> float:
    """p50 us of one call to an async Ray actor and back (driver -> actor -> driver)."""
    import ray

    @ray.remote
    class Echo:
        async def ping(self, x):
            return x

    a = Echo.remote()
    ray.get(a.ping.remote(0))

    async def go() -> list[float]:
        out = []
        for i in range(m):
            t0 = time.perf_counter()
            await a.ping.remote(i)
            out.append((time.perf_counter() - t0) * 1e6)
        return out

    lat = asyncio.run(go())
    ray.kill(a)
    return statistics.median(lat)


def lone_records(m: int) -> tuple[list[float], object]:
    """Source-to-sink latency of lone records (one in flight) through 3 actor stages."""
    lat: list[float] = []
    arrived: asyncio.Event | None = None

    async def feed():
        nonlocal arrived
        arrived = asyncio.Event()
        for i in range(m):
            arrived.clear()
            t0 = time.perf_counter()
            yield i
            await arrived.wait()
            lat.append((time.perf_counter() - t0) * 1e6)

    def sink(x):
        assert arrived is not None
        arrived.set()

    p = tr.Pipeline("lone")
    p.source(feed()).map(noop, id="a").map(noop, id="b").map(noop, id="c").sink(sink)
    result = tr.run(p, runtime="ray", fuse=False)
    return lat, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="records per run")
    ap.add_argument("--batch", type=int, nargs="+", default=[100, 1000],
                    help="records per push between actors (each size measured in turn)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per configuration (best kept)")
    ap.add_argument("--lone", type=int, default=300, help="lone records to time")
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    n = args.n
    print(f"tailrace Ray overhead benchmark: N={n:,}, best of {args.repeat}, "
          f"{os.cpu_count()} CPUs, Ray {ray.__version__}, Python {platform.python_version()} "
          f"on {platform.machine()}")
    print(f"{'batch':>6}  {'configuration':<34} {'us/record/hop':>14}  target")
    res = None
    for batch in args.batch:
        queue = 8 * batch  # a push is an eighth of the edge's bound
        timed(1000, 3, "ray", queue)  # start the actors outside the timing
        hop_ray, all_ray, res = per_hop(n, "ray", queue, args.repeat)
        hop_local, all_local, _ = per_hop(n, "local", queue, args.repeat)
        floor = plain_ray(n, batch)
        for name, v, note in [
                ("ray: per extra hop (3 vs 1 stage)", f"{hop_ray:.2f}", TARGETS["hop"]),
                ("ray: 3-stage chain, all included", f"{all_ray:.2f}", ""),
                ("local: per extra hop", f"{hop_local:.3f}", ""),
                ("local: 3-stage chain, all included", f"{all_local:.3f}", ""),
                ("plain Ray, 3 async actors", f"{floor:.2f}", "(no tailrace: the floor here)")]:
            print(f"{batch:>6}  {name:<34} {v:>14}  {note}")
    sched = res.stats.scheduling_us  # type: ignore[attr-defined]
    print(f"scheduling delay under load (3-stage run, last batch size): p50 "
          f"{sched.p50 / 1000:.2f} ms, p99 {sched.p99 / 1000:.2f} ms (source read -> first "
          "operator start, queueing behind a full edge window included)")
    rtt = plain_round_trip(args.lone)
    lat, lone = lone_records(args.lone)
    lat.sort()
    s = lone.stats.scheduling_us  # type: ignore[attr-defined]
    print(f"scheduling delay, lone records: p50 {s.p50 / 1000:.2f} ms, p99 {s.p99 / 1000:.2f} "
          f"ms over {s.count} records (target {TARGETS['sched']}); for scale, a plain Ray "
          f"actor call round trip here: p50 {rtt / 1000:.2f} ms")
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(f"lone record source to sink through 3 actor stages: p50 "
          f"{statistics.median(lat) / 1000:.2f} ms, p99 {p99 / 1000:.2f} ms")
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
