"""``tailrace demo``: run the bundled example pipeline and show output and stats."""

from __future__ import annotations

import json
import sys
from importlib import resources

from ..api.pipeline import Pipeline
from ..observability import format_stats
from ..runtime import run


def demo() -> int:
    files = resources.files("tailrace.demo")
    with resources.as_file(files / "text-stats.yaml") as yaml_path:
        pipeline = Pipeline.from_yaml(str(yaml_path))
    records = [json.loads(line) for line in
               (files / "sample.jsonl").read_text(encoding="utf-8").splitlines() if line]
    result = run(pipeline, input=records)
    print(f"pipeline '{pipeline.name}': {len(records)} records in\n")
    print(result.plan.render("text"), "\n")
    for rec in sorted(result.outputs or [], key=lambda r: r["id"]):
        print(f"  [{rec['topic']} #{rec['topic_count']}] {rec['n_words']:>2} words: "
              f"{rec['headline']}")
    for err in result.errors:
        print(f"  error in stage {err.stage}: {err.message}")
    print()
    print(format_stats(result.stats), file=sys.stdout)
    return 0 if not result.errors else 1
