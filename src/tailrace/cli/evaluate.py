"""``tailrace eval``: retrieval and answer quality on the FanOutQA dev sub-questions whose
evidence page is in the index: recall@k and MRR@k of that page in each asked retrieve
mode, and the answer accuracy (``stores.corpus.answer_correct``) of the RAG pipeline and
of a no-retrieval baseline asking the same model. A pipeline that answers with a
``route`` stage's ``escalate:`` is measured per strategy instead: each provider alone and
the pipeline's own verify-then-escalate, with what each spent (the providers' prices).
docs/retrieval.md has the figures.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..api.pipeline import Pipeline
from ..engines import open_engine
from ..errors import PlanError
from ..observability.progress import Progress
from ..operators.retrieval import index_dir
from ..runtime import run
from ..stores.corpus import EvalQuestion, answer_correct, read_fanoutqa

BASELINE_SYSTEM = "Answer the question with a short phrase."


@dataclass(frozen=True)
class EvalReport:
    questions: int
    k: int
    recall_at_k: float  # of the first mode in ``modes``
    mrr_at_k: float
    rag_accuracy: float | None
    baseline_accuracy: float | None
    llm: str | None
    embedder: str
    seconds: float
    details: tuple[dict, ...] = ()
    modes: tuple[dict, ...] = ()  # {"mode", "recall_at_k", "mrr_at_k"} per evaluated mode
    fusion: dict | None = None  # the hybrid fusion used
    # a route pipeline's strategies: {"strategy", "providers", "accuracy", "spend",
    # "spend_per_question", "escalated", "answered_by"} each (``strategies``)
    strategies: tuple[dict, ...] = ()


def retrieval_metrics(index: Any, engine: Any, qs: list[EvalQuestion], k: int, *,
                      mode: str = "dense", fusion: Any = None,
                      allow: Any = None) -> tuple[float, float]:
    """(recall@k, MRR@k) of each question's evidence page title, searching ``index`` in
    ``mode`` (dense, sparse or hybrid with ``fusion``; ``allow``: a filter's selection)."""
    from ..stores.vector_index import Fusion

    texts = [q.question for q in qs]
    if mode == "sparse":
        hits = index.search_text(texts, k, allow=allow)
    elif mode == "dense":
        hits = index.search(engine.embed(texts), k, allow=allow)
    else:
        hits = index.hybrid_search(engine.embed(texts), texts, k, fusion=fusion or Fusion(),
                                   allow=allow)
    recall = mrr = 0.0
    for q, h in zip(qs, hits, strict=True):
        titles = [d["title"] for d in h]
        if q.evidence in titles:
            recall += 1
            mrr += 1 / (titles.index(q.evidence) + 1)
    return recall / len(qs), mrr / len(qs)


def _answers(p: Pipeline, qs: list[EvalQuestion], label: str,
             records: dict[str, dict] | None = None) -> dict[str, str]:
    """Run ``p`` on the questions; question text -> generated answer (and -> the whole
    output record in ``records``)."""
    out: dict[str, str] = {}
    with Progress(len(qs), label, unit="questions") as bar:
        def sink(rec: dict) -> None:
            out[rec["question"]] = rec.get("answer", "")
            if records is not None:
                records[rec["question"]] = rec
            bar.update(1)

        result = run(p, input=[{"question": q.question} for q in qs], output=sink)
    for e in result.errors:
        print(f"  error in stage {e.stage}: {e.message}", file=sys.stderr)
    return out


def _accuracy(answers: dict[str, str], qs: list[EvalQuestion]) -> float:
    return sum(answer_correct(answers.get(q.question, ""), q.answers) for q in qs) / len(qs)


def _details(qs: list[EvalQuestion], rag: dict[str, str], base: dict[str, str]) -> list[dict]:
    """One row per question: gold answers, both generated answers and their correctness."""
    return [{"id": q.id, "question": q.question, "gold": list(q.answers),
             "evidence": q.evidence, "rag": rag.get(q.question, ""),
             "rag_correct": answer_correct(rag.get(q.question, ""), q.answers),
             "baseline": base.get(q.question, ""),
             "baseline_correct": answer_correct(base.get(q.question, ""), q.answers)}
            for q in qs]


def strategy_pipeline(p: Pipeline, route: Any, providers: list[str]) -> Pipeline:
    """``p`` with its route stage escalating over ``providers`` only (one: that provider
    alone, its answer kept whatever the verdict)."""
    import copy

    q = copy.deepcopy(p)
    stage = next(s for s in q.stages if s.id == route.id)
    stage.params["escalate"] = list(providers)
    if len(providers) == 1:
        stage.params["on_fail"] = "keep"
    return q


def evaluate_strategies(p: Pipeline, route: Any, qs: list[EvalQuestion]) -> list[dict]:
    """Accuracy and spend of each provider of ``route``'s ``escalate:`` alone, then of
    the pipeline as written (verify, escalate on a failed verdict), then the bound a
    perfect check would reach (``check_bound``). The pipeline's row has ``check``: how
    its verdicts split the questions, scored against the first provider's own answers."""
    if route.params.get("on_fail", "error") != "keep":
        raise PlanError(f"stage '{route.id}': eval needs on_fail: keep (an unverified "
                        "answer is still an answer to score)")
    field = route.params.get("route") or "route"
    providers = list(route.params["escalate"])
    runs = [(f"{name} only", [name]) for name in providers]
    runs.append(("verify-then-escalate", providers))
    rows: list[dict] = []
    right: dict[str, list[bool]] = {}  # strategy -> per question
    cost: dict[str, list[float]] = {}
    for label, chosen in runs:
        recs: dict[str, dict] = {}
        pipe = p if chosen is providers else strategy_pipeline(p, route, chosen)
        answers = _answers(pipe, qs, f"{label} answers", recs)
        routes = [(recs.get(q.question) or {}).get(field) or {} for q in qs]
        cost[label] = [float(r.get("spent") or 0.0) for r in routes]
        right[label] = [answer_correct(answers.get(q.question, ""), q.answers) for q in qs]
        up = [i for i, r in enumerate(routes) if len(r.get("tried") or ()) > 1]
        by: dict[str, int] = {}
        for r in routes:
            if r.get("engine"):
                by[r["engine"]] = by.get(r["engine"], 0) + 1
        row = {"strategy": label, "providers": chosen,
               "accuracy": sum(right[label]) / len(qs), "spend": sum(cost[label]),
               "spend_per_question": sum(cost[label]) / len(qs),
               "escalated": len(up) / len(qs), "answered_by": by, "answered": len(recs)}
        if chosen is providers:
            first = right[f"{providers[0]} only"]
            kept = [i for i, r in enumerate(routes) if len(r.get("tried") or ()) == 1]
            row["check"] = {"passed": len(kept),
                            "passed_right": sum(right[label][i] for i in kept),
                            "escalated": len(up),
                            "escalated_first_right": sum(first[i] for i in up)}
        rows.append(row)
    rows.append(check_bound(providers, right, cost, len(qs)))
    return rows


def check_bound(providers: list[str], right: dict[str, list[bool]],
                cost: dict[str, list[float]], n: int) -> dict:
    """What verify-then-escalate would reach with a perfect check, from the providers'
    own runs: each question goes up the list until a provider's answer is right (that
    provider's answer stands; none right: the last one's), paying each call on the way.
    An upper bound on accuracy for this list of models, whatever the check."""
    acc = spend = 0.0
    up = 0
    for i in range(n):
        calls = 0
        for name in providers:
            calls += 1
            spend += cost[f"{name} only"][i]
            if right[f"{name} only"][i]:
                acc += 1
                break
        up += calls > 1
    return {"strategy": "perfect check (bound)", "providers": providers, "accuracy": acc / n,
            "spend": spend, "spend_per_question": spend / n, "escalated": up / n,
            "answered_by": {}, "answered": n, "bound": True}


def baseline_pipeline(gen: Any, llm: dict[str, Any]) -> Pipeline:
    """The RAG pipeline's generate stage (same model, instructions, budget) without the
    context: its template with the ``{context}`` part removed."""
    params = {k: v for k, v in gen.params.items() if k not in ("engine", "prompt", "input")}
    template = gen.params.get("prompt") or "{question}"
    if "{context}" in template:
        template = "Question: {question}" + ("\nAnswer:" if template.rstrip().endswith(
            "Answer:") else "")
    if params.get("system"):
        params["system"] = BASELINE_SYSTEM
    p = Pipeline("no-retrieval-baseline", engines={"llm": llm})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", prompt=template, **params,
            batch={"max_size": 8, "max_wait_ms": 0})
     .sink())
    return p


