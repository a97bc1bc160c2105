"""What an engine pool's dispatch costs per batch as its replica count grows.

Measured: the pool's own work to route one batch, as ``EnginePool._route`` does it for
``least_work``: every replica's load as dispatch sees it (``EnginePool._loads``), the
policy's choice over them (``LoadTable.least`` where the tree has it, else a scan), and
the chosen replica's bookkeeping (``_touch`` where the tree has it). No engine runs.
Median [min - max] of 5 runs. Compare two trees by running it with each on
``PYTHONPATH``:

    python bench/pool_dispatch_cost.py [--replicas 4 64 1024]
    git archive BEFORE src | tar -x -C /tmp/before && \
        PYTHONPATH=/tmp/before/src python bench/pool_dispatch_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from tailrace.engines.pool.dispatch import LeastOutstandingWork
from tailrace.engines.pool.state import ReplicaState


def per_batch_us(replicas: int, batches: int) -> float:
    """The pool's own work to route one batch: each replica's load as dispatch sees it
    (``EnginePool._loads``) and the least-work choice over them."""
    from tailrace.engines.pool import dispatch as dispatch_mod
    from tailrace.engines.pool import pool as pool_mod

    states = [ReplicaState(i, None, 4) for i in range(replicas)]
    for r in states:
        r.healthy, r.transport = True, object()
    holder = pool_mod.EnginePool.__new__(pool_mod.EnginePool)
    holder._replicas = states
    if hasattr(dispatch_mod, "LoadTable"):  # kept current, least work at hand
        holder._load_of = dispatch_mod.LoadTable([r.load() for r in states])
    elif hasattr(pool_mod.EnginePool, "_touch"):  # kept current where state changes
        holder._load_of = [r.load() for r in states]
        holder._free = replicas
    policy = LeastOutstandingWork()
    t0 = time.perf_counter()
    for k in range(batches):
        rid = policy.choose(holder._loads(), 10)
        r = states[rid]
        r.outstanding += 10 + k % 7  # as ``_send`` does, then the pool's bookkeeping
        if hasattr(holder, "_touch"):
            holder._touch(r)
    return (time.perf_counter() - t0) / batches * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 64, 1024])
    args = ap.parse_args()
    for n in args.replicas:
        runs = [per_batch_us(n, max(200, 200_000 // n)) for _ in range(5)]
        print(f"{n:>5} replicas: {statistics.median(runs):8.1f} us per batch "
              f"[{min(runs):.1f} - {max(runs):.1f}]")


if __name__ == "__main__":
    main()
