"""Memory under backpressure: a fast source into a slow sink (ARCHITECTURE.md §5).

Each size runs in a fresh process, so peak RSS (ru_maxrss) belongs to that run alone.
Bounded channels mean the source is throttled by the sink: peak RSS must not grow
with the number of records (target: < 10% from 1e5 to 1e6), and no channel may ever
hold more records than its bound. Every size also runs with an admission gate in front
(`fcfs`, 64 in flight): each record waits for a ticket, which must stay flat in memory
and linear in time (microseconds per record printed for both).

    python bench/backpressure.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys


def child(n: int, queue: int, admission: str | None) -> None:
    import tailrace as tr
    from tailrace.control import AdmissionGate, make_policy

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
    gate = None
    if admission:
        gate = AdmissionGate(make_policy(admission, max_in_flight=64, max_queue=1 << 30))
    result = tr.run(p, fuse=False, admission=gate)
    if gate is not None:
        assert gate.statistics().in_flight == 0, "tickets leaked"
        gate.close()
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
    ap.add_argument("--admission", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.queue, args.admission)
    print(f"tailrace backpressure benchmark: fast source -> slow sink, queue={args.queue}")
    for admission in (None, "fcfs"):
        label = "no admission" if admission is None else f"admission {admission}, 64 in flight"
        print(f"\n{label}")
        print(f"{'records':>10} {'out':>10} {'wall s':>8} {'us/record':>10} {'peak RSS MB':>12}"
              "  max depth/bound")
        runs = []
        for n in args.sizes:
            cmd = [sys.executable, __file__, "--child", str(n), "--queue", str(args.queue)]
            if admission:
                cmd += ["--admission", admission]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            r = json.loads(out.stdout)
            runs.append(r)
            depth = ", ".join(f"{k} {d}/{b}" for k, (d, b) in r["depth"].items())
            print(f"{n:>10,} {r['out']:>10,} {r['wall_s']:>8.2f} {r['wall_s'] / n * 1e6:>10.2f}"
                  f" {r['peak_rss_kb'] / 1024:>12.1f}  {depth}")
            assert r["out"] == n, "records lost"
            assert all(d <= b for d, b in r["depth"].values()), "a channel exceeded its bound"
        growth = runs[-1]["peak_rss_kb"] / runs[0]["peak_rss_kb"] - 1
        per = [r["wall_s"] / n for r, n in zip(runs, args.sizes, strict=True)]
        print(f"peak RSS growth {args.sizes[0]:,} -> {args.sizes[-1]:,} records: {growth:+.1%} "
              f"(target < 10%); time per record {per[-1] / per[0]:.2f}x (1.00x = linear); "
              "every channel stayed within its bound")


if __name__ == "__main__":
    sys.exit(main())
