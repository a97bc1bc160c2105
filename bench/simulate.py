"""The capacity simulator (`tailrace simulate`): how close it comes to real runs on this
machine, what it projects at scale, and how fast it simulates.

    python bench/simulate.py fidelity            # contention workload, real vs simulated
    python bench/simulate.py fidelity-rag        # the wiki-qa RAG pipeline, real vs simulated
    python bench/simulate.py fidelity-ray        # the same on a 3-node Ray cluster
    python bench/simulate.py fidelity-contention-ray   # the contention workload on Ray
    python bench/simulate.py scale               # 1..1,024 nodes, dispatch and admission
    python bench/simulate.py speed               # simulated requests per wall second
    python bench/simulate.py all

**fidelity** replays bench/contention.py's workload (an interactive and a batch pipeline
sharing one engine, the latency-model server, Poisson arrivals at 1.5x capacity) for
real under each admission policy, then simulates the SAME arrival traces with a profile
measured on the same server (`tailrace profile`'s code: the engine's step model fitted to
calls alone, the stages from runs of the pipelines), and prints each pipeline's p50, p99
and throughput both ways with the relative error, per seed and as median [min - max].
Each real trace is simulated ``--replays`` times (the same arrivals, other seeds for the
durations drawn): the simulated figure is their median, printed with their [min - max].

**fidelity-rag** runs the bundled wiki-qa pipeline (ONNX embedder, faiss, SmolLM2 on
llama.cpp, 2 threads) on this 2-core machine with paced Poisson arrivals through
`tr.run` with a trace (`--trace-out`'s writer), profiles it, and replays the recorded
trace in the simulator.

**fidelity-ray** runs the same pipeline on a 3-node ``ray.cluster_utils`` cluster (its
raylets all on this machine) with ``tr.run(runtime="ray")`` and compares it with
``simulate --runtime ray`` (stage replicas placed once, one engine actor each, a hop
into every stage and two per engine call). The hop is calibrated first on 12 requests
sent 2.5 s apart: their median real latency less the simulated one at hop 0, per hop.

**fidelity-contention-ray** runs the contention workload with both pipelines on that
cluster (``tr.run(runtime="ray", admission=gate)``, one gate in the driver, each generate
stage at ``--ray-replicas`` replicas: 8, the server's capacity, where the local run has
32 asyncio replicas and Ray would start 32 actor processes) and compares it with
``simulate --runtime ray`` of the same plans; the hop is calibrated on 12 interactive
requests sent alone.

**scale** takes a profile (default: the wiki-qa profile fitted here, or --profile) and
projects, for 1 to 1,024 nodes: the most requests per second each node count sustains
with p99 within the pipeline's SLO (searched), under least_work and prefix_affinity
dispatch; then the contention workload at 1.5x overload under slo and simultaneous
admission, p99 of the interactive pipeline. SAGE's claims (11.4x throughput at 16 nodes,
-57% P99 under contention) are printed beside the same figures.

What this cannot show: the simulator's model is the profile's (each stage and engine
alone on this machine); CPU contention between stages, Python's GIL, Ray's object
transfer and anything a 2-core machine does not have (a real 16- or 1,024-node network)
are not in it: see docs/simulate.md, "What is not simulated".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tailrace as tr  # noqa: E402
from tailrace.compiler import compile_pipeline  # noqa: E402
from tailrace.control.gate import approx_prompt_tokens  # noqa: E402
from tailrace.control.slo import CostModel, PipelineSLO  # noqa: E402
from tailrace.simulate import (  # noqa: E402
    Arrival,
    Config,
    Profile,
    Simulation,
    load_profile,
    poisson,
)
from tailrace.simulate.measure import Settings, profile_pipeline  # noqa: E402

HERE = Path(__file__).resolve().parent
PROFILES = HERE / "profiles"


def spread(xs: list[float], fmt: str = "{:.1%}") -> str:
    if len(xs) == 1:
        return fmt.format(xs[0])
    return (f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))} - "
            f"{fmt.format(max(xs))}]")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def figures(lat: dict[str, list[float]], span: float) -> dict[str, dict[str, float]]:
    """p50, p99 (seconds) and throughput (requests/s over ``span``) per pipeline."""
    return {name: {"p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "rps": len(xs) / span}
            for name, xs in lat.items()}


def sim_figures(sim: Simulation) -> dict[str, dict[str, float]]:
    lat: dict[str, list[float]] = {}
    ends = [e for _, _, e, o in sim.results if o == "ok"]
    for name, a, e, o in sim.results:
        if o == "ok":
            lat.setdefault(name, []).append(e - a)
    return figures(lat, max(ends))


def replayed(run: Any, replays: int, seed: int) -> tuple[dict, dict, float]:
    """Figures of ``replays`` simulations of one arrival trace (``run(seed)`` -> a finished
    ``Simulation``; seeds differ, arrivals do not): the median of each figure, its
    [min, max] over the replays, and the wall seconds of one replay. One replay's p99 of
    a few hundred requests moves by several percent with the draws alone; the median
    is the simulator's answer for that trace."""
    runs, wall = [], 0.0
    for j in range(replays):
        t0 = time.perf_counter()
        runs.append(sim_figures(run(seed * 1000 + j)))
        wall += time.perf_counter() - t0
    med: dict = {}
    band: dict = {}
    for name in runs[0]:
        med[name], band[name] = {}, {}
        for fig in runs[0][name]:
            xs = [r[name][fig] for r in runs if name in r]
            med[name][fig] = statistics.median(xs)
            band[name][fig] = (min(xs), max(xs))
    return med, band, wall / replays


