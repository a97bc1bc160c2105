"""Elastic stages on Ray: a stage declared ``replicas: {min: 1, max: 4}`` against the
same stage fixed at 1 and at 4 replicas, on the same records, in one run of this script.

The stage's work is I/O-like (each record waits ``--work-ms`` in a blocking call: what
a stage calling a remote service or a GPU does), so more replicas help even on this
2-core machine; CPU-bound stages cannot speed up past the cores here, and this machine
has no second node, no Ray autoscaler and no resource-limited placement to show. Per
configuration and round: wall time of the run (``tr.run(runtime="ray")`` on warm hosts),
records/s, the replicas the stage ended with, and for the elastic stage the seconds
from the run's start to each scale-out. Median [min-max] over ``--rounds``. The scaling
constants are the defaults (``SCALE_UP_S`` 1 s, tick 0.25 s), so the elastic stage pays
about a second per step before it reaches the fixed-4 rate.

    python bench/autoscale_ray.py                   # 2,000 records of 10 ms, 3 rounds
    python bench/autoscale_ray.py --n 4000 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import tailrace as tr  # noqa: E402

WORK_S = 0.01


def work(x: int) -> int:
    time.sleep(WORK_S)
    return x + 1


def one(n: int, replicas: object) -> tuple[float, int, list[float]]:
    """One run: wall seconds, the stage's replicas at the end, scale-out times (s)."""
    p = tr.Pipeline("autoscale-bench")
    p.source(range(n)).map(work, id="work", replicas=replicas, queue=128).sink(out := [])
    t0 = time.time()
    res = tr.run(p, runtime="ray")
    wall = time.time() - t0
    assert len(out) == n and res.stats.records_out == n, "lost records"
    ups = [t - t0 for t, _, k in res.stats.scale_events if k > 1]
    return wall, res.stats["work"].replicas, ups


def fmt(xs: list[float], unit: str = "") -> str:
    return f"{statistics.median(xs):.2f}{unit} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    global WORK_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--work-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    WORK_S = args.work_ms / 1000
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    print(f"# elastic stage on Ray: {args.n} records x {args.work_ms:g} ms, "
          f"{args.rounds} rounds; {platform.machine()}, {os.cpu_count()} cores, "
          f"Ray {ray.__version__}, {time.strftime('%Y-%m-%d')}")
    one(200, 4)  # warm the hosts (actor starts are not what is measured)
    one(200, {"min": 1, "max": 4})
    configs = [("fixed 1", 1), ("fixed 4", 4), ("elastic 1..4", {"min": 1, "max": 4})]
    rows: dict[str, list] = {name: [] for name, _ in configs}
    for _ in range(args.rounds):
        for name, rep in configs:  # interleaved: drift hits every configuration alike
            rows[name].append(one(args.n, rep))
    ideal = args.n * args.work_ms / 1000
    print(f"{'stage':<14}{'wall s':>22}{'records/s':>24}{'replicas':>10}  scale-outs at (s)")
    for name, _ in configs:
        r = rows[name]
        walls = [w for w, _, _ in r]
        rates = [args.n / w for w in walls]
        ups = r[len(r) // 2][2]
        print(f"{name:<14}{fmt(walls):>22}{fmt(rates):>24}{max(k for _, k, _ in r):>10}  "
              f"{', '.join(f'{u:.1f}' for u in ups) or '-'}")
    print(f"(one replica's floor: {ideal:.1f} s of work; four: {ideal / 4:.1f} s)")
    ray.shutdown()


if __name__ == "__main__":
    main()
