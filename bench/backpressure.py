"""Memory under backpressure: a fast source into a slow sink (ARCHITECTURE.md §5).

Each size runs in a fresh process, so peak RSS (ru_maxrss) belongs to that run alone.
Bounded channels mean the source is throttled by the sink: peak RSS must not grow
with the number of records (target: < 10% from 1e5 to 1e6), and no channel may ever
hold more records than its bound.

    python bench/backpressure.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys


def child(n: int, queue: int) -> None:
    import tailrace as tr

    def records():  # a generator: the input itself takes no memory
        for i in range(n):
            yield {"id": i, "text": f"record {i} " + "x" * 200}

    digest = hashlib.blake2b()

    def slow_sink(rec):  # ~10x the cost of everything upstream
        for _ in range(4):
            digest.update(json.dumps(rec).encode())

    p = tr.Pipeline("backpressure")
    (p.source(records()).map(lambda r: {**r, "n": len(r["text"])}, id="enrich", queue=queue)
     .sink(slow_sink, id="slow_sink", queue=queue))
    result = tr.run(p, fuse=False)
    depth = {s.stage: (s.max_queue_depth, s.queue_bound) for s in result.stats.stages
             if s.queue_bound}
    print(json.dumps({"n": n, "out": result.stats.records_out, "wall_s": result.stats.wall_s,
                      "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "depth": depth}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--queue", type=int, default=1024, help="channel bound (records)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.queue)
    print(f"tailrace backpressure benchmark: fast source -> slow sink, queue={args.queue}")
    print(f"{'records':>10} {'out':>10} {'wall s':>8} {'peak RSS MB':>12}  max depth/bound")
    runs = []
    for n in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--child", str(n), "--queue",
                              str(args.queue)], check=True, capture_output=True, text=True)
        r = json.loads(out.stdout)
        runs.append(r)
        depth = ", ".join(f"{k} {d}/{b}" for k, (d, b) in r["depth"].items())
        print(f"{n:>10,} {r['out']:>10,} {r['wall_s']:>8.2f} {r['peak_rss_kb'] / 1024:>12.1f}"
              f"  {depth}")
        assert r["out"] == n, "records lost"
        assert all(d <= b for d, b in r["depth"].values()), "a channel exceeded its bound"
    growth = runs[-1]["peak_rss_kb"] / runs[0]["peak_rss_kb"] - 1
    print(f"peak RSS growth {args.sizes[0]:,} -> {args.sizes[-1]:,} records: {growth:+.1%} "
          f"(target < 10%); every channel stayed within its bound")


if __name__ == "__main__":
    sys.exit(main())