def error_table(real: dict, simulated: dict, errs: dict[str, list[float]],
                band: dict | None = None) -> None:
    print(f"  {'pipeline':<12} {'figure':<6} {'real':>9} {'simulated':>10} {'error':>8}"
          + ("   replays' [min - max]" if band else ""))
    for name, r in real.items():
        s = simulated.get(name, {})
        for fig in ("p50", "p99", "rps"):
            rv, sv = r[fig], s.get(fig, float("nan"))
            err = (sv - rv) / rv if rv else float("nan")
            errs.setdefault(f"{name} {fig}", []).append(abs(err))
            unit = "/s" if fig == "rps" else "s"
            lo, hi = (band or {}).get(name, {}).get(fig, (None, None))
            print(f"  {name:<12} {fig:<6} {rv:>8.3f}{unit:<1} {sv:>9.3f}{unit:<1} "
                  f"{err:>+8.1%}" + (f"   [{lo:.3f} - {hi:.3f}]" if lo is not None else ""))


# -- fidelity: the contention workload on the latency-model server ------------------------

def fifo(prof: Profile) -> Profile:
    """``prof`` with its engines marked first come, first served: the latency-model
    server ignores a request's priority (llama.cpp would rank by it)."""
    from dataclasses import replace

    return replace(prof, engines={k: replace(e, ranks=False) for k, e in prof.engines.items()})


def contention_profile(plan: Any, texts: tuple[str, ...], capacity: int) -> Profile:
    """One contention pipeline profiled as `tailrace profile --n-seq-max` does."""
    records = [{"text": t, "t0": 0.0} for t in texts]
    report = profile_pipeline(plan, records, lambda p, recs: tr.run(p, input=recs),
                              Settings(records=len(records), repeat=2, n_seq_max=capacity),
                              stream=sys.stderr)
    return fifo(report.profile)


