"""``tailrace demo``: the main job — verified RAG over Wikipedia, offline, end to end.

Builds the ``wiki`` index once (cached), runs the bundled ``wiki-qa-escalate.yaml``
pipeline on a handful of questions whose answers are in the corpus, prints each answer
with its sources, which model answered, whether the small model's answer failed its check
and went to the larger one, and what it cost; then the per-stage latency table.

``answers(result)`` is what it prints per question, without the timings: ``make readme``
puts it in README.md and a test checks that README.md still shows it.
"""

from __future__ import annotations

import sys
from importlib import resources
from typing import Any

from ..api.pipeline import Pipeline
from ..observability import format_stats
from ..runtime import run
from .ingest import ingest

#: the demo pipeline (in the ``tailrace.demo`` package)
PIPELINE = "wiki-qa-escalate.yaml"

#: each question with the answer the bundled corpus gives (its page is in the index)
QUESTIONS = [
    ("Who directed the film 2001: A Space Odyssey?", "Stanley Kubrick"),
    ("Who painted The Starry Night?", "Vincent van Gogh"),
    ("Who wrote the novel Pride and Prejudice?", "Jane Austen"),
    ("In which year did the Titanic sink?", "1912"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci"),
    ("Who commanded the Apollo 11 mission?", "Neil Armstrong"),
]


def pipeline() -> Pipeline:
    with resources.as_file(resources.files("tailrace.demo") / PIPELINE) as path:
        return Pipeline.from_yaml(str(path))


def describe(rec: dict[str, Any], models: dict[str, str]) -> str:
    """``answered by``, escalation and cost of one output record's ``route``."""
    route = rec.get("route") or {}
    tried = route.get("tried") or []
    engine = route.get("engine") or (tried[-1]["engine"] if tried else "?")
    model = f"{engine} ({models.get(engine, '?')})"
    if len(tried) > 1:
        first = tried[0]
        how = f"escalated: {first['engine']}'s answer failed the check ({first['reason']})"
    elif tried and tried[0].get("passed"):
        how = "passed the check"
    else:
        how = "failed the check" + (f" ({tried[0]['reason']})" if tried else "")
    return f"   model: {model}, {how}; cost {float(route.get('spent') or 0.0):.5f}"


def answers(result: Any, models: dict[str, str]) -> str:
    """What the demo prints per question (no timings: the same on every run here)."""
    by_q = {r["question"]: r for r in result.outputs or []}
    out: list[str] = []
    for q, _ in QUESTIONS:
        rec = by_q.get(q)
        out.append(f"Q: {q}")
        if rec is None:
            err = next((e for e in result.errors if e.input.get("question") == q), None)
            out += [f"   error: {err.message if err else 'no output'}", ""]
            continue
        out.append(f"A: {rec['answer'].strip()}")
        out.append(f"   sources: {'; '.join(rec['sources'])}")
        out.append(describe(rec, models))
        out.append("")
    spent = sum(float((r.get("route") or {}).get("spent") or 0.0) for r in result.outputs)
    escalated = sum(1 for r in result.outputs if len((r.get("route") or {}).get("tried")
                                                     or ()) > 1)
    out.append(f"{len(result.outputs)} answers, {escalated} escalated; spent {spent:.5f}")
    return "\n".join(out)


def demo(limit: int | None = None) -> int:
    """Run the demo; ``limit`` indexes only the first N documents (a quick try)."""
    ingest(limit=limit)  # no-op when the cached index is current
    p = pipeline()
    models = {name: str(spec.get("model")) for name, spec in p.engines.items()}
    print(f"pipeline '{p.name}' on {len(QUESTIONS)} questions (models load on first use)\n",
          file=sys.stderr)
    result = run(p, input=[{"question": q} for q, _ in QUESTIONS])
    print(answers(result, models))
    print()
    print(format_stats(result.stats))
    return 0 if not result.errors else 1