def evaluate(pipeline_path: str, *, k: int = 10, limit: int | None = None,
             answers: bool = True, llm_model: str | None = None,
             modes: tuple[str, ...] | None = None, fusion: dict | None = None) -> EvalReport:
    """Evaluate the pipeline's retrieval in ``modes`` (default: its retrieve stage's mode;
    ``fusion``: hybrid weights, default the stage's) and, with ``answers``, its answers."""
    from ..operators.retrieval import MODES, fusion_of
    from ..stores.filters import compile_filter
    from ..stores.vector_index import VectorIndex

    t0 = time.perf_counter()
    p = Pipeline.from_yaml(pipeline_path)
    retrieve = next((s for s in p.stages if s.op == "retrieve"), None)
    if retrieve is None:
        raise PlanError("the pipeline has no 'retrieve' stage to evaluate", where=pipeline_path)
    index = VectorIndex.open(index_dir(retrieve.params.get("index", "wiki")))
    titles = {d["title"] for d in index.docs}
    qs = read_fanoutqa(titles, limit)
    if not qs:
        raise PlanError("no evaluation question has its evidence page in this index",
                        where=pipeline_path)
    embedder = open_engine({"backend": "onnx", "model": index.model})
    modes = modes or (retrieve.params.get("mode") or "dense",)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise PlanError(f"unknown retrieve mode(s) {', '.join(bad)}; known: "
                        f"{', '.join(MODES)} (or all)", where=pipeline_path)
    try:
        fused = fusion_of(fusion if fusion is not None else retrieve.params.get("fusion") or {})
    except ValueError as e:
        raise PlanError(str(e), where=pipeline_path) from None
    where = retrieve.params.get("filter")
    allow = index.select(compile_filter(where)) if where else None
    per_mode: list[dict[str, Any]] = []
    for m in modes:
        r, rr = retrieval_metrics(index, embedder, qs, k, mode=m, fusion=fused, allow=allow)
        per_mode.append({"mode": m, "recall_at_k": r, "mrr_at_k": rr})
    recall, mrr = per_mode[0]["recall_at_k"], per_mode[0]["mrr_at_k"]
    rag = base = llm = None
    details: list[dict] = []
    strategies: list[dict] = []
    gen = next((s for s in p.stages if s.op == "generate"), None)
    route = next((s for s in p.stages if s.op == "route" and s.params.get("escalate")), None)
    if answers and gen is None and route is not None:
        if llm_model:
            raise PlanError(f"--llm replaces a generate stage's model; stage '{route.id}' "
                            f"routes between {', '.join(route.params['escalate'])}: edit "
                            "its engines instead", where=pipeline_path)
        strategies = evaluate_strategies(p, route, qs)
    elif answers and gen is not None:
        spec = dict(p.engines[gen.params["engine"]])
        if llm_model:
            spec["model"] = llm_model
            p.engines[gen.params["engine"]] = spec
        llm = spec.get("model")
        rag_answers = _answers(p, qs, f"RAG answers ({llm})")
        base_answers = _answers(baseline_pipeline(gen, spec), qs, f"baseline answers ({llm})")
        rag, base = _accuracy(rag_answers, qs), _accuracy(base_answers, qs)
        details = _details(qs, rag_answers, base_answers)
    return EvalReport(len(qs), k, recall, mrr, rag, base, llm, index.model,
                      time.perf_counter() - t0, tuple(details), tuple(per_mode),
                      asdict(fused) if "hybrid" in modes else None, tuple(strategies))


