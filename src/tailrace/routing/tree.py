"""Collaborative Inference Tree Search: the space of routing paths of each task, explored
by branching off the paths already tried (docs/routing.md, "Training a router").

A path is the list of decisions (True: the large model writes that span) taken at a
task's decision points. With greedy decoding a prefix of decisions fixes the answer so
far, so paths sharing a prefix share a node of the task's tree. The search starts each
task from one path drawn from the current policy, then repeatedly forces a flipped
decision at a chosen node of an existing path (the policy, sampled, finishes it), where
the policy was unsure or the path failed; every path ends in a verified reward.

The environment runs the paths (``Env.rollouts``, batched across tasks); this module
only keeps the trees and chooses the branches, so it is tested on a toy environment
whose optimal routing is known (tests/routing/).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: a policy: the features of a decision point -> probability that the large model writes
Policy = Callable[[Any], float]


@dataclass(frozen=True)
class Job:
    """One path to run: task ``task``, the first decisions forced (``prefix``), the rest
    drawn from ``policy`` with ``rng`` (a ``numpy.random.Generator``)."""

    task: int
    prefix: tuple[bool, ...]
    policy: Policy
    rng: Any


@dataclass(frozen=True)
class Rollout:
    """A finished path: its decisions, the features seen at each, whether the answer was
    verified correct, and the large model's share of the answer's tokens."""

    decisions: tuple[bool, ...]
    features: tuple[Any, ...]
    passed: bool
    large_share: float


class Env(Protocol):
    def rollouts(self, jobs: Sequence[Job]) -> list[Rollout]:
        """Run every job's path (in any order, batched as the environment likes); the
        rollouts in ``jobs``' order."""


class Sampled:
    """A router for one path: the forced ``prefix`` first, then decisions drawn with the
    policy's probability (``explore`` mixes in a fair coin)."""

    def __init__(self, prefix: tuple[bool, ...], policy: Policy, rng: Any,
                 explore: float = 0.1):
        self.prefix, self.policy, self.rng, self.explore = prefix, policy, rng, explore
        self.n = 0

    def __call__(self, f: Any) -> bool:
        i, self.n = self.n, self.n + 1
        if i < len(self.prefix):
            return self.prefix[i]
        p = self.policy(f)
        p = (1 - self.explore) * p + self.explore * 0.5
        return bool(self.rng.random() < p)


@dataclass(eq=False)
class Node:
    """A prefix of decisions: its features (the decision point's), the rewards of the
    paths through it, and its children by decision."""

    features: Any = None
    rewards: list[float] = field(default_factory=list)
    children: dict[bool, Node] = field(default_factory=dict)

    @property
    def value(self) -> float:
        """The best reward of a path through this node: with greedy decoding the
        environment is deterministic, so it is what this prefix is known to achieve
        (the mean would blame a decision for the later ones of random paths)."""
        return max(self.rewards)


def reward(r: Rollout, cost: float) -> float:
    """A path's reward: 1 if verified correct, less ``cost`` times the large model's
    share of the answer (the price of asking it)."""
    return (1.0 if r.passed else 0.0) - cost * r.large_share


class Tree:
    """One task's explored paths."""

    def __init__(self) -> None:
        self.root = Node()
        self.paths: list[Rollout] = []
        self.tried: set[tuple[bool, ...]] = set()  # prefixes forced or walked

    def add(self, r: Rollout, cost: float) -> None:
        self.paths.append(r)
        v = reward(r, cost)
        node = self.root
        node.rewards.append(v)
        for i, d in enumerate(r.decisions):
            if node.features is None:
                node.features = r.features[i]
            node = node.children.setdefault(d, Node())
            node.rewards.append(v)
            self.tried.add(r.decisions[:i + 1])

    def branch(self, policy: Policy, rng: Any) -> tuple[bool, ...] | None:
        """The next prefix to try: the flip of one decision of a tried path, never tried
        before, preferring failed paths (and there, asking the large model) and nodes
        where the policy or the small model was unsure; None when every flip was
        tried."""
        best, best_score = None, -1.0
        for r in self.paths:
            fail = 0.0 if r.passed else 1.0
            for i, d in enumerate(r.decisions):
                prefix = r.decisions[:i] + (not d,)
                if prefix in self.tried:
                    continue
                f = r.features[i]
                p = policy(f)
                # a failed path, an unsure policy, an unsure small model (its top-1
                # probability, the first feature) and, on a failed path, asking the
                # large model rather than less of it
                score = fail * (1.5 if not d else 1.0) + (1.0 - abs(2.0 * p - 1.0)) \
                    + (1.0 - float(f[0])) + 0.1 * float(rng.random())
                if score > best_score:
                    best, best_score = prefix, score
        return best

    def best(self) -> Rollout:
        return max(self.paths, key=lambda r: (r.passed, -r.large_share))


def search(env: Env, tasks: int, policy: Policy, *, branches: int, cost: float, rng: Any,
           explore: float = 0.1, on_round: Callable[[int, int], None] | None = None
           ) -> list[Tree]:
    """Grow one tree per task: a path from ``policy``, then ``branches`` rounds each adding
    one branched path per task (all tasks' paths of a round in one ``env.rollouts``)."""
    trees = [Tree() for _ in range(tasks)]
    jobs = [Job(t, (), policy, rng) for t in range(tasks)]
    for k in range(branches + 1):
        for job, r in zip(jobs, env.rollouts(jobs), strict=True):
            trees[job.task].add(r, cost)
        if on_round is not None:
            on_round(k, branches)
        if k == branches:
            break
        jobs = []
        for t, tree in enumerate(trees):
            prefix = tree.branch(policy, rng)
            if prefix is not None:
                jobs.append(Job(t, prefix, policy, rng))
                tree.tried.add(prefix)
        if not jobs:
            break
    return trees