def fidelity(args: argparse.Namespace, runtime: str = "local") -> dict[str, list[float]]:
    """The contention workload, real vs simulated, under each admission policy; on Ray
    (``runtime="ray"``) with both pipelines on a ``--ray-nodes`` cluster, their generate
    stages at ``--ray-replicas`` replicas, and the hop calibrated first."""
    import contention as c

    lat = c.latency_setup(args.load)
    cluster = None
    try:
        if runtime == "ray":
            lat.replicas = args.ray_replicas
            cluster = ray_cluster(args.ray_nodes, 2)
        plans, profiles = contention_plans(lat, args.reprofile)
        e = profiles[0].engines["llm"]
        print(f"engine step model fitted on the server: {dict(e.model.coef)} "
              f"(fit error {e.model.error:.1%}, cv {e.model.cv:.2f})")

        def real(policy: str, traces: dict) -> tuple[dict, float]:
            r = c.run_policy(policy, lat.workloads, traces, lat.engine, lat.capacity,
                             lat.cost, lat.replicas, reserve=2, runtime=runtime)
            return {n: {"p50": p["p50_ms"] / 1000, "p99": p["p99_ms"] / 1000,
                        "rps": p["completed"] / r["span_s"]}
                    for n, p in r["pipelines"].items()}, r["span_s"]

        def arrivals_of(traces: dict) -> list[Arrival]:
            return sorted((Arrival(t, w.name, approx_prompt_tokens(
                {"text": (w.texts or (" ".join(["word"] * w.prompt_words),))[0]}),
                w.max_tokens) for w in lat.workloads for t in traces[w.name]),
                key=lambda a: a.t)

        hop_ms = None
        if runtime == "ray":
            hop_ms = contention_hop(lat, plans, profiles, real, arrivals_of, args)
        errs: dict[str, list[float]] = {}
        for seed in args.seeds:
            traces = {w.name: c.trace(w, args.duration, seed) for w in lat.workloads}
            for policy in args.policies:
                real_figs, span = real(policy, traces)
                arrivals = arrivals_of(traces)
                med, band, wall = replayed(
                    lambda s, policy=policy, arrivals=arrivals: simulate(
                        plans, profiles, policy, lat, s, arrivals, runtime=runtime,
                        hop_ms=hop_ms), args.replays, seed)
                print(f"\nseed {seed}, admission {policy}{', Ray' if cluster else ''}: "
                      f"{len(arrivals)} requests (real run {span:.1f}s; simulated in "
                      f"{wall:.2f}s, median of {args.replays} replays)")
                error_table(real_figs, med, errs, band)
        return errs
    finally:
        lat.server.stop()
        if cluster is not None:
            ray_down(cluster)


def contention_hop(lat: Any, plans: list, profiles: list, real: Any, arrivals_of: Any,
                   args: argparse.Namespace) -> float:
    """The Ray hop for the contention workload: 12 interactive requests sent 2 s apart
    (each alone, after a warm-up that places the hosts), their median real latency less
    the simulated one at hop 0, per hop the simulator charges."""
    inter = lat.workloads[0].name
    empty = {w.name: [] for w in lat.workloads}
    for w in lat.workloads:  # hosts and the engine actor up
        real("simultaneous", {**empty, w.name: [0.1 * i for i in range(4)]})
    calib = {**empty, inter: [2.0 * i for i in range(12)]}
    figs, _ = real("simultaneous", calib)
    arrivals = arrivals_of(calib)
    alone, _, _ = replayed(lambda s: simulate(plans, profiles, "simultaneous", lat, s,
                                              arrivals, runtime="ray", hop_ms=0.0),
                           args.replays, 1)
    return hop_per_call(plans[0], profiles[0], 12, figs[inter]["p50"], alone[inter]["p50"])


def hop_per_call(plan: Any, prof: Profile, n: int, real_s: float, sim_s: float) -> float:
    """The hop (ms) that makes up the difference between the median real latency of ``n``
    lone requests and the simulated one at hop 0, over the hops ``simulate --runtime
    ray`` charges a request of ``plan`` (one into each stage, two per engine call)."""
    probe = Simulation([plan], [prof], Config(runtime="ray"))
    hops = sum(1 + 2 * (st.pool is not None) for st in probe.pipelines[plan.name].stages)
    hop_ms = max(0.0, (real_s - sim_s) / hops * 1000)
    print(f"calibration: {n} {plan.name} requests alone, median {real_s:.3f} s real, "
          f"{sim_s:.3f} s simulated at hop 0 -> hop {hop_ms:.2f} ms x {hops} hops")
    return hop_ms