def _se(r: EvalReport) -> float:
    """The standard error of the strategies' largest accuracy (a binomial proportion)."""
    p = max(row["accuracy"] for row in r.strategies)
    return (p * (1 - p) / max(1, r.questions)) ** 0.5


def format_report(r: EvalReport) -> str:
    lines = [f"{r.questions} FanOutQA dev sub-questions with their evidence page in the "
             f"index (embedder {r.embedder})"]
    for m in r.modes:
        lines.append(f"  {m['mode']:<6} retrieval recall@{r.k}: {m['recall_at_k']:.3f}   "
                     f"MRR@{r.k}: {m['mrr_at_k']:.3f}")
    if r.fusion:
        f = r.fusion
        lines.append(f"  (hybrid: reciprocal rank fusion k={f['k']}, weights dense "
                     f"{f['dense']:g} sparse {f['sparse']:g}, top {f['candidates']} of each)")
    if r.strategies:
        lines.append(f"  {'strategy':<22} {'accuracy':>8} {'spend':>9} {'per question':>13} "
                     f"{'per cost':>9} {'escalated':>9}  answered by")
        for row in r.strategies:
            by = ", ".join(f"{k} {v}" for k, v in row["answered_by"].items())
            per = row["accuracy"] / row["spend_per_question"] if row["spend"] else float("nan")
            lines.append(f"  {row['strategy']:<22} {row['accuracy']:>8.3f} "
                         f"{row['spend']:>9.4f} {row['spend_per_question']:>13.5f} "
                         f"{per:>9.1f} {row['escalated']:>9.0%}  "
                         + (by or "(from the runs above, not a run)"))
        for row in r.strategies:
            c = row.get("check")
            if c:
                first = row["providers"][0]
                lines.append(f"  the check passed {c['passed']} of {first}'s answers "
                             f"({c['passed_right']} right) and escalated {c['escalated']} "
                             f"({c['escalated_first_right']} of which {first} alone answered "
                             "right)")
        lines.append("  (per cost: accuracy / spend per question; an accuracy on "
                     f"{r.questions} questions is +/-{1.96 * _se(r):.3f} at 95%)")
    if r.rag_accuracy is not None:
        lines.append(f"  answer accuracy ({r.llm}): RAG {r.rag_accuracy:.3f}   "
                     f"no-retrieval baseline {r.baseline_accuracy:.3f}")
    lines.append(f"  ({r.seconds:.0f}s)")
    return "\n".join(lines)
