"""Cascade routing vs each single engine on the wiki eval set: answer accuracy and tokens.

The RAG pipeline of ``examples/wiki-qa.yaml`` (MiniLM embed, faiss top-1, refine to 250
tokens) ends in a ``route`` stage. Three runs over the first ``--limit`` FanOutQA dev
sub-questions whose evidence page is in the index:

1. small only: ``cascade: [small, big]`` with a threshold nothing falls below, so every
   answer is the small model's and its confidence (mean token log-probability) is kept;
2. big only: ``rules: []``, ``default: big``;
3. the cascade at ``--threshold``: small first, big when the small answer's confidence
   is below it.

Generation is greedy, so the cascade's answers are predictable from runs 1 and 2; the
bench checks run 3 against that prediction and then sweeps thresholds (the quantiles of
the small model's confidences) from runs 1 and 2 without generating again. Cost is
tokens per engine (prompt + completion) and parameter-weighted tokens (millions of
parameters x tokens / 1e3: the big model's tokens cost 2x here).

    .venv/bin/python bench/cascade.py                    # --limit 60, ~5 min on 2 cores
    .venv/bin/python bench/cascade.py --threshold -0.8 --json cascade.json

Needs the ``wiki`` index (``tailrace ingest``) and an engine that reports token
log-probabilities (``GenerationRequest.logprobs`` -> ``Generation.extra["mean_logprob"]``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import tailrace as tr
from tailrace.operators.retrieval import index_dir
from tailrace.stores.corpus import answer_correct, read_fanoutqa
from tailrace.stores.vector_index import VectorIndex

SMALL = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 2}
BIG = {"backend": "llama_cpp", "model": "gemma3-270m", "n_threads": 2}
PARAMS_M = {"small": 135, "big": 270}  # millions of parameters: the weight of a token
SYSTEM = "Answer the question with a short phrase, using the facts in the context."
PROMPT = "Context:\n{context}\n\nQuestion: {question}"


def reports_logprobs(spec: dict) -> bool:
    """Whether the engine fills ``Generation.extra["mean_logprob"]`` when asked."""
    from dataclasses import fields

    from tailrace.engines import GenerationRequest, open_engine

    if "logprobs" not in {f.name for f in fields(GenerationRequest)}:
        return False
    req = GenerationRequest(messages=({"role": "user", "content": "Hi"},), max_tokens=2,
                            logprobs=True)  # type: ignore[call-arg]
    return "mean_logprob" in open_engine(spec).generate([req])[0].extra


def pipeline(**route: Any) -> tr.Pipeline:
    """The wiki-qa pipeline with its generate stage replaced by ``route(**route)``."""
    p = tr.Pipeline("cascade-bench", engines={
        "embedder": {"backend": "onnx", "model": "minilm-l6-int8", "n_threads": 2},
        "small": SMALL, "big": BIG})
    (p.source(fields=["question"])
     .apply("embed", engine="embedder", input="question", output="qvec")
     .apply("retrieve", index="wiki", query="qvec", k=1, output="passages")
     .apply("refine", input="passages", max_tokens=250, output="context", engine="small")
     .apply("route", id="answer", system=SYSTEM, prompt=PROMPT, max_tokens=32,
            per_engine={"big": {"prompt": PROMPT + "\nAnswer:"}}, **route)
     .apply("select", fields=["question", "answer", "route", "cost"])
     .sink())
    return p


def answers(qs: list, **route: Any) -> tuple[dict[str, dict], float]:
    """question -> output record, and the run's wall time."""
    t0 = time.perf_counter()
    result = tr.run(pipeline(**route), input=[{"question": q.question} for q in qs])
    for e in result.errors[:5]:
        print(f"  error in {e.stage}: {e.message}", file=sys.stderr)
    if result.errors:
        raise SystemExit(f"{len(result.errors)} records failed; see above")
    return {r["question"]: r for r in result.outputs}, time.perf_counter() - t0


def tokens(cost: dict) -> dict[str, int]:
    return {k: v["prompt_tokens"] + v["completion_tokens"] for k, v in cost.items()}


