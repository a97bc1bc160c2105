"""Runtime overhead per record on a no-op 3-operator chain (ARCHITECTURE.md §5).

Prints, in one run, µs/record and the ratio to a plain Python loop doing the same
three calls, for: the fused chain, the unfused chain (every operator its own stage,
4 channel hops), the chain with ``replicas: 2`` on the middle stage, and the latency
of one lone record through the unfused pipeline (nothing else in flight).

    python bench/overhead.py            # N = 1,000,000
    python bench/overhead.py --n 100000 # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time

import tailrace as tr

TARGETS = {"fused": "<= 2.5x plain loop", "unfused": "<= 1 us per record per hop",
           "replicas=2": "<= 3 us per record", "lone p50": "<= 100 us"}


def noop(x):
    return x


def plain_loop(n: int) -> float:
    out: list = []
    append = out.append
    t0 = time.perf_counter()
    for x in range(n):
        append(noop(noop(noop(x))))
    dt = time.perf_counter() - t0
    assert len(out) == n
    return dt


def pipeline_run(n: int, *, fuse: bool, replicas: int = 1) -> float:
    out: list = []
    p = tr.Pipeline("overhead")
    s = p.source(range(n)).map(noop, id="a")
    s = s.map(noop, id="b", replicas=replicas) if replicas > 1 else s.map(noop, id="b")
    s.map(noop, id="c").sink(out)
    plan = tr.compile_pipeline(p, fuse=fuse)
    t0 = time.perf_counter()
    result = tr.run(plan)
    dt = time.perf_counter() - t0
    assert len(out) == n and not result.errors, "records lost"
    return dt


def lone_record_latency(m: int) -> list[float]:
    """Send one record, wait until the sink has it, repeat: nothing else in flight."""
    lat: list[float] = []
    arrived = None

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
        arrived.set()

    p = tr.Pipeline("lone")
    p.source(feed()).map(noop, id="a").map(noop, id="b").map(noop, id="c").sink(sink)
    tr.run(tr.compile_pipeline(p, fuse=False))
    return lat


def best_of(k: int, fn, *args, **kw) -> float:
    return min(fn(*args, **kw) for _ in range(k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="records per run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration (best kept)")
    ap.add_argument("--lone", type=int, default=2000, help="lone records to time")
    args = ap.parse_args()
    n = args.n
    print(f"tailrace overhead benchmark: N={n:,}, best of {args.repeat}, "
          f"Python {platform.python_version()} on {platform.machine()}")
    plain = best_of(args.repeat, plain_loop, n)
    rows = [("plain loop (3 calls)", plain, "")]
    rows.append(("fused chain", best_of(args.repeat, pipeline_run, n, fuse=True),
                 TARGETS["fused"]))
    rows.append(("unfused chain (4 hops)", best_of(args.repeat, pipeline_run, n, fuse=False),
                 TARGETS["unfused"]))
    rows.append(("replicas=2 on middle", best_of(args.repeat, pipeline_run, n, fuse=True,
                                                  replicas=2), TARGETS["replicas=2"]))
    print(f"{'configuration':<24} {'us/record':>10} {'x plain':>8}  target")
    for name, dt, target in rows:
        us = dt / n * 1e6
        print(f"{name:<24} {us:>10.3f} {dt / plain:>8.2f}  {target}")
    unfused_us = rows[2][1] / n * 1e6
    print(f"unfused per record per hop: {unfused_us / 4:.3f} us (4 channel hops: "
          f"source->a->b->c->sink); per operator stage: {unfused_us / 3:.3f} us")
    lat = lone_record_latency(args.lone)
    lat.sort()
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(f"lone record, unfused 3 stages, source to sink: p50 {statistics.median(lat):.1f} us, "
          f"p99 {p99:.1f} us over {len(lat)} records (target p50 {TARGETS['lone p50']})")
    print("for scale: SAGE (isage-kernel) local runtime ~1,330 us/record on this shape "
          "with its 10 ms source sleep removed (ARCHITECTURE.md, measured earlier)")


if __name__ == "__main__":
    sys.exit(main())
