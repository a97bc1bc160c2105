"""Ray runtime overhead: per-record cost of one hop between actors, next to plain Ray
actors doing the same work, and scheduling delay (arrival to first operator start) on Ray.

Chains of no-op stages, unfused, so every stage is its own Ray actor replica and every
edge a push of a micro-batch between processes: 1 stage (source -> a -> sink: 2 hops)
and 3 stages (4 hops). The per-hop cost is the difference divided by the 2 extra hops
and the records, so the fixed costs (placing the run, reading the source, the sink) cancel.

The plain Ray floor is computed the same way: chains of 1 and 3 async actors, each
awaiting the next (a push and its reply, as a tailrace push and its acknowledgement),
fed by the driver with the same push size and the same number of pushes in flight
(tailrace's ``PUSHES_IN_FLIGHT``), per extra hop = (3-actor time - 1-actor time) / (2 N).
The two sides run interleaved (tailrace, plain, plain, tailrace, ...) in one process.

Push size: the Ray runtime sizes a push from the consuming stage's bound
(``queue // PUSHES_IN_FLIGHT``), capped at ``MAX_PUSH`` records; both are read from
``tailrace.compiler`` and the size actually used is read back from the
compiled plan. A requested size above the cap cannot be measured: it is refused.

    python bench/ray_overhead.py                  # N = 200,000, pushes of 100 and MAX_PUSH
    python bench/ray_overhead.py --n 50000 --repeat 2   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections import deque

import tailrace as tr
from tailrace.compiler import MAX_PUSH, PUSHES_IN_FLIGHT

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


def push_sizes(stages: int, queue: int) -> set[int]:
    """Records per push into each actor stage of the compiled (unfused) chain."""
    plan = tr.compile_pipeline(chain(1, stages, queue), fuse=False)
    return {s.execution.push for s in plan.stages
            if s.ops[0].op.kind not in ("source", "sink")}


def timed(n: int, stages: int, runtime: str, queue: int) -> tuple[float, object]:
    p = chain(n, stages, queue)
    t0 = time.perf_counter()
    result = tr.run(p, runtime=runtime, fuse=False)
    dt = time.perf_counter() - t0
    assert len(p.out) == n and not result.errors, "records lost"  # type: ignore[attr-defined]
    return dt, result


class PlainChain:
    """``stages`` async Ray actors in a chain, each awaiting the next; no tailrace."""

    def __init__(self, stages: int) -> None:
        import ray

        @ray.remote
        class Hop:
            def __init__(self, nxt=None):
                self.nxt = nxt
                self.records = 0

            async def push(self, b):
                if self.nxt is not None:
                    await self.nxt.push.remote(b)
                else:
                    self.records += len(b)  # the end of the chain counts, like a sink
                return len(b)

            def count(self):
                return self.records

        self.actors: list = []
        nxt = None
        for _ in range(stages):
            nxt = Hop.remote(nxt)
            self.actors.append(nxt)
        self.head = nxt
        ray.get(self.head.push.remote([]))  # every actor started, outside the timing

    def timed(self, n: int, batch: int) -> float:
        """Seconds to push range(n) in pushes of ``batch``, PUSHES_IN_FLIGHT at a time."""
        import ray

        data = list(range(n))
        before = ray.get(self.actors[0].count.remote())

        async def go() -> float:
            t0 = time.perf_counter()
            inflight: deque = deque()
            for i in range(0, n, batch):
                if len(inflight) >= PUSHES_IN_FLIGHT:
                    await inflight.popleft()
                inflight.append(self.head.push.remote(data[i:i + batch]))
            for r in inflight:
                await r
            return time.perf_counter() - t0

        dt = asyncio.run(go())
        assert ray.get(self.actors[0].count.remote()) - before == n, "records lost"
        return dt

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


def spread(xs: list[float], digits: int) -> str:
    """``median [min - max]`` of xs."""
    return (f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f} - "
            f"{max(xs):.{digits}f}]")


def measure(n: int, batch: int, repeat: int) -> dict[str, list[float]]:
    """Per-hop figures (us per record per extra hop), one per repeat, both sides
    interleaved, plus the local runtime at the same bound."""
    queue = PUSHES_IN_FLIGHT * batch
    timed(1000, 3, "ray", queue)  # start the tailrace hosts outside the timing
    plain = {k: PlainChain(k) for k in (1, 3)}
    out: dict[str, list[float]] = {"tailrace": [], "plain": [], "local": []}
    try:
        for r in range(repeat):
            order = ("tailrace", "plain") if r % 2 == 0 else ("plain", "tailrace")
            for side in order:
                if side == "tailrace":
                    t1 = timed(n, 1, "ray", queue)[0]
                    t3 = timed(n, 3, "ray", queue)[0]
                else:
                    t1 = plain[1].timed(n, batch)
                    t3 = plain[3].timed(n, batch)
                out[side].append((t3 - t1) / (2 * n) * 1e6)
            t1 = timed(n, 1, "local", queue)[0]
            t3 = timed(n, 3, "local", queue)[0]
            out["local"].append((t3 - t1) / (2 * n) * 1e6)
    finally:
        for c in plain.values():
            c.close()
    return out


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
    ap.add_argument("--batch", type=int, nargs="+", default=[100, MAX_PUSH],
                    help=f"records per push between actors, each measured in turn "
                         f"(at most MAX_PUSH = {MAX_PUSH})")
    ap.add_argument("--repeat", type=int, default=3,
                    help="interleaved repeats per push size (median [min - max] shown)")
    ap.add_argument("--lone", type=int, default=300, help="lone records to time")
    args = ap.parse_args()
    too_big = [b for b in args.batch if not 1 <= b <= MAX_PUSH]
    if too_big:
        ap.error(f"--batch {too_big}: the Ray runtime caps a push at MAX_PUSH = {MAX_PUSH} "
                 "records (tailrace.runtime.ray.driver), so larger pushes cannot be measured")
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    n = args.n
    print(f"tailrace Ray overhead benchmark: N={n:,} no-op records per run, {args.repeat} "
          f"interleaved repeats, {os.cpu_count()} CPUs, Ray {ray.__version__}, Python "
          f"{platform.python_version()} on {platform.machine()}")
    print(f"push size = a stage's bound // PUSHES_IN_FLIGHT ({PUSHES_IN_FLIGHT}), capped at "
          f"MAX_PUSH = {MAX_PUSH} records (read from tailrace.compiler); plain Ray "
          f"gets the same pushes, {PUSHES_IN_FLIGHT} in flight")
    print("us per record per extra hop = (3-stage time - 1-stage time) / (2 x N); "
          "median [min - max] over the repeats")
    print(f"{'push':>5}  {'tailrace on Ray':>24}  {'plain Ray actors':>24}  {'ratio':>5}  "
          f"{'local runtime':>24}")
    res = None
    for batch in args.batch:
        queue = PUSHES_IN_FLIGHT * batch
        used = push_sizes(1, queue) | push_sizes(3, queue)
        if used != {batch}:
            raise SystemExit(f"ray_overhead: asked for pushes of {batch}, the compiled plan "
                             f"pushes {sorted(used)}: the runtime's sizing changed")
        got = measure(n, batch, args.repeat)
        ratio = statistics.median(got["tailrace"]) / statistics.median(got["plain"])
        print(f"{batch:>5}  {spread(got['tailrace'], 2):>24}  {spread(got['plain'], 2):>24}  "
              f"{ratio:>5.2f}  {spread(got['local'], 3):>24}", flush=True)
    print(f"target: tailrace on Ray {TARGETS['hop']}; pushes larger than {MAX_PUSH} records "
          "are not measured (the runtime never makes them)")
    res = timed(n, 3, "ray", PUSHES_IN_FLIGHT * args.batch[-1])[1]
    sched = res.stats.scheduling_us  # type: ignore[attr-defined]
    print(f"scheduling delay under load (3-stage run, pushes of {args.batch[-1]}): p50 "
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
