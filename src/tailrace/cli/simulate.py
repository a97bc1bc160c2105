"""``tailrace simulate``: a pipeline's compiled plan on a virtual clock, under the real
admission policy, engine pools and engine scheduler, with durations from a profile
(``tailrace profile``); answers capacity questions with ``--find`` (docs/simulate.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import TailraceError


def add_parser(sub: Any) -> None:
    """Declare ``tailrace simulate`` and its options in ``sub``."""
    s = sub.add_parser("simulate", help="simulate pipelines at scale from a measured profile")
    s.add_argument("pipelines", nargs="+", metavar="PIPELINE", help="pipeline YAML file(s)")
    s.add_argument("--profile", action="append", required=True, metavar="FILE",
                   help="profile JSON from `tailrace profile` (one per pipeline)")
    w = s.add_mutually_exclusive_group(required=True)
    w.add_argument("--trace", metavar="FILE",
                   help="replay a recorded trace (`tailrace run/serve --trace-out`)")
    w.add_argument("--rate", metavar="R|NAME=R,...",
                   help="open-loop Poisson arrivals, requests per second (per pipeline)")
    s.add_argument("--requests", type=int, default=10_000,
                   help="requests to simulate with --rate (default 10000)")
    s.add_argument("--prompt-tokens", type=int, metavar="N",
                   help="with --rate: each request's prompt tokens (default: the profile's)")
    s.add_argument("--output-tokens", type=int, metavar="N",
                   help="with --rate: tokens generated per request (default: the profile's)")
    s.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    s.add_argument("--replicas", metavar="N|ENGINE=N,...",
                   help="engine replicas per node (default: the engine spec's, else 1)")
    s.add_argument("--admission", default="simultaneous",
                   choices=["simultaneous", "fcfs", "slo"], help="admission policy")
    s.add_argument("--max-in-flight", type=int, default=8,
                   help="requests admitted at once under fcfs/slo (default 8)")
    s.add_argument("--dispatch", choices=["least_work", "prefix_affinity", "round_robin"],
                   help="engine pools' dispatch policy (default: the spec's)")
    s.add_argument("--hop-ms", type=float, metavar="MS",
                   help="one network hop (default 0 on one node, 1.0 on several or on Ray)")
    s.add_argument("--runtime", choices=["local", "ray"], default="local",
                   help="the topology: local (every node runs the plan; default) or ray "
                        "(--runtime ray's: stage actors, one shared actor per engine)")
    s.add_argument("--kill", action="append", default=[], metavar="T:ENGINE:REPLICA",
                   help="kill an engine replica at T seconds (repeatable)")
    s.add_argument("--slow", action="append", default=[], metavar="T:NODE:FACTOR",
                   help="from T seconds, a node's engines run FACTOR times slower")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--find", choices=["replicas", "nodes"],
                   help="search the least replicas per node (or nodes) meeting --slo")
    s.add_argument("--slo", metavar="p99_ms=MS",
                   help="with --find: the p99 latency every pipeline must meet")
    s.add_argument("--engine", help="with --find replicas: which engine (default: the "
                                    "generation engine)")
    s.add_argument("--most", type=int, default=1024,
                   help="with --find: the most replicas/nodes to try (default 1024)")
    s.add_argument("--json", metavar="FILE", help="also write the figures as JSON")


def _triples(items: list[str], flag: str, kinds: tuple[type, ...]) -> list[tuple]:
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) != 3:
            raise TailraceError(f"{flag} {item!r}: expected {flag_form(flag)}")
        try:
            out.append(tuple(k(p) for k, p in zip(kinds, parts, strict=True)))
        except ValueError:
            raise TailraceError(f"{flag} {item!r}: expected {flag_form(flag)}") from None
    return out


def flag_form(flag: str) -> str:
    return {"--kill": "T:ENGINE:REPLICA (seconds, engine name, replica id), e.g. 30:llm:0",
            "--slow": "T:NODE:FACTOR (seconds, node id, slowdown), e.g. 10:0:2.5"}[flag]


def _replicas(text: str | None, engines: list[str]) -> dict[str, int]:
    if not text:
        return {}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().rpartition("=")
        if not value.isdigit() or int(value) < 1:
            raise TailraceError(f"--replicas {text!r}: expected N or ENGINE=N,... with N >= 1")
        if eq and name not in engines:
            raise TailraceError(f"--replicas: no engine {name!r}; engines: {', '.join(engines)}")
        out.update({name: int(value)} if eq else dict.fromkeys(engines, int(value)))
    return out


def simulate(args: argparse.Namespace) -> int:
    from ..simulate import Config, Simulation, load_profile, parse_rates, poisson, read_trace
    from ..simulate.report import render, summarize
    from .main import load_plan

    plans = [load_plan(argparse.Namespace(pipeline=p, no_fuse=False)) for p in args.pipelines]
    profiles = [load_profile(p) for p in args.profile]
    names = [p.name for p in plans]
    engines = sorted({e for p in plans for e in p.pipeline.engines})
    if args.trace:
        arrivals = read_trace(args.trace)
        unknown = sorted({a.pipeline for a in arrivals} - set(names))
        if unknown:
            raise TailraceError(f"{args.trace}: requests for {', '.join(unknown)}, which "
                                f"are not among the pipelines given ({', '.join(names)})")
    else:
        if args.requests < 1:
            raise TailraceError("--requests must be >= 1")
        sizes = dict.fromkeys(names, (args.prompt_tokens, args.output_tokens))
        arrivals = poisson(parse_rates(args.rate, names), args.requests, args.seed, sizes)
    if args.nodes < 1 or args.max_in_flight < 1:
        raise TailraceError("--nodes and --max-in-flight must be >= 1")
    base = Config(nodes=args.nodes, replicas=_replicas(args.replicas, engines),
                  admission=args.admission, max_in_flight=args.max_in_flight,
                  dispatch=args.dispatch, hop_ms=args.hop_ms, runtime=args.runtime,
                  kills=_triples(args.kill, "--kill", (float, str, int)),
                  slow=_triples(args.slow, "--slow", (float, int, float)), seed=args.seed)

    def once(config: Config) -> tuple[Any, dict[str, Any]]:
        try:
            sim = Simulation(plans, profiles, config)
        except ValueError as e:
            raise TailraceError(str(e)) from None
        t0 = time.perf_counter()
        sim.run(arrivals)
        return sim, summarize(sim, arrivals, time.perf_counter() - t0)

    if args.find:
        return _find(args, base, once, plans)
    sim, summary = once(base)
    print(render(sim, summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


def _find(args: argparse.Namespace, base: Any, once: Any, plans: list[Any]) -> int:
    from dataclasses import replace

    from ..simulate.report import find_least

    if not args.slo or not args.slo.startswith("p99_ms="):
        raise TailraceError("--find needs --slo p99_ms=MS (the p99 every pipeline must meet)")
    try:
        budget = float(args.slo.split("=", 1)[1]) / 1000.0
    except ValueError:
        raise TailraceError(f"--slo {args.slo!r}: expected p99_ms=MS") from None
    if args.find == "nodes" and base.runtime == "ray":
        raise TailraceError("--find nodes with --runtime ray: a Ray run's engines are one "
                            "actor each, whatever the nodes; use --find replicas")
    engine = args.engine
    if args.find == "replicas" and engine is None:
        gens = [n for p in plans for n, s in p.pipeline.engines.items()
                if str(s.get("backend")) in ("llama_cpp", "openai", "collab")]
        if not gens:
            raise TailraceError("--find replicas: name the engine with --engine")
        engine = gens[0]

    def run(n: int) -> dict[str, Any]:
        cfg = (replace(base, replicas={**base.replicas, engine: n}) if args.find == "replicas"
               else replace(base, nodes=n))
        return once(cfg)[1]

    def meets(summary: dict[str, Any]) -> bool:
        return all(p["ok"] == p["arrivals"] and p["p99_s"] <= budget
                   for p in summary["pipelines"].values())

    def progress(n: int, summary: dict[str, Any], ok: bool) -> None:
        worst = max(p["p99_s"] for p in summary["pipelines"].values())
        lost = sum(p["arrivals"] - p["ok"] for p in summary["pipelines"].values())
        print(f"  {args.find}={n}: p99 {worst * 1000:.0f}ms, {lost} not answered -> "
              f"{'meets' if ok else 'misses'} {budget * 1000:g}ms", file=sys.stderr)

    what = f"replicas of {engine} per node" if args.find == "replicas" else "nodes"
    n = find_least(run, meets, args.most, progress)
    if n is None:
        print(f"no answer: even {args.most} {what} miss p99 <= {budget * 1000:g}ms")
        return 1
    print(f"least {what} meeting p99 <= {budget * 1000:g}ms with every request answered: {n}")
    return 0
