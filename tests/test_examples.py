"""The examples in examples/ run as the README says."""

import json
import os
import runpy
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart(capsys):
    runpy.run_path(os.path.join(ROOT, "examples", "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "plan 'quickstart'" in out
    # 0..9: evens doubled (0,4,8,12,16) are "even", odds tripled (3,9,15,21,27) are "odd"
    assert "[('even', 0), ('even', 4), ('even', 12), ('even', 24), ('even', 40), " \
        "('odd', 3), ('odd', 12), ('odd', 27), ('odd', 48), ('odd', 75)]" in out


def test_text_stats_yaml_with_the_cli(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "tailrace.cli.main", "run", "examples/text-stats.yaml",
         "--input", "examples/sample.jsonl", "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, check=True)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [1, 2, 3, 4, 5, 6]
    assert {r["id"]: r["headline"] for r in rows}[3] == "The Danube flows through ten countries."
    assert "6 in, 6 out, 0 errors" in proc.stderr


def test_readme_python_snippet_runs(capsys):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    assert "[0, 2, 4, 6, 8, 10, 12, 14, 16, 18]" in capsys.readouterr().out