def contention_plans(lat: Any, reprofile: bool) -> tuple[list, list[Profile]]:
    """The contention pipelines compiled, and their profiles: measured on the running
    latency-model server (kept in bench/profiles/contention-*.json; --reprofile)."""
    import contention as c

    plans, profiles = [], []
    for w in lat.workloads:
        plan = compile_pipeline(c.pipeline(w, lat.engine, lat.replicas))
        path = PROFILES / f"contention-{w.name}.json"
        if reprofile or not path.exists():
            texts = w.texts or (" ".join(["word"] * w.prompt_words),)
            PROFILES.mkdir(exist_ok=True)
            contention_profile(plan, texts * 8, lat.capacity).save(path)
        plans.append(plan)
        profiles.append(load_profile(path))
    return plans, profiles


def simulate(plans: list, profiles: list, policy: str, lat: Any, seed: int,
             arrivals: list[Arrival], nodes: int = 1, runtime: str = "local",
             hop_ms: float | None = None) -> Simulation:
    slos = {w.name: PipelineSLO(w.slo_ms, w.priority, w.weight, w.name) for w in lat.workloads}
    cost = CostModel(lat.cost.prefill_tps, lat.cost.decode_tps, lat.cost.overhead_s)
    options: dict[str, Any] = {"cost_model": cost, "slos": slos}
    if policy == "slo":
        options["reserve"] = 2
    sim = Simulation(plans, profiles, Config(
        nodes=nodes, admission=policy, max_in_flight=lat.capacity * nodes,
        admission_options=options, seed=seed, runtime=runtime, hop_ms=hop_ms))
    t0 = time.perf_counter()
    sim.run(arrivals)
    sim.wall = time.perf_counter() - t0  # type: ignore[attr-defined]
    return sim


# -- fidelity: the RAG pipeline -----------------------------------------------------------

def wiki_records(plan: Any, n: int) -> list[dict]:
    from tailrace.cli.profile import default_records

    return default_records(plan, str(Path(tr.__file__).parent / "demo" / "wiki-qa.yaml"),
                           n)[0]


def fidelity_rag(args: argparse.Namespace) -> dict[str, list[float]]:
    from tailrace.runtime.trace_out import TraceWriter
    from tailrace.simulate import read_trace

    path = Path(tr.__file__).parent / "demo" / "wiki-qa.yaml"
    plan = compile_pipeline(tr.Pipeline.from_yaml(str(path)))
    records = wiki_records(plan, 64)
    prof_path = PROFILES / "wiki-qa.json"
    if args.reprofile or not prof_path.exists():
        report = profile_pipeline(plan, records, lambda p, recs: tr.run(p, input=recs),
                                  Settings(records=args.profile_records, repeat=2),
                                  stream=sys.stderr)
        PROFILES.mkdir(exist_ok=True)
        report.profile.save(prof_path)
    prof = load_profile(prof_path)
    errs: dict[str, list[float]] = {}
    for seed in args.seeds:
        offsets = [a.t for a in poisson({"wiki-qa": args.rag_rate}, args.rag_requests, seed)]
        trace_file = Path(f"/tmp/tailrace-rag-trace-{seed}.jsonl")
        writer = TraceWriter.open(str(trace_file))

        tr.run(plan, input=paced(records, offsets, time.perf_counter() + 0.2), trace=writer)
        writer.close()
        recorded = read_trace(trace_file)
        lat = [a.latency_s for a in recorded if a.outcome == "ok" and a.latency_s is not None]
        span = max(a.t + (a.latency_s or 0) for a in recorded) - min(a.t for a in recorded)
        real_figs = figures({"wiki-qa": lat}, span)
        def replay(s: int, recorded: list = recorded) -> Simulation:
            sim = Simulation([plan], [prof], Config(seed=s))
            sim.run(recorded)
            return sim

        med, band, wall = replayed(replay, args.replays, seed)
        print(f"\nseed {seed}: {len(recorded)} requests at {args.rag_rate}/s "
              f"(simulated in {wall:.2f}s, median of {args.replays} replays)")
        error_table(real_figs, med, errs, band)
    return errs


async def paced(records: list[dict], offsets: list[float], start: float,
                on_send: Any = None) -> Any:
    """A copy of ``records[i % len]`` at ``start + offsets[i]`` (perf_counter seconds),
    each handed to ``on_send`` as it goes."""
    for i, off in enumerate(offsets):
        delay = start + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = dict(records[i % len(records)])
        if on_send is not None:
            on_send(rec)
        yield rec


