"""Multi-pipeline contention: SLO-aware admission vs simultaneous admission (ARCHITECTURE §5).

An interactive RAG-shaped pipeline (short prompts, 32 output tokens, SLO p99 2 s) and a
batch summarisation pipeline (long prompts, 128 output tokens, SLO p99 60 s) share one
generation engine. Open-loop Poisson arrivals (fixed seed) at ~1.5x the engine's
capacity for a fixed duration; the SAME arrival trace is replayed under each admission
policy (`simultaneous`, `fcfs`, `slo`). Reported per pipeline: p50/p99 latency from
arrival (queueing included), SLO attainment (completed within the SLO / arrivals),
rejections; total goodput — output tokens per second of the requests that met their SLO
(the usual serving definition) — and raw throughput (all completed output tokens per
second), both over the time until the last request finished.

    python bench/contention.py                      # latency-model server (default)
    python bench/contention.py --engine llama       # a real embedded llama.cpp pool
    python bench/contention.py --engine llama --seeds 7 8 9 --reserve 2 0 --overflow 4 \
        --policies simultaneous slo                 # spread over seeds, with/without reserve

Under ``slo`` the admitted requests also carry their class and deadline into the engine
(an SLO-ordering policy's records do; ``simultaneous`` and ``fcfs`` carry nothing): with
``--engine llama`` the llama.cpp decode loop then starts, prefills and preempts by class
(docs/engines.md, "Priorities inside the engine"); ``simultaneous`` is the engine's
first come, first served. ``--reserve 2 0`` runs the slo policy with and without
reserve lanes on the same traces.

The latency-model server (bench/latency_server.py) is a real OpenAI-wire HTTP server
whose timing follows a continuous-batching model, so contention is measured on this
2-core machine without CPU noise.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tailrace as tr  # noqa: E402
from tailrace.control import PipelineSLO, make_policy  # noqa: E402
from tailrace.control.gate import AdmissionGate, approx_prompt_tokens  # noqa: E402
from tailrace.control.slo import CostModel  # noqa: E402
from tailrace.engines import open_engine  # noqa: E402
from tailrace.stores.corpus import read_wiki  # noqa: E402


@dataclass(frozen=True)
class Workload:
    name: str
    rate: float  # arrivals per second
    prompt_words: int
    max_tokens: int
    slo_ms: float
    priority: str
    weight: float
    texts: tuple[str, ...] = ()  # prompts, used in turn (default: prompt_words x "word")


def trace(w: Workload, duration: float, seed: int) -> list[float]:
    """Poisson arrival offsets in seconds."""
    rng = random.Random(f"{seed}-{w.name}")
    t, out = 0.0, []
    while True:
        t += rng.expovariate(w.rate)
        if t >= duration:
            return out
        out.append(t)


@dataclass
class LatencySetup:
    """The contention workload on the latency-model server (bench/latency_server.py)."""

    server: object
    engine: dict
    capacity: int
    replicas: int
    cost: CostModel
    workloads: list[Workload]


def latency_setup(load: float) -> LatencySetup:
    """Start the latency-model server and the two workloads at ``load`` x capacity (the
    default engine of this benchmark; bench/simulate.py replays the same)."""
    from latency_server import LatencyConfig, start_server

    cfg = LatencyConfig(prefill_tps=4000, decode_tps=40, batch_slowdown=0.05, max_seqs=8)
    server = start_server(cfg)
    engine = {"backend": "openai", "base_url": server.url, "model": "latency-model",
              "concurrency": 64, "timeout_s": 600, "retries": 0}
    # service seconds per request at full batch: prefill + tokens / (tps / slowdown)
    per_tok = (1 / cfg.decode_tps) * (1 + cfg.batch_slowdown * (cfg.max_seqs - 1))
    cost = CostModel(prefill_tps=cfg.prefill_tps, decode_tps=1 / per_tok, overhead_s=0.01)
    interactive = Workload("interactive", 0, 240, 32, 2000, "interactive", 4)
    batch = Workload("batch", 0, 1600, 128, 60000, "batch", 1)
    workloads = offered([interactive, batch], cfg.max_seqs, load, lambda w: (
        w.prompt_words * 1.25 / cost.prefill_tps + w.max_tokens * per_tok))
    return LatencySetup(server, engine, cfg.max_seqs, 32, cost, workloads)


def offered(workloads: list[Workload], capacity: int, load: float,
            service: Callable[[Workload], float]) -> list[Workload]:
    """The two workloads with their rates: interactive takes 20% of ``capacity``
    (concurrent sequences), batch brings the total to ``load``; ``service``: seconds one
    request of a kind takes at full batch."""
    interactive, batch = workloads
    i_rate = 0.2 * capacity / service(interactive)
    b_rate = (load - 0.2) * capacity / service(batch)
    return [Workload(**{**interactive.__dict__, "rate": i_rate}),
            Workload(**{**batch.__dict__, "rate": b_rate})]


def pipeline(w: Workload, engine: dict, replicas: int) -> tr.Pipeline:
    p = tr.Pipeline(w.name, engines={"llm": engine})
    (p.source(fields=["text", "t0"])
     .apply("generate", id="generate", engine="llm", input="text", output="answer",
            max_tokens=w.max_tokens, max_batch=1, replicas=replicas, usage="usage")
     .sink())
    return p


def run_policy(policy_name: str, workloads: list[Workload], traces: dict, engine: dict,
               capacity: int, cost: CostModel, replicas: int, reserve: int,
               overflow: int = 0, runtime: str = "local") -> dict:
    slos = {w.name: PipelineSLO(w.slo_ms, w.priority, w.weight, w.name) for w in workloads}
    options: dict = {"cost_model": cost, "slos": slos}
    if policy_name != "simultaneous":
        options["max_in_flight"] = capacity
    if policy_name == "slo":
        options["reserve"] = reserve
        options["overflow"] = overflow
    gate = AdmissionGate(make_policy(policy_name, **options),
                         max_tokens={w.name: w.max_tokens for w in workloads})
    start = time.perf_counter() + 0.5
    latencies: dict[str, list[float]] = {w.name: [] for w in workloads}
    tokens = {w.name: 0 for w in workloads}
    good = {w.name: 0 for w in workloads}
    rejected = {w.name: 0 for w in workloads}
    last_done = [start]
    lock = threading.Lock()

    def go(w: Workload) -> None:
        texts = w.texts or (" ".join(["word"] * w.prompt_words),)

        async def arrivals():
            for i, offset in enumerate(traces[w.name]):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                yield {"text": texts[i % len(texts)], "t0": time.perf_counter()}

        def sink(rec: dict) -> None:
            now = time.perf_counter()
            with lock:
                latencies[w.name].append(now - rec["t0"])
                tokens[w.name] += rec["usage"]["completion_tokens"]
                if (now - rec["t0"]) * 1000 <= w.slo_ms:
                    good[w.name] += rec["usage"]["completion_tokens"]
                last_done[0] = max(last_done[0], now)

        result = tr.run(pipeline(w, engine, replicas), input=arrivals(), output=sink,
                        admission=gate, runtime=runtime)
        for e in result.errors:
            if e.stage == "admission":
                rejected[w.name] += 1
            else:
                print(f"  {w.name}: error in {e.stage}: {e.message}", file=sys.stderr)

    threads = [threading.Thread(target=go, args=(w,)) for w in workloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gate.close()
    span = last_done[0] - start
    out = {"policy": policy_name, "span_s": span,
           "goodput_tps": sum(good.values()) / span if span > 0 else 0.0,
           "throughput_tps": sum(tokens.values()) / span if span > 0 else 0.0, "pipelines": {}}
    for w in workloads:
        lat = sorted(latencies[w.name])
        n = len(traces[w.name])
        ok = sum(1 for x in lat if x * 1000 <= w.slo_ms)
        out["pipelines"][w.name] = {
            "arrivals": n, "completed": len(lat), "rejected": rejected[w.name],
            "p50_ms": statistics.median(lat) * 1000 if lat else float("nan"),
            "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000 if lat else float(
                "nan"),
            "slo_attainment": ok / n if n else 1.0}
    return out


def calibrate(pool, w: Workload, concurrency: int, rounds: int = 2) -> float:
    """Median seconds one request of ``w`` takes with ``concurrency`` of them running."""
    from tailrace.engines import GenerationRequest

    times: list[float] = []
    lock = threading.Lock()

    def caller(k: int) -> None:
        for j in range(rounds):
            text = w.texts[(k * rounds + j) % len(w.texts)]
            req = GenerationRequest(messages=({"role": "user", "content": text},),
                                    max_tokens=w.max_tokens)
            t0 = time.perf_counter()
            pool.generate([req])
            with lock:
                times.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(times)


def fit_cost_model(workloads: list[Workload], measured: dict[str, float]) -> CostModel:
    """Prefill and decode rates that reproduce the measured service times of two kinds
    (prompt tokens counted as the admission gate predicts them: 4 characters a token)."""
    (a, b) = workloads
    overhead = 0.02
    pa = statistics.mean(approx_prompt_tokens({"text": t}) for t in a.texts)
    pb = statistics.mean(approx_prompt_tokens({"text": t}) for t in b.texts)
    # measured - overhead = prompt * x + max_tokens * y, for x = 1/prefill, y = 1/decode
    ra, rb = measured[a.name] - overhead, measured[b.name] - overhead
    det = pa * b.max_tokens - pb * a.max_tokens
    x = (ra * b.max_tokens - rb * a.max_tokens) / det
    y = (pa * rb - pb * ra) / det
    if x <= 0 or y <= 0:  # not separable: all of it as decode time
        x, y = 1e-4, ra / a.max_tokens
    return CostModel(prefill_tps=1 / x, decode_tps=1 / y, overhead_s=overhead)


def spread(xs: list[float], fmt: str = "{:.1%}") -> str:
    """median [min - max] of one figure over the seeds"""
    if len(xs) == 1:
        return fmt.format(xs[0])
    return (f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))} - "
            f"{fmt.format(max(xs))}]")


def summarise(runs: dict[str, list[dict]], seeds: list[int], engine: str) -> None:
    """Each policy against ``simultaneous`` on the same trace, seed by seed: median
    [min - max] over the seeds."""
    base = runs["simultaneous"]
    target_drop = 0.85 if engine == "llama" else 0.80
    print(f"\nagainst simultaneous, seed by seed ({len(seeds)} seeds: {seeds}); median "
          "[min - max]:")
    print(f"  {'policy':<16} {'interactive p99 lower':>26} {'interactive attainment':>26} "
          f"{'raw throughput ratio':>24} {'goodput ratio':>24}")
    for label, rs in runs.items():
        if label == "simultaneous":
            continue
        drop = [1 - r["pipelines"]["interactive"]["p99_ms"]
                / b["pipelines"]["interactive"]["p99_ms"] for r, b in zip(rs, base, strict=True)]
        att = [r["pipelines"]["interactive"]["slo_attainment"] for r in rs]
        thr = [r["throughput_tps"] / b["throughput_tps"] for r, b in zip(rs, base, strict=True)]
        good = [r["goodput_tps"] / b["goodput_tps"] if b["goodput_tps"] else float("inf")
                for r, b in zip(rs, base, strict=True)]
        print(f"  {label:<16} {spread(drop):>26} {spread(att):>26} "
              f"{spread(thr, '{:.3f}'):>24} {spread(good, '{:.2f}'):>24}")
    print(f"  targets (slo): p99 >= {target_drop:.0%} lower, attainment >= 99%, raw "
          "throughput >= 0.95")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["latency", "llama"], default="latency")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--load", type=float, default=1.5, help="offered load / capacity")
    ap.add_argument("--seeds", type=int, nargs="+", default=[7],
                    help="arrival traces (one run of every policy each; spread reported)")
    ap.add_argument("--reserve", type=int, nargs="+", default=[2],
                    help="slo policy: lanes kept for the interactive class while it is "
                         "active; several values run slo once with each (e.g. 2 0)")
    ap.add_argument("--overflow", type=int, nargs="*", default=[],
                    help="slo policy: also run it with reserve 0 and this many overflow "
                         "lanes (beyond max_in_flight, for the interactive class while a "
                         "batch request runs: the engine preempts for it)")
    ap.add_argument("--policies", nargs="+", default=["simultaneous", "fcfs", "slo"])
    ap.add_argument("--service", type=float, nargs=2, metavar=("INTERACTIVE_S", "BATCH_S"),
                    help="--engine llama: skip the calibration and take these service "
                         "seconds (each kind, 8 at once) as measured, e.g. the ones an "
                         "earlier run printed: the load and the SLO then match that run's")
    args = ap.parse_args()

    server = None
    if args.engine == "latency":
        lat = latency_setup(args.load)
        server, engine, cost = lat.server, lat.engine, lat.cost
        capacity, replicas = lat.capacity, lat.replicas
        interactive, batch = lat.workloads
    else:
        # A pool of 2 llama.cpp replica processes (1 thread each: this machine has 2 cores),
        # shared by both pipelines through the pipeline spec's `replicas:`. Real prompts:
        # questions for the interactive pipeline, Wikipedia summaries to condense for batch.
        # cache_sequences: 2 spare KV streams per replica, where a batch sequence paused
        # for an interactive one keeps its KV (the engine's preemption needs one)
        # max_in_flight: the pool sends each replica as many calls as it holds sequences
        # (4 decoding + 2 paused), so an urgent call reaches the engine to preempt
        engine = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 1,
                  "n_ctx": 1024, "n_seq_max": 4, "cache_sequences": 2, "replicas": 2,
                  "max_batch_size": 4, "max_wait_ms": 2, "max_in_flight": 6}
        capacity, replicas = 8, 8
        docs = [d for d in read_wiki() if len(d["text"]) > 1200][:64]
        questions = tuple(f"In one sentence: what is {d['title']}?" for d in docs)
        summaries = tuple("Summarise this text in three sentences.\n\n" + d["text"][:1200]
                          for d in docs)
        interactive = Workload("interactive", 0, 12, 16, 0, "interactive", 4, questions)
        batch = Workload("batch", 0, 150, 48, 120000, "batch", 1, summaries)
        pool = open_engine(engine, "llm")  # start the pool once, outside the timing
        # Calibrate on this machine: service seconds of each kind at full concurrency,
        # then a cost model that predicts both, and an interactive SLO of 3x its service.
        if args.service:  # a calibration given: the same setup across runs and machines
            measured = {"interactive": args.service[0], "batch": args.service[1]}
        else:
            measured = {w.name: calibrate(pool, w, capacity) for w in (interactive, batch)}
        cost = fit_cost_model([interactive, batch], measured)
        slo_ms = max(2000.0, round(3 * measured["interactive"] * 2) / 2 * 1000)
        interactive = Workload(**{**interactive.__dict__, "slo_ms": slo_ms})
        print(f"calibration{' (given)' if args.service else ''}: {capacity} concurrent "
              f"requests take {measured['interactive']:.2f}s"
              f" (interactive) and {measured['batch']:.2f}s (batch) each; cost model "
              f"prefill {cost.prefill_tps:.0f} tok/s, decode {cost.decode_tps:.1f} tok/s")

    if args.engine == "llama":
        interactive, batch = offered([interactive, batch], capacity, args.load,
                                     lambda w: measured[w.name])
    workloads = [interactive, batch]
    i_rate, b_rate = interactive.rate, batch.rate
    runs: dict[str, list[dict]] = {}
    for seed in args.seeds:
        traces = {w.name: trace(w, args.duration, seed) for w in workloads}
        print(f"\ncontention benchmark ({args.engine} engine): {args.duration:.0f}s of Poisson "
              f"arrivals at {args.load:.1f}x capacity ({capacity} sequences); interactive "
              f"{i_rate:.2f}/s ({len(traces['interactive'])} requests, SLO p99 "
              f"{interactive.slo_ms / 1000:g}s), batch {b_rate:.2f}/s "
              f"({len(traces['batch'])} requests); seed {seed}")
        for name in args.policies:
            variants = ([(r, 0) for r in args.reserve] + [(0, o) for o in args.overflow]
                        if name == "slo" else [(0, 0)])
            for reserve, overflow in variants:
                label = name if name != "slo" else (
                    f"slo overflow {overflow}" if overflow else f"slo reserve {reserve}")
                r = run_policy(name, workloads, traces, engine, capacity, cost, replicas,
                               reserve, overflow)
                runs.setdefault(label, []).append(r)
                print(f"\n[{label}] goodput {r['goodput_tps']:.1f} tok/s (within SLO), "
                      f"throughput {r['throughput_tps']:.1f} tok/s, over {r['span_s']:.1f}s")
                for pname, st in r["pipelines"].items():
                    print(f"  {pname:<12} p50 {st['p50_ms']:>8.0f} ms  p99 {st['p99_ms']:>8.0f} "
                          f"ms  SLO attainment {st['slo_attainment']:>6.1%}  completed "
                          f"{st['completed']}/{st['arrivals']}  rejected {st['rejected']}")
    if "simultaneous" in runs:
        summarise(runs, args.seeds, "llama" if args.engine == "llama" else "latency")
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
