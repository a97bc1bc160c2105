"""Prefix reuse (issue 16): what the llama.cpp engine's KV prefix cache saves, and where pool
dispatch sends a conversation's turns.

``--only engine``: the engine alone, cache on vs off (``bench/prefix_engine.py``: turn-5
TTFT, RAG-shape prompt tokens computed, the price of aligned prefill, memory under a random
workload).

``dispatch_bench`` (``--only dispatch``): a pool of 2 llama.cpp replicas (1 thread each) and
64 concurrent conversations, 5 turns each, every turn's prompt being the whole history so
far (its own system prompt, the earlier questions and the model's answers) plus a new
question. Each conversation is a closed-loop client on its own thread: it waits a random
0-1 s (its user thinking; this also keeps the conversations from moving in lockstep), sends
a turn, reads the streamed answer, and so on. Run once per dispatch policy and seed, on a
fresh pool each time (empty caches). Reported per run: the prefix-cache hit ratio (prompt
tokens read from a replica's cache / prompt tokens, from the pool's statistics), time to
first token (the first streamed piece, from the call, queueing included) p50/p99 over all
turns and over turns 2..5, and throughput (completion tokens / wall seconds).

    python bench/prefix.py                                    # both
    python bench/prefix.py --only engine
    python bench/prefix.py --only dispatch                    # 64 x 5, seeds 1 2 3
    python bench/prefix.py --only dispatch --conversations 16 --turns 3 --seeds 1
    python bench/prefix.py --only dispatch --think-s 0 --max-wait-ms 20   # mixed batches
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tailrace.engines.base import GenerationRequest  # noqa: E402
from tailrace.engines.pool import EnginePool  # noqa: E402

WORDS = ["river", "stone", "market", "garden", "engine", "window", "letter", "harbor",
         "valley", "castle", "signal", "orchard", "lantern", "meadow", "bridge", "canyon",
         "forest", "island", "summit", "village", "tower", "compass", "thunder", "harvest",
         "library", "station", "ribbon", "anchor", "candle", "desert"]

#: the pool: 2 replicas, 1 thread each (this machine has 2 cores). Each replica caches
#: n_seq_max + cache_sequences prompts: 32, enough for half the conversations.
POOL = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 1,
        "n_ctx": 1024, "n_seq_max": 8, "cache_sequences": 24}


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _conversation(pool: EnginePool, cid: int, turns: int, max_tokens: int, seed: int,
                  start: threading.Barrier, out: list[Turn], think_s: float = 1.0) -> None:
    rng = random.Random(f"{seed}-{cid}")
    history: list[dict[str, str]] = [{"role": "system", "content": (
        f"You are the guide of {_sentence(rng, 3)}. Answer briefly. " + _sentence(rng, 120))}]
    start.wait()
    for t in range(turns):
        time.sleep(rng.uniform(0.0, think_s))  # the user reads and types
        ask = {"role": "user", "content": f"Question {t + 1}: tell me about "
                                          f"{_sentence(rng, 30)}."}
        req = GenerationRequest(messages=(*history, ask), max_tokens=max_tokens)
        first: list[float] = []
        t0 = time.perf_counter()
        gen = pool.generate([req], lambda _i, _p: first.append(time.perf_counter())
                            if not first else None)[0]
        ttft = (first[0] if first else time.perf_counter()) - t0
        out.append(Turn(cid, t + 1, ttft, gen.prompt_tokens,
                        int(gen.extra.get("cached_tokens", 0)), gen.completion_tokens))
        history += [ask, {"role": "assistant", "content": gen.text}]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def run_dispatch(policy: str, seed: int, conversations: int, turns: int,
                 max_tokens: int, think_s: float = 1.0,
                 max_wait_ms: float = 2.0) -> dict[str, float]:
    """One run on a fresh pool: hit ratio, TTFT percentiles (s), throughput (tokens/s)."""
    # the same call cap for both policies: prefix_affinity's default (4 x n_seq_max; the
    # engine queues what it cannot decode yet); least_work's default of 4 would cap it lower
    with EnginePool("prefix-bench", POOL, replicas=2, dispatch=policy, max_batch_size=8,
                    max_wait_ms=max_wait_ms, max_in_flight=4 * POOL["n_seq_max"]) as pool:
        out: list[Turn] = []
        start = threading.Barrier(conversations + 1)
        threads = [threading.Thread(target=_conversation, daemon=True, args=(
            pool, c, turns, max_tokens, seed, start, out, think_s))
            for c in range(conversations)]
        for th in threads:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        stats = pool.statistics()
    prompt = sum(r.prompt_tokens for r in stats.replicas)
    hits = sum(r.cached_tokens for r in stats.replicas)
    later = [x.ttft_s for x in out if x.turn > 1]
    return {"hit_ratio": hits / prompt if prompt else 0.0,
            "ttft_p50": _pct([x.ttft_s for x in out], 0.5),
            "ttft_p99": _pct([x.ttft_s for x in out], 0.99),
            "later_p50": _pct(later, 0.5), "later_p99": _pct(later, 0.99),
            "tok_s": sum(x.completion_tokens for x in out) / wall,
            "requests": [r.requests for r in stats.replicas],  # type: ignore[dict-item]
            "batch": stats.mean_batch_size,  # requests per batch formed
            "calls_per_batch": sum(r.calls for r in stats.replicas) / max(stats.batches, 1),
            "wall_s": wall}


def dispatch_bench(conversations: int = 64, turns: int = 5, seeds: tuple[int, ...] = (1, 2, 3),
                   policies: tuple[str, ...] = ("least_work", "prefix_affinity"),
                   max_tokens: int = 16, think_s: float = 1.0,
                   max_wait_ms: float = 2.0) -> dict[str, list[dict[str, float]]]:
    """prefix_affinity vs least_work on 2 replicas; prints a table, returns the runs.

    think_s:     the most a user waits before each turn (0: all at once, in bursts).
    max_wait_ms: the pool's batching wait (larger: batches mixing conversations, which
                 prefix_affinity splits by replica: ``calls/batch`` above 1)."""
    print(f"# dispatch: 2 replicas, {conversations} conversations x {turns} turns, "
          f"max_tokens {max_tokens}, think 0-{think_s:g} s, max_wait_ms {max_wait_ms:g}, "
          f"seeds {list(seeds)}")
    print(f"{'policy':<16} {'seed':>4} {'hit':>6} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'t2+ p50':>8} {'t2+ p99':>8} {'tok/s':>7} {'batch':>5} {'calls/b':>7}"
          "  requests/replica")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    for seed in seeds:
        for policy in policies:
            r = run_dispatch(policy, seed, conversations, turns, max_tokens, think_s,
                             max_wait_ms)
            runs[policy].append(r)
            print(f"{policy:<16} {seed:>4} {r['hit_ratio']:>6.1%} {r['ttft_p50']:>8.2f}s "
                  f"{r['ttft_p99']:>8.2f}s {r['later_p50']:>7.2f}s {r['later_p99']:>7.2f}s "
                  f"{r['tok_s']:>7.1f} {r['batch']:>5.2f} {r['calls_per_batch']:>7.2f}"
                  f"  {r['requests']}", flush=True)
    print("mean over seeds:")
    for policy, rs in runs.items():
        m = {k: statistics.mean(r[k] for r in rs) for k in
             ("hit_ratio", "ttft_p50", "ttft_p99", "later_p50", "later_p99", "tok_s")}
        print(f"{policy:<16} {'':>4} {m['hit_ratio']:>6.1%} {m['ttft_p50']:>8.2f}s "
              f"{m['ttft_p99']:>8.2f}s {m['later_p50']:>7.2f}s {m['later_p99']:>7.2f}s "
              f"{m['tok_s']:>7.1f}")
    if len(policies) == 2:
        a, b = (statistics.mean(r["tok_s"] for r in runs[p]) for p in policies)
        print(f"throughput {policies[1]} / {policies[0]}: {b / a:.3f}")
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["engine", "dispatch"], default=None,
                    help="run one measurement (default: all there are)")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=1.0,
                    help="the most a user waits before each turn (0: bursts)")
    ap.add_argument("--max-wait-ms", type=float, default=2.0, help="the pool's batching wait")
    args = ap.parse_args()
    if args.only in (None, "engine"):
        import prefix_engine  # bench/ is on sys.path when this script runs

        sys.argv = sys.argv[:1]
        prefix_engine.main()
    if args.only in (None, "dispatch"):
        dispatch_bench(args.conversations, args.turns, tuple(args.seeds),
                       max_tokens=args.max_tokens, think_s=args.think_s,
                       max_wait_ms=args.max_wait_ms)


if __name__ == "__main__":
    main()
