"""Tokens streamed out of a Ray engine actor: per-token cost and time to first piece.

A fake engine in the actor (``TokenEngine``: no model, each token a Python loop step, or
paced at a decode rate) is called through ``ClusterEngine`` three ways:

* ``whole``    ``generate(requests)``: one plain actor call, the text comes back at the end;
* ``stream``   ``generate(requests, on_token)``: the actor's streaming generator, pieces
  joined while the consumer is busy, at generator windows 1, 2 (``STREAM_WINDOW``) and 8
  with yields as fast as they go, and at window 2 with yields at least 20 ms apart
  (``STREAM_INTERVAL_S``: what tailrace does);
* ``per-token`` the same engine behind a generator that yields every piece as its own
  Ray object (no joining): what streaming would cost without coalescing (run on at most
  5,000 tokens and scaled to N; its "pieces" column is the tokens it ran).

Per way: tokens/s of one request of N tokens (median [min - max] of the runs), the
pieces the consumer got, and the time over ``whole`` per call (ms) and per token (us).
A flat-out engine makes N tokens in a few ms, often before the generator first wakes:
this table shows the fixed cost of a streamed call and of one object per token. Then an engine
paced at 2,000 tokens/s (whole vs streamed: tokens/s, pieces, and CPU per token of the
caller's and the actor's processes, yields as fast as they go and 5/10/20 ms apart), and
time to first piece for an engine paced at a token every 20 ms, next to a one-token
whole call (one actor round trip plus that token).

    python bench/ray_stream.py                 # N = 20,000, 5 runs
    python bench/ray_stream.py --n 5000 --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


class TokenEngine:
    """``max_tokens`` pieces ``"tok "``; ``interval`` s between tokens (0: flat out)."""

    chat = True
    context_length = 1 << 30

    def __init__(self, model: str = "tokens", interval: float = 0.0) -> None:
        self.model = model
        self.interval = interval

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, requests: Sequence[Any], on_token: Any = None) -> list[Any]:
        from tailrace.engines import Generation

        out = []
        for i, r in enumerate(requests):
            due = time.perf_counter()
            parts, reason = [], "length"
            for _ in range(r.max_tokens):
                if self.interval:
                    due += self.interval
                    time.sleep(max(0.0, due - time.perf_counter()))
                parts.append("tok ")
                if on_token is not None and on_token(i, "tok ") is False:
                    reason = "cancelled"
                    break
            out.append(Generation("".join(parts), 1, len(parts), reason))
        return out

    def close(self) -> None:
        pass


def bench_actor_class() -> Any:
    from tailrace.runtime.ray.engines import EngineActor

    class BenchActor(EngineActor):
        """The engine actor, with ``backend: tokens`` known and a per-token generator."""

        def __init__(self, name: str, spec: dict[str, Any]) -> None:
            sys.path.insert(0, HERE)  # this file, importable as ``ray_stream`` in the actor
            from tailrace.engines import models

            models.BACKENDS["tokens"] = ("ray_stream", "TokenEngine", ("generate",))
            super().__init__(name, spec)

        def stream_each(self, requests: list[Any]) -> Iterator[tuple[int, str]]:
            q: queue.Queue = queue.Queue()

            def work() -> None:
                self.engine.generate(requests, lambda i, p: q.put((i, p)))
                q.put(None)

            threading.Thread(target=work, daemon=True).start()
            while (item := q.get()) is not None:
                yield item

    return BenchActor


def open_engine(name: str, spec: dict[str, Any]) -> tuple[Any, Any]:
    """(a ClusterEngine on a BenchActor, the actor's creating handle: keep it)."""
    import ray

    from tailrace.runtime.ray.engines import ClusterEngine, actor_options

    actor = ray.remote(bench_actor_class()).options(**actor_options(name, spec)).remote(
        name, spec)
    ray.get(actor.describe.remote())
    return ClusterEngine(name, spec), actor


def spread(xs: list[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))} - {fmt.format(max(xs))}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="tokens per request")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import ray

    from tailrace.engines import GenerationRequest
    from tailrace.runtime.ray import engines as cluster

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    eng, actor = open_engine("bench-tokens", {"backend": "tokens", "model": "tokens"})
    req = [GenerationRequest(prompt="x", max_tokens=args.n)]
    eng.generate(req[:1])  # warm

    def whole() -> tuple[float, int]:
        t = time.perf_counter()
        g = eng.generate(req)
        assert g[0].completion_tokens == args.n
        return time.perf_counter() - t, 1

    def stream(window: int, interval: float) -> Any:
        def go() -> tuple[float, int]:
            cluster.STREAM_WINDOW, cluster.STREAM_INTERVAL_S = window, interval
            n = [0]

            def on_token(i: int, p: str) -> bool:
                n[0] += 1
                return True

            t = time.perf_counter()
            g = eng.generate(req, on_token)
            assert g[0].completion_tokens == args.n
            return time.perf_counter() - t, n[0]
        return go

    m = min(args.n, 5000)  # the per-token way is ~100x slower: m tokens, scaled to N

    def per_token() -> tuple[float, int]:
        t, k = per_token_short(actor, ray, GenerationRequest, m)
        return t * args.n / m, k

    ways = {"whole": whole, "stream w=1": stream(1, 0.0), "stream w=2": stream(2, 0.0),
            "stream w=8": stream(8, 0.0), "stream 20ms": stream(2, 0.02),
            "per-token": per_token}
    times: dict[str, list[float]] = {k: [] for k in ways}
    pieces: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.runs):  # interleaved, so drift hits every way alike
        for k, fn in ways.items():
            t, n = fn()
            times[k].append(t)
            pieces[k].append(n)
    interval = 0.02
    cluster.STREAM_WINDOW, cluster.STREAM_INTERVAL_S = 2, interval

    print(f"ray_stream: {platform.machine()}, {os.cpu_count()} CPUs, Ray {ray.__version__}, "
          f"Python {platform.python_version()}; one request of N={args.n:,} tokens, "
          f"{args.runs} runs")
    base = statistics.median(times["whole"])
    print(f"{'way':<12} {'tokens/s':>30} {'pieces':>22} {'ms/call over whole':>19} "
          f"{'us/token':>9}")
    for k in ways:
        tps = [args.n / t for t in times[k]]
        over = statistics.median(times[k]) - base
        print(f"{k:<12} {spread(tps):>30} {spread(pieces[k]):>22} {over * 1e3:>19.2f} "
              f"{over / args.n * 1e6:>9.2f}")

    # a paced engine at 2,000 tokens/s (faster than llama.cpp decodes here): does the
    # stream keep up, and in how many pieces?
    fast, fast_actor = open_engine("bench-fast", {"backend": "tokens", "model": "tokens",
                                                  "interval": 0.0005})
    k = 2000
    reqk = [GenerationRequest(prompt="x", max_tokens=k)]
    fast.generate(reqk[:1])
    def cpu() -> float:  # CPU seconds of this process and the engine actor's so far
        return time.process_time() + ray.get(
            fast_actor.__ray_call__.remote(lambda self: time.process_time()))

    ways2: dict[str, float | None] = {"whole": None, "stream, yields as fast as they go": 0.0}
    for iv in sorted({0.005, 0.01, 0.02, interval}):
        ways2[f"stream, yields >= {iv * 1000:g} ms apart"] = iv
    tps2: dict[str, list[float]] = {w: [] for w in ways2}
    cpu2: dict[str, list[float]] = {w: [] for w in ways2}
    pn2: dict[str, list[float]] = {w: [] for w in ways2}
    for _ in range(args.runs):
        for w, iv in ways2.items():
            n = [0]

            def count(i: int, p: str) -> bool:
                n[0] += 1
                return True

            c, t = cpu(), time.perf_counter()
            if iv is None:
                fast.generate(reqk)
            else:
                cluster.STREAM_INTERVAL_S = iv
                fast.generate(reqk, count)
            tps2[w].append(k / (time.perf_counter() - t))
            cpu2[w].append((cpu() - c) / k * 1e6)
            pn2[w].append(n[0] or 1)
    cluster.STREAM_INTERVAL_S = interval
    print(f"paced engine (2,000 tokens/s, {k:,} tokens; CPU: this process + the actor's, "
          "us per token):")
    for w in ways2:
        print(f"  {w:<34} {spread(tps2[w])} tokens/s, {spread(pn2[w])} pieces, CPU "
              f"{spread(cpu2[w])} us/token")

    # time to first piece: a paced engine (a token every 20 ms), 10 tokens
    paced, paced_actor = open_engine("bench-paced", {"backend": "tokens", "model": "tokens",
                                                     "interval": 0.02})
    one = [GenerationRequest(prompt="x", max_tokens=1)]
    ten = [GenerationRequest(prompt="x", max_tokens=10)]
    paced.generate(one)
    firsts, rounds, totals = [], [], []
    for _ in range(max(args.runs, 5) * 4):
        t = time.perf_counter()
        first: list[float] = []
        paced.generate(ten, lambda i, p: first.append(time.perf_counter()) and None)
        totals.append(time.perf_counter() - t)
        firsts.append(first[0] - t)
        t = time.perf_counter()
        paced.generate(one)
        rounds.append(time.perf_counter() - t)
    print(f"paced engine (20 ms/token, 10 tokens): first piece {spread(firsts, '{:.4f}')} s "
          f"(the engine's first token is due at 0.02 s); whole 1-token call "
          f"{spread(rounds, '{:.4f}')} s; whole 10-token stream {spread(totals, '{:.4f}')} s")
    for a in (actor, fast_actor, paced_actor):
        ray.kill(a)
    ray.shutdown()


def per_token_short(actor: Any, ray: Any, request: Any, n: int) -> tuple[float, int]:
    """The per-token way on ``n`` tokens (it is ~100x slower: scaled up by the caller)."""
    t = time.perf_counter()
    k = 0
    for ref in actor.stream_each.options(
            num_returns="streaming", _generator_backpressure_num_objects=8).remote(
            [request(prompt="x", max_tokens=n)]):
        ray.get(ref)
        k += 1
    assert k == n
    return time.perf_counter() - t, k


if __name__ == "__main__":
    main()
