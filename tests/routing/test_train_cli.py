"""``tailrace route train`` end to end on real models (SmolLM2-135M on both sides keeps it
short): tree search on two tiny HumanEval-style tasks, a policy file the engine loads; and
a malformed tasks file is a one-line error naming its line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tailrace.engines.collab import make_router

pytestmark = pytest.mark.engine

TASKS = [{"task_id": "t/0", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
          "entry_point": "add", "test": "def check(f):\n    assert f(2, 3) == 5\n"},
         {"task_id": "t/1", "prompt": "def neg(x):\n    \"\"\"-x\"\"\"\n",
          "entry_point": "neg", "test": "def check(f):\n    assert f(2) == -2\n"}] * 2


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tailrace.cli.main", "route", "train", *args],
                          capture_output=True, text=True, timeout=600)


def test_route_train_writes_a_policy_the_engine_loads(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    out = tmp_path / "policy.json"
    r = run("--tasks", str(tasks), "--out", str(out), "--small", "smollm2-135m-instruct",
            "--large", "smollm2-135m-instruct", "--rounds", "1", "--branches", "2",
            "--max-tokens", "24", "--n-ctx", "512", "--span", "line")
    assert r.returncode == 0, r.stderr
    assert "route train: round 1/1, paths 3/3 per task" in r.stderr
    policy = json.loads(out.read_text())
    t = policy["trained"]
    assert t["tasks"] == 2 and t["paths"] == 6 and t["small"] == "smollm2-135m-instruct"
    router = make_router({"kind": "learned", "policy": str(out)})
    import numpy as np

    assert router(np.zeros(7)) in (True, False)


def test_a_malformed_tasks_file_is_a_one_line_error(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASKS[0]) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    r = run("--tasks", str(tasks), "--out", str(tmp_path / "p.json"))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert f"{tasks}:2: a task needs string fields prompt, entry_point and test; missing " \
           "entry_point, test" in last
    assert not (tmp_path / "p.json").exists()
