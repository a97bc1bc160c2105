"""The demo's six questions under each strategy of its pipeline: each model alone, then
verify-then-escalate as written. Prints every answer, whether it contains the gold
answer (FanOutQA's scoring, `answer_correct`) and what each strategy spent.

    python bench/demo_strategies.py [PIPELINE.yaml]    # default: the demo's pipeline

What this shows that `tailrace eval` cannot: the scoring against a reader. An answer
that names the gold among other claims ("Elizabeth Bennet ... written by Jane Austen")
is counted right by the scoring; read it and judge.
"""

from __future__ import annotations

import sys

import tailrace as tr
from tailrace import Pipeline
from tailrace.cli.demo import QUESTIONS, pipeline
from tailrace.cli.evaluate import strategy_pipeline
from tailrace.stores.corpus import answer_correct


def main() -> None:
    p = Pipeline.from_yaml(sys.argv[1]) if len(sys.argv) > 1 else pipeline()
    route = next(s for s in p.stages if s.op == "route")
    providers = list(route.params["escalate"])
    runs = [(f"{n} only", strategy_pipeline(p, route, [n])) for n in providers]
    runs.append(("verify-then-escalate", p))
    for label, pipe in runs:
        res = tr.run(pipe, input=[{"question": q} for q, _ in QUESTIONS])
        by = {r["question"]: r for r in res.outputs}
        right = spent = 0.0
        print(f"\n{label}")
        for q, gold in QUESTIONS:
            rec = by.get(q, {})
            answer = " ".join(str(rec.get("answer", "")).split())
            ok = answer_correct(answer, (gold,))
            right += ok
            spent += float((rec.get("route") or {}).get("spent") or 0.0)
            print(f"  {'contains' if ok else 'lacks   '} {gold!r:<20} {q}\n      -> {answer[:200]}")
        print(f"  {label}: {right:.0f} of {len(QUESTIONS)} contain the gold answer; "
              f"spent {spent:.5f}")


if __name__ == "__main__":
    main()
