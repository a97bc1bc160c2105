"""``tailrace demo``: the main job — RAG over Wikipedia, offline, end to end.

Builds the ``wiki`` index once (cached), runs the bundled ``wiki-qa.yaml`` pipeline on a
handful of questions, prints each answer with its source titles, then the per-stage
latency table.
"""

from __future__ import annotations

import sys
from importlib import resources

from ..api.pipeline import Pipeline
from ..observability import format_stats
from ..runtime import run
from .ingest import ingest

QUESTIONS = [
    "Who directed the film 2001: A Space Odyssey?",
    "Which river flows through Vienna, Budapest and Belgrade?",
    "Who wrote the novel Pride and Prejudice?",
    "What is the capital city of Australia?",
    "In which year did the Titanic sink?",
    "What gas do plants absorb for photosynthesis?",
]


def demo(limit: int | None = None) -> int:
    """Run the demo; ``limit`` indexes only the first N documents (a quick try)."""
    ingest(limit=limit)  # no-op when the cached index is current
    files = resources.files("tailrace.demo")
    with resources.as_file(files / "wiki-qa.yaml") as path:
        pipeline = Pipeline.from_yaml(str(path))
    print(f"pipeline '{pipeline.name}' on {len(QUESTIONS)} questions (models load on first use)\n",
          file=sys.stderr)
    result = run(pipeline, input=[{"question": q} for q in QUESTIONS])
    by_q = {r["question"]: r for r in result.outputs or []}
    for q in QUESTIONS:
        rec = by_q.get(q)
        print(f"Q: {q}")
        if rec is None:
            err = next((e for e in result.errors if e.input.get("question") == q), None)
            print(f"   error: {err.message if err else 'no output'}\n")
            continue
        print(f"A: {rec['answer'].strip()}")
        print(f"   sources: {'; '.join(rec['sources'])}\n")
    print(format_stats(result.stats))
    return 0 if not result.errors else 1