def summary(name: str, qs: list, picks: dict[str, tuple[str, dict]], wall: float | None,
            escalated: int) -> dict[str, Any]:
    """One row: accuracy, escalation rate, tokens per engine, weighted cost."""
    right = sum(answer_correct(picks[q.question][0], q.answers) for q in qs)
    per = {"small": 0, "big": 0}
    for _, cost in picks.values():
        for k, n in tokens(cost).items():
            per[k] += n
    weighted = sum(per[k] * PARAMS_M[k] for k in per) / 1e3
    return {"config": name, "accuracy": right / len(qs), "correct": right,
            "escalated": escalated / len(qs), "small_tokens": per["small"],
            "big_tokens": per["big"], "weighted_cost": weighted, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=60, help="questions (default 60)")
    ap.add_argument("--threshold", type=float, help="cascade threshold (default: the "
                    "median confidence of the small model)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    if not reports_logprobs(SMALL):
        raise SystemExit(f"{SMALL['model']} on {SMALL['backend']} reports no token "
                         "log-probabilities (GenerationRequest.logprobs -> Generation.extra"
                         "['mean_logprob']); a cascade needs them (see docs/stateful.md)")
    index = VectorIndex.open(index_dir("wiki"))
    qs = read_fanoutqa({d["title"] for d in index.docs}, args.limit)
    print(f"{len(qs)} FanOutQA dev sub-questions; small = {SMALL['model']}, "
          f"big = {BIG['model']}", file=sys.stderr)
    small, t_small = answers(qs, cascade=["small", "big"], threshold=-1e9, label="small")
    big, t_big = answers(qs, rules=[], default="big", label="big")
    conf = {q: r["route"]["confidence"][0] for q, r in small.items()}
    ranked = sorted(conf.values())
    threshold = args.threshold if args.threshold is not None else ranked[len(ranked) // 2]
    real, t_real = answers(qs, cascade=["small", "big"], threshold=threshold,
                           label="cascade")

    def simulate(t: float) -> tuple[dict[str, tuple[str, dict]], int]:
        picks, up = {}, 0
        for q in qs:
            s, b = small[q.question], big[q.question]
            if conf[q.question] >= t:
                picks[q.question] = (s["answer"], s["cost"])
            else:
                up += 1
                picks[q.question] = (b["answer"], {**s["cost"], **b["cost"]})
        return picks, up

    predicted, _ = simulate(threshold)
    differ = [q for q in qs if predicted[q.question][0] != real[q.question]["answer"]]
    differ_escalated = sum(real[q.question]["route"]["escalated"] for q in differ)
    right = [conf[q.question] for q in qs
             if answer_correct(small[q.question]["answer"], q.answers)]
    wrong = [conf[q.question] for q in qs
             if not answer_correct(small[q.question]["answer"], q.answers)]
    rows = [summary("small only", qs, {q: (r["answer"], r["cost"]) for q, r in small.items()},
                    t_small, 0),
            summary("big only", qs, {q: (r["answer"], r["cost"]) for q, r in big.items()},
                    t_big, 0),
            summary(f"cascade t={threshold:.3f} (run)", qs,
                    {q: (r["answer"], r["cost"]) for q, r in real.items()}, t_real,
                    sum(r["route"]["escalated"] for r in real.values()))]
    for frac in (0.1, 0.25, 0.5, 0.75, 0.9):
        t = ranked[min(len(ranked) - 1, int(frac * len(ranked)))]
        picks, up = simulate(t)
        rows.append(summary(f"cascade t={t:.3f} (sweep)", qs, picks, None, up))
    print(f"\n{'config':<28} {'acc':>6} {'right':>5} {'escal':>6} {'small tok':>9} "
          f"{'big tok':>8} {'w.cost':>7} {'wall':>6}")
    for r in rows:
        wall = f"{r['wall_s']:.0f}s" if r["wall_s"] is not None else "-"
        print(f"{r['config']:<28} {r['accuracy']:>6.3f} {r['correct']:>5} "
              f"{r['escalated']:>6.2f} {r['small_tokens']:>9} {r['big_tokens']:>8} "
              f"{r['weighted_cost']:>7.0f} {wall:>6}")
    print(f"\ncascade run vs prediction from the single runs: {len(differ)} of {len(qs)} "
          f"answers differ ({differ_escalated} of them escalated to the big model)")
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print(f"small model confidence: right answers {mean(right):.3f} (n={len(right)}), "
          f"wrong answers {mean(wrong):.3f} (n={len(wrong)})")
    if args.json:
        details = [{"question": q.question, "gold": list(q.answers),
                    "small": small[q.question]["answer"], "confidence": conf[q.question],
                    "big": big[q.question]["answer"], "cascade": real[q.question]["answer"],
                    "cascade_route": real[q.question]["route"]} for q in qs]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"questions": len(qs), "threshold": threshold, "rows": rows,
                       "mismatches": len(differ), "details": details}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
