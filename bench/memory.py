"""Memory store latency: one read and one write as memory_read/memory_write make them,
on SQLite and on PostgreSQL + pgvector, with 1e4 and 1e5 facts stored.

Facts are random 384-d unit vectors (the MiniLM dimension), not embeddings of real
text: the embedder is not what is measured, and embedding 1e5 texts would take most of
an hour here. They are spread over ``--users`` users (default 100: 100 and 1,000 facts
per user), each user with a 20-turn session. A read is what memory_read does per
record: the last 6 turns of a session plus the top 3 facts of the user for a query
vector (an exact scan of that user's facts). A write is what memory_write does for a
one-record micro-batch: two turns and one fact in one transaction. PostgreSQL
16 is started with ``pgserver`` in a temporary directory (Unix socket) unless ``--dsn``
names a server.

    python bench/memory.py [--sizes 10000 100000] [--users 100] [--ops 300] [--dsn URI]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tailrace.stores.memory import Fact, MemoryStore, Turn, check_store_spec, open_store

DIM = 384
MODEL = "bench-random-384"


def unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def populate(store: MemoryStore, n_facts: int, users: int, have: int, seed: int) -> None:
    """Grow the store from ``have`` to ``n_facts`` facts (and 20 turns per user)."""
    rng = np.random.default_rng(seed + have)
    if have == 0:
        store.add_turns([Turn(f"user{u}", "s0", "user" if i % 2 == 0 else "assistant",
                              f"turn {i} of user {u} " + "words " * 20)
                         for u in range(users) for i in range(20)], 0.0)
    for start in range(have, n_facts, 2000):
        n = min(2000, n_facts - start)
        vecs = unit_rows(rng, n)
        store.add_facts([Fact(f"user{(start + i) % users}", f"fact {start + i} " + "w " * 10,
                              vecs[i], MODEL, {"i": start + i}) for i in range(n)], 0.0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(store: MemoryStore, users: int, ops: int, seed: int) -> dict[str, float]:
    """Latency (ms) of ``ops`` reads and ``ops`` writes, interleaved, after 20 warm-ups."""
    rng = random.Random(seed)
    queries = unit_rows(np.random.default_rng(seed), ops + 20)
    reads, writes = [], []
    for i in range(ops + 20):
        user = f"user{rng.randrange(users)}"
        t0 = time.perf_counter()
        store.last_turns(user, "s0", 6, 1.0)
        store.top_facts(user, MODEL, queries[i], 3, 1.0)
        t1 = time.perf_counter()
        store.add([Turn(user, "s1", "user", f"question {i}"),
                   Turn(user, "s1", "assistant", f"answer {i}")],
                  [Fact(user, f"new fact {seed} {i}", queries[i], MODEL)], 1.0)
        t2 = time.perf_counter()
        if i >= 20:
            reads.append((t1 - t0) * 1e3)
            writes.append((t2 - t1) * 1e3)
    return {"read_p50": statistics.median(reads), "read_p99": pct(reads, 0.99),
            "write_p50": statistics.median(writes), "write_p99": pct(writes, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000],
                    help="stored facts (ascending)")
    ap.add_argument("--users", type=int, default=100, help="users the facts are spread over")
    ap.add_argument("--ops", type=int, default=300, help="timed reads and writes per point")
    ap.add_argument("--dsn", help="a PostgreSQL server to use instead of a pgserver one")
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgres"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tailrace-bench-memory-"))
    server = None
    print(f"{'backend':<9} {'facts':>7} {'per user':>8} {'fill s':>7} {'read p50':>9} "
          f"{'read p99':>9} {'write p50':>9} {'write p99':>9}   (ms)")
    for backend in args.backends:
        if backend == "sqlite":
            spec = {"backend": "sqlite", "path": str(tmp / "memory.sqlite")}
        elif args.dsn:
            spec = {"backend": "postgres", "dsn": args.dsn}
        else:
            import pgserver

            server = pgserver.get_server(tmp / "pg", cleanup_mode="delete")
            spec = {"backend": "postgres", "dsn": server.get_uri()}
        store = open_store(check_store_spec(spec))
        have = 0
        for n in sorted(args.sizes):
            t0 = time.perf_counter()
            populate(store, n, args.users, have, seed=1)
            fill = time.perf_counter() - t0
            have = n
            r = measure(store, args.users, args.ops, seed=n)
            have += args.ops  # the timed writes added facts too
            print(f"{backend:<9} {n:>7,} {n // args.users:>8,} {fill:>7.1f} "
                  f"{r['read_p50']:>9.2f} {r['read_p99']:>9.2f} {r['write_p50']:>9.2f} "
                  f"{r['write_p99']:>9.2f}", flush=True)
        store.close()
        if server is not None:
            server.cleanup()
            server = None


if __name__ == "__main__":
    main()
