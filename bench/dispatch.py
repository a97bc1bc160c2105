"""Dispatch under skewed request sizes: least-outstanding-work vs round-robin, 4 replicas.

A discrete-event simulation on a virtual clock (no sleeping; deterministic per seed).
Calls arrive as a Poisson stream; their sizes (predicted tokens) are lognormal with a heavy
tail. A replica decodes up to ``--lanes`` calls at once and shares its throughput among
them the way batched decoding does: n calls together run at ``rate * n / (1 + beta (n-1))``
tokens/s in all (4 calls: 1.9x one call, as measured for llama.cpp here), so service time
is proportional to tokens. The pool lets a replica hold ``max_in_flight`` calls (beyond its
lanes they queue at the replica, first come first served); a call every replica refuses
waits in the pool's queue. Both policies are the real ones from ``tailrace.engines.pool``; they
see what the pool sees: predicted tokens of the calls in flight, not their progress.

    python bench/dispatch.py [--calls 5000] [--loads 0.8 0.9 inf] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
from collections import deque

from tailrace.engines.pool.dispatch import ReplicaLoad, make_dispatch

GAIN_4 = 1.9  # throughput of 4 concurrent sequences relative to one (ARCHITECTURE.md §4)


def workload(n: int, seed: int) -> list[int]:
    """``n`` call sizes in tokens: lognormal (median ~150, p99 ~3,000), at most 20,000."""
    rng = random.Random(seed)
    return [min(int(rng.lognormvariate(5.0, 1.3)) + 8, 20_000) for _ in range(n)]


class Replica:
    """Calls in flight on one simulated replica: running (remaining tokens) and queued."""

    def __init__(self, lanes: int, rate: float, beta: float):
        self.lanes, self.rate, self.beta = lanes, rate, beta
        self.running: dict[int, float] = {}  # call -> tokens left
        self.queued: deque[int] = deque()
        self.work = 0  # predicted tokens of the calls it holds (what the pool knows)

    def speed(self) -> float:
        """Tokens/s of each running call."""
        return self.rate / (1.0 + self.beta * (len(self.running) - 1))

    def next_finish(self) -> float:
        """Seconds until its first running call ends (inf when idle)."""
        return min(self.running.values()) / self.speed() if self.running else float("inf")


def simulate(policy_name: str, sizes: list[int], load: float, seed: int, replicas: int,
             lanes: int, rate: float, max_in_flight: int) -> dict[str, float]:
    """Run one policy over the calls: latency percentiles, makespan and balance.

    policy_name:   a dispatch policy name.
    sizes:         the calls' sizes in tokens, in arrival order.
    load:          offered load as a fraction of the replicas' total throughput.
    seed:          seeds the arrival times (the same for every policy).
    replicas:      replicas in the pool.
    lanes:         calls a replica decodes at once.
    rate:          tokens/s of one call decoded alone.
    max_in_flight: calls the pool lets a replica hold (running + queued there).
    """
    policy = make_dispatch(policy_name)
    beta = (lanes / GAIN_4 - 1.0) / 3.0 if lanes > 1 else 0.0
    reps = [Replica(lanes, rate, beta) for _ in range(replicas)]
    capacity = replicas * rate * lanes / (1.0 + beta * (lanes - 1))
    rng = random.Random(seed + 1)
    gap = sum(sizes) / len(sizes) / (capacity * load)
    arrivals, t = [], 0.0
    for _ in sizes:  # load "inf": a burst, every call arrives at once
        t += rng.expovariate(1.0 / gap) if gap > 0 else 0.0
        arrivals.append(t)
    latency = [0.0] * len(sizes)
    waiting: deque[int] = deque()
    spreads: list[int] = []

    def dispatch(call: int) -> bool:
        loads = [ReplicaLoad(i, True, r.work, len(r.running) + len(r.queued), max_in_flight)
                 for i, r in enumerate(reps)]
        spreads.append(max(r.work for r in reps) - min(r.work for r in reps))
        i = policy.choose(loads, sizes[call])
        if i is None:
            return False
        rep = reps[i]
        rep.work += sizes[call]
        if len(rep.running) < rep.lanes:
            rep.running[call] = float(sizes[call])
        else:
            rep.queued.append(call)
        return True

    now, nxt, done = 0.0, 0, 0
    while done < len(sizes):
        step = min(r.next_finish() for r in reps)
        arrival = arrivals[nxt] if nxt < len(sizes) else float("inf")
        dt = min(step, arrival - now)
        for r in reps:
            s = r.speed() * dt if r.running else 0.0
            for call in r.running:
                r.running[call] -= s
        now += dt
        if dt == step:  # completions
            for r in reps:
                for call in [c for c, left in r.running.items() if left <= 1e-6]:
                    del r.running[call]
                    r.work -= sizes[call]
                    latency[call] = now - arrivals[call]
                    done += 1
                while r.queued and len(r.running) < r.lanes:
                    call = r.queued.popleft()
                    r.running[call] = float(sizes[call])
            while waiting and dispatch(waiting[0]):
                waiting.popleft()
        else:
            if waiting or not dispatch(nxt):
                waiting.append(nxt)
            nxt += 1
    ordered = sorted(latency)

    def pct(p: float) -> float:
        return ordered[min(int(p * len(ordered)), len(ordered) - 1)]

    return {"p50_s": pct(0.50), "p99_s": pct(0.99), "makespan_s": now,
            "spread_tokens": sum(spreads) / max(len(spreads), 1)}


#: (label, lanes, max_in_flight): a replica that queues calls itself (an endpoint with its
#: own queue), and batched decoding with the pool holding what the replica cannot run
SCENARIOS = [("1 lane, queues at the replica", 1, 10_000),
             ("4 lanes, pool holds the rest", 4, 4),
             ("4 lanes, 16 held per replica", 4, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", type=int, default=5_000)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.8, 0.9, float("inf")],
                    help="offered load (fraction of capacity); inf: all calls at once")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--rate", type=float, default=100.0, help="tokens/s of one call alone")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = workload(args.calls, args.seed)
    ranked = sorted(sizes)
    print(f"{args.calls} calls, sizes p50 {ranked[len(sizes) // 2]} / p99 "
          f"{ranked[int(0.99 * len(sizes))]} / max {ranked[-1]} tokens; {args.replicas} "
          f"replicas, {args.rate:g} tok/s per call alone; least_work (lw) vs round_robin (rr)")
    print(f"{'scenario':<30} {'load':>5} {'p50 lw/rr s':>15} {'p99 lw/rr s':>15} "
          f"{'p99 ratio':>9} {'makespan lw/rr s':>19} {'spread ratio':>12}")
    for label, lanes, limit in SCENARIOS:
        for load in args.loads:
            lw, rr = (simulate(name, sizes, load, args.seed, args.replicas, lanes, args.rate,
                               limit) for name in ("least_work", "round_robin"))
            print(f"{label:<30} {load:>5.2f} {lw['p50_s']:>7.1f}/{rr['p50_s']:<7.1f} "
                  f"{lw['p99_s']:>7.1f}/{rr['p99_s']:<7.1f} {lw['p99_s'] / rr['p99_s']:>9.2f} "
                  f"{lw['makespan_s']:>9.0f}/{rr['makespan_s']:<9.0f} "
                  f"{lw['spread_tokens'] / max(rr['spread_tokens'], 1e-9):>12.2f}")


if __name__ == "__main__":
    main()