def ray_cluster(nodes: int, cpus: int) -> Any:
    """Ray's own test cluster (``ray.cluster_utils.Cluster``: ``nodes`` raylets on this
    machine, ``cpus`` logical CPUs each), this process connected to it."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    return cluster


def ray_paced(plan: Any, records: list[dict], offsets: list[float]) -> list[Arrival]:
    """``records[i]`` sent at ``offsets[i]`` through ``tr.run(runtime="ray")``: each
    request's arrival and latency, taken by its question (``--trace-out`` is refused on
    Ray: the driver sees sends and sink records, not the hosts' requests)."""
    from collections import deque

    sent: dict[str, deque] = {}
    done: list[Arrival] = []
    start = time.perf_counter() + 0.2

    def on_send(rec: dict) -> None:
        sent.setdefault(rec["question"], deque()).append(time.perf_counter())

    def sink(rec: dict) -> None:
        now = time.perf_counter()
        t = sent[rec["question"]].popleft()
        done.append(Arrival(t - start, plan.name, approx_prompt_tokens(
            {"question": rec["question"]}), None, now - t, "ok"))

    result = tr.run(plan, input=paced(records, offsets, start, on_send), output=sink,
                    runtime="ray")
    for e in result.errors:
        print(f"  error in {e.stage}: {e.message}", file=sys.stderr)
    return sorted(done, key=lambda a: a.t)


def fidelity_rag_ray(args: argparse.Namespace) -> dict[str, list[float]]:
    """wiki-qa on a 3-node ``ray.cluster_utils`` cluster (all on this machine) against
    ``simulate --runtime ray``. The hop is calibrated first, on requests sent 2.5 s apart
    (each alone): the real latency less the simulated one at hop 0, per hop."""

    path = Path(tr.__file__).parent / "demo" / "wiki-qa.yaml"
    plan = compile_pipeline(tr.Pipeline.from_yaml(str(path)))
    records = wiki_records(plan, max(64, args.rag_requests))
    prof = load_profile(PROFILES / "wiki-qa.json")
    cluster = ray_cluster(args.ray_nodes, 2)
    try:
        tr.run(plan, input=records[:4], runtime="ray")  # hosts and engine actors up
        calib = ray_paced(plan, records[-12:], [2.5 * i for i in range(12)])

        def sim_at(hop_ms: float, arrivals: list[Arrival], seed: int) -> Simulation:
            sim = Simulation([plan], [prof], Config(runtime="ray", nodes=args.ray_nodes,
                                                   hop_ms=hop_ms, seed=seed))
            sim.run(arrivals)
            return sim

        alone, _, _ = replayed(lambda s: sim_at(0.0, calib, s), args.replays, 1)
        hop_ms = hop_per_call(plan, prof, len(calib),
                              statistics.median(a.latency_s for a in calib),
                              alone[plan.name]["p50"])
        errs: dict[str, list[float]] = {}
        for seed in args.seeds:
            offsets = [a.t for a in poisson({"wiki-qa": args.rag_rate}, args.rag_requests,
                                            seed)]
            recorded = ray_paced(plan, records, offsets)
            lat = [a.latency_s for a in recorded if a.latency_s is not None]
            span = max(a.t + (a.latency_s or 0) for a in recorded) - min(a.t for a in recorded)
            med, band, wall = replayed(
                lambda s, recorded=recorded: sim_at(hop_ms, recorded, s), args.replays, seed)
            print(f"\nseed {seed}, Ray ({args.ray_nodes} nodes): {len(recorded)} of "
                  f"{len(offsets)} requests at {args.rag_rate}/s (simulated in {wall:.2f}s, "
                  f"median of {args.replays} replays)")
            error_table(figures({"wiki-qa": lat}, span), med, errs, band)
        return errs
    finally:
        ray_down(cluster)


def ray_down(cluster: Any) -> None:
    import ray

    from tailrace.runtime.ray.engines import shutdown_engines

    shutdown_engines()
    ray.shutdown()
    cluster.shutdown()


# -- scale ---------------------------------------------------------------------------------

