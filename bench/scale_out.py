"""Scale-out on Ray: throughput of a RAG-shaped pipeline at 1, 2, 4 and 8 workers.

The pipeline is embed -> retrieve -> refine -> generate -> sink. Generation is the
expensive stage, so it is the one that scales out: ``replicas: N`` (N workers, each a
Ray actor of its own) calling the latency-model engine server (``latency_server.py``,
a real OpenAI-wire HTTP server in a child process whose response *time* follows a
continuous-batching model and which does no model work). Embed and retrieve are cheap
stand-ins (a hash vector and a lookup in a 64-passage corpus); refine is the real
operator. Every run gets the same requests and must complete all of them (a run that
drops one does not count); the target is throughput(N) >= 0.9 x N x throughput(1).

The server gives each worker the capacity of its own engine: 8 sequence slots per
worker (64 in all) and no slowdown from sharing, as N separate GPU servers would. So
this measures the runtime (placement, pushes, credits, replicas), not an engine.

What scales here is I/O-bound waiting: each worker mostly waits on HTTP responses from
a latency-model engine that sleeps instead of computing; it does not show compute (model
work or CPU-bound stages) scaling out, which two cores cannot.

    python bench/scale_out.py                 # 512 requests per run, N = 1, 2, 4, 8
    python bench/scale_out.py --requests 256  # quicker
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import time

import tailrace as tr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency_server import LatencyConfig, spawn  # noqa: E402

CORPUS = [{"title": f"Doc {i}", "text": " ".join(f"fact{i}-{j}" for j in range(40))}
          for i in range(64)]


def embed(text: str) -> list[float]:
    """A stand-in embedding: 8 numbers from a hash of the text."""
    h = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return [b / 255 for b in h]


def retrieve(vec: list[float]) -> list[dict]:
    """A stand-in retrieval: 3 passages chosen by the vector."""
    i = int(vec[0] * 255)
    return [CORPUS[(i + k) % len(CORPUS)] for k in range(3)]


def pipeline(engine: dict, workers: int, max_tokens: int) -> tr.Pipeline:
    p = tr.Pipeline("rag-scale", engines={"llm": engine})
    (p.source(fields=["id", "question"])
     .map(embed, id="embed", input="question", output="qvec")
     .map(retrieve, id="retrieve", input="qvec", output="passages")
     .apply("refine", id="refine", input="passages", max_tokens=200, output="context")
     .apply("generate", id="generate", engine="llm", output="answer", max_tokens=max_tokens,
            prompt="Context:\n{context}\n\nQuestion: {question}\nAnswer:", max_batch=8,
            replicas=workers, blocking=True)
     .sink())
    return p


def run_once(engine: dict, workers: int, requests: int, max_tokens: int) -> dict:
    questions = [{"id": i, "question": f"What is fact {i}?"} for i in range(requests)]
    p = pipeline(engine, workers, max_tokens)
    t0 = time.perf_counter()
    result = tr.run(p, runtime="ray", input=questions)
    wall = time.perf_counter() - t0
    done = sorted(r["id"] for r in result.outputs)
    return {"workers": workers, "completed": len(done), "errors": len(result.errors),
            "complete": done == list(range(requests)), "wall_s": wall,
            "rps": len(done) / wall, "nodes": len(set(result.stats["generate"].nodes)),
            "replicas": len(result.stats["generate"].nodes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512,
                    help="requests per run (a multiple of 64 fills every batch at N = 8)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--decode-tps", type=float, default=40.0, help="engine tokens/s/sequence")
    args = ap.parse_args()
    import ray

    top = max(args.workers)
    cfg = LatencyConfig(prefill_tps=4000, decode_tps=args.decode_tps, batch_slowdown=0.0,
                        max_seqs=8 * top, chunk_tokens=8)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    with spawn(cfg) as server:
        engine = {"backend": "openai", "base_url": server.url, "model": "latency-model",
                  "concurrency": 8 * top, "timeout_s": 120, "retries": 0}
        # One engine actor serves every worker (engines are shared cluster actors), so it
        # may keep 8 requests in flight per worker: the engine server, not the client,
        # is what each added worker brings capacity to.
        per_call = 60 / 4000 + args.max_tokens / args.decode_tps
        print(f"tailrace scale-out benchmark: {args.requests} requests per run, generation "
              f"{args.max_tokens} tokens at {args.decode_tps:g} tok/s (~{per_call:.2f}s per "
              f"batch of 8), {os.cpu_count()} CPUs, Ray {ray.__version__}, Python "
              f"{platform.python_version()} on {platform.machine()}")
        print("measures I/O-bound waiting scaling out: the workers wait on a latency-model "
              "engine (an HTTP server that sleeps for the modelled time, no model work); "
              "compute does not scale here")
        run_once(engine, top, 8 * top, args.max_tokens)  # start every worker actor first
        rows = [run_once(engine, n, args.requests, args.max_tokens) for n in args.workers]
        server_stats = server.stats()
    base = rows[0]["rps"] / rows[0]["workers"]
    print(f"{'workers':>7} {'completed':>10} {'errors':>6} {'wall s':>7} {'req/s':>7} "
          f"{'x 1 worker':>10} {'/ N':>6}  target >= 0.90")
    for r in rows:
        speedup = r["rps"] / base
        ok = r["complete"] and speedup / r["workers"] >= 0.9
        print(f"{r['workers']:>7} {r['completed']:>10} {r['errors']:>6} {r['wall_s']:>7.2f} "
              f"{r['rps']:>7.2f} {speedup:>10.2f} {speedup / r['workers']:>6.2f}  "
              f"{'ok' if ok else 'MISSED'}{'' if r['complete'] else ' (requests lost)'}")
    print(f"engine server: peak {server_stats['peak_active']} sequences at once, "
          f"{server_stats['served']} requests served")
    print("what this shows: I/O-bound waiting on a latency-model engine scales with the "
          "workers; not compute. What this machine cannot show: every worker, the driver and "
          "the engine server share these CPUs on one node (no network between workers, no "
          "GPUs); the engine is a latency model, not a real one; CPU-bound stages cannot "
          "scale here, and the paper's 16-node figures are out of reach")
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