def sustained(plans: list, profiles: list, config: Config, name: str, budget_s: float,
              per_node_guess: float, requests: int, steps: int = 6) -> tuple[float, float]:
    """The highest Poisson rate (requests/s) at which p99 stays within ``budget_s`` with
    every request answered, searched by bisection; and the p99 there."""
    def p99_at(rate: float) -> float | None:
        sim = Simulation(plans, profiles, config)
        sim.run(poisson({name: rate}, requests, config.seed))
        lat = [e - a for _, a, e, o in sim.results if o == "ok"]
        return pct(lat, 0.99) if len(lat) == requests else None

    lo, hi = 0.0, per_node_guess * config.nodes
    while (p := p99_at(hi)) is not None and p <= budget_s:
        lo, hi = hi, hi * 2
    best_p = float("nan")
    for _ in range(steps):
        mid = (lo + hi) / 2
        p = p99_at(mid)
        if p is not None and p <= budget_s:
            lo, best_p = mid, p
        else:
            hi = mid
    return lo, best_p


def scale(args: argparse.Namespace) -> None:
    if args.only_contention:
        contention_scale(args)
        return
    path = Path(tr.__file__).parent / "demo" / "wiki-qa.yaml"
    plan = compile_pipeline(tr.Pipeline.from_yaml(str(path)))
    prof = load_profile(args.profile or PROFILES / "wiki-qa.json")
    budget = (plan.pipeline.slo or {}).get("p99_ms", 3000) / 1000.0
    print(f"\nscale: wiki-qa from {args.profile or PROFILES / 'wiki-qa.json'}; the most "
          f"requests/s with p99 <= {budget:g}s, {args.scale_requests} requests a point")
    print(f"  {'nodes':>6} {'dispatch':<16} {'req/s':>9} {'x 1 node':>9} {'p99':>7}")
    base: dict[str, float] = {}
    rows = []
    for dispatch in ("least_work", "prefix_affinity"):
        guess = None
        for nodes in args.nodes:
            cfg = Config(nodes=nodes, dispatch=dispatch, seed=1)
            rate, p99 = sustained([plan], [prof], cfg, "wiki-qa", budget,
                                  guess or 1.0, max(args.scale_requests, 20 * nodes),
                                  args.steps)
            guess = rate / nodes if rate else guess
            base.setdefault(dispatch, rate)
            ratio = rate / base[dispatch] if base[dispatch] else float("nan")
            rows.append({"nodes": nodes, "dispatch": dispatch, "rps": rate, "x": ratio,
                         "p99_s": p99})
            print(f"  {nodes:>6} {dispatch:<16} {rate:>9.2f} {ratio:>8.1f}x {p99:>6.2f}s",
                  flush=True)
    print("  SAGE (paper): 11.4x throughput at 16 nodes")
    contention_scale(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def contention_scale(args: argparse.Namespace) -> None:
    """The contention workload's profile (fitted once on the latency server) on N nodes
    at 1.5x their capacity: interactive p99 under slo vs simultaneous admission."""
    import contention as c

    lat = c.latency_setup(1.5)
    try:
        plans, profs = contention_plans(lat, args.reprofile)
    finally:
        lat.server.stop()
    print(f"\ncontention at scale: interactive + batch at 1.5x capacity on N nodes "
          f"({args.contention_s:g}s of arrivals), interactive p99")
    print(f"  {'nodes':>6} {'simultaneous':>13} {'slo':>9} {'change':>8}")
    for nodes in args.nodes:
        p99 = {}
        for policy in ("simultaneous", "slo"):
            arrivals = []
            for w in lat.workloads:
                n = int(w.rate * nodes * args.contention_s)
                tokens = approx_prompt_tokens({"text": " ".join(["word"] * w.prompt_words)})
                arrivals += [Arrival(a.t, w.name, tokens, w.max_tokens)
                             for a in poisson({w.name: w.rate * nodes}, n, nodes)]
            arrivals.sort(key=lambda a: a.t)
            # N nodes: N engine replicas, N x the stages' replicas, N x the admission limit
            sim = simulate(plans, profs, policy, lat, 1, arrivals, nodes)
            p99[policy] = sim_figures(sim).get("interactive", {}).get("p99", float("nan"))
        change = p99["slo"] / p99["simultaneous"] - 1
        print(f"  {nodes:>6} {p99['simultaneous']:>12.2f}s {p99['slo']:>8.2f}s "
              f"{change:>+8.0%}", flush=True)
    print("  SAGE (paper): P99 -57% under multi-pipeline contention vs simultaneous")


# -- speed ----------------------------------------------------------------------------------

def speed(args: argparse.Namespace) -> None:
    path = Path(tr.__file__).parent / "demo" / "wiki-qa.yaml"
    plan = compile_pipeline(tr.Pipeline.from_yaml(str(path)))
    prof = load_profile(args.profile or PROFILES / "wiki-qa.json")
    print("\nspeed: wiki-qa at ~80% of capacity, simulated requests per wall second")
    for nodes, n in args.speed_points:
        cfg = Config(nodes=nodes, seed=1)
        rate, _ = sustained([plan], [prof], Config(nodes=1, seed=1), "wiki-qa", 3.0, 1.0, 2000)
        sim = Simulation([plan], [prof], cfg)
        arrivals = poisson({"wiki-qa": 0.8 * rate * nodes}, n, 1)
        t0 = time.perf_counter()
        sim.run(arrivals)
        dt = time.perf_counter() - t0
        print(f"  {nodes:>5} nodes, {n:>8} requests ({sim.loop.now():.0f}s simulated): "
              f"{dt:7.1f}s wall, {n / dt:8.0f} requests/s, {sim.loop.events / dt:8.0f} "
              "events/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["fidelity", "fidelity-rag", "fidelity-ray",
                                     "fidelity-contention-ray", "scale", "speed", "all"])
    ap.add_argument("--ray-nodes", type=int, default=3, help="fidelity-*ray: cluster nodes")
    ap.add_argument("--ray-replicas", type=int, default=8,
                    help="fidelity-contention-ray: replicas of each generate stage")
    ap.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9])
    ap.add_argument("--duration", type=float, default=30.0,
                    help="fidelity: seconds of arrivals per run")
    ap.add_argument("--load", type=float, default=1.5, help="fidelity: offered load")
    ap.add_argument("--replays", type=int, default=9,
                    help="fidelity: simulations of each real trace (their median is compared)")
    ap.add_argument("--policies", nargs="+", default=["simultaneous", "slo"])
    ap.add_argument("--rag-rate", type=float, default=2.0, help="fidelity-rag: requests/s")
    ap.add_argument("--rag-requests", type=int, default=200)
    ap.add_argument("--profile-records", type=int, default=32)
    ap.add_argument("--reprofile", action="store_true", help="measure the profiles again")
    ap.add_argument("--profile", help="scale/speed: a wiki-qa profile (default: measured)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--scale-requests", type=int, default=4000)
    ap.add_argument("--contention-s", type=float, default=60.0)
    ap.add_argument("--speed-points", type=lambda s: tuple(int(x) for x in s.split("x")),
                    nargs="+", default=[(1, 100_000), (1024, 100_000)],
                    help="NODESxREQUESTS, e.g. 1024x1000000")
    ap.add_argument("--steps", type=int, default=6, help="scale: bisection steps")
    ap.add_argument("--only-contention", action="store_true",
                    help="scale: only the contention part")
    ap.add_argument("--json", help="scale: write the rows as JSON")
    args = ap.parse_args()
    todo = (["fidelity", "fidelity-rag", "fidelity-ray", "fidelity-contention-ray", "scale",
             "speed"] if args.what == "all"
            else [args.what])
    for what in todo:
        if what.startswith("fidelity"):
            errs = {"fidelity": fidelity, "fidelity-rag": fidelity_rag,
                    "fidelity-ray": fidelity_rag_ray,
                    "fidelity-contention-ray": lambda a: fidelity(a, "ray")}[what](args)
            print(f"\n{what}: absolute relative error over {len(args.seeds)} seeds, "
                  "median [min - max]")
            for k, v in errs.items():
                print(f"  {k:<22} {spread(v)}")
        else:
            {"scale": scale, "speed": speed}[what](args)


if __name__ == "__main__":
    main()
