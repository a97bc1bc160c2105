"""Router training on a toy environment whose optimal routing is known.

Each toy task has 8 decision points, two of them "hard": the answer passes only if the
large model writes both hard spans. The small model's top-1 probability gives them
away (low at hard points, high elsewhere), the features the real engine computes. So the
optimal router sends exactly the hard points to the large model: tree search must find
passing paths a small-leaning policy never takes, the advantages must credit the
decisions that mattered, and the trained policy must route like the optimum.
"""

from __future__ import annotations

import numpy as np
import pytest

from tailrace.engines.collab.router import FEATURES, make_router
from tailrace.routing.advantages import examples
from tailrace.routing.policy import fit, probability, save
from tailrace.routing.tree import Job, Rollout, Sampled, Tree, search

T = 8


class Toy:
    """Tasks with two hard decision points among ``T``; pass = large at both."""

    def __init__(self, n: int, seed: int):
        rng = np.random.default_rng(seed)
        self.hard = [set(rng.choice(T, 2, replace=False).tolist()) for _ in range(n)]
        self.top1 = [[rng.uniform(0.05, 0.4) if i in h else rng.uniform(0.55, 0.99)
                      for i in range(T)] for h in self.hard]
        self.runs = 0

    def features(self, task: int, decisions: list[bool]) -> np.ndarray:
        i = len(decisions)
        p = self.top1[task][i]
        since = next((i - j - 1 for j in range(i - 1, -1, -1) if decisions[j]), 1 << 20)
        share = sum(decisions) / i if i else 0.0
        return np.array([p, -np.log(p), p - (1 - p) / 2, i / 256, min(since / 16, 4.0),
                         share, 0.0])

    def rollouts(self, jobs):
        out = []
        for job in jobs:
            self.runs += 1
            router = Sampled(job.prefix, job.policy, job.rng)
            ds: list[bool] = []
            fs = []
            for _ in range(T):
                f = self.features(job.task, ds)
                fs.append(f)
                ds.append(router(f))
            passed = all(ds[h] for h in self.hard[job.task])
            out.append(Rollout(tuple(ds), tuple(fs), passed, sum(ds) / T))
        return out

    def optimal(self, task: int) -> list[bool]:
        return [i in self.hard[task] for i in range(T)]


def test_tree_search_finds_passing_paths_a_small_leaning_policy_does_not_take():
    env, rng = Toy(40, seed=1), np.random.default_rng(0)
    def mostly_small(f):
        return 0.02
    plain = env.rollouts([Job(t, (), mostly_small, rng) for t in range(40)])
    assert sum(r.passed for r in plain) <= 2  # the policy alone almost never passes
    trees = search(env, 40, mostly_small, branches=16, cost=0.2, rng=rng)
    found = sum(any(r.passed for r in tree.paths) for tree in trees)
    assert found >= 30, found  # the tree reaches them
    # every tree holds distinct paths: each branch forced a prefix not tried before
    for tree in trees:
        assert len({r.decisions for r in tree.paths}) == len(tree.paths)


def test_advantages_credit_only_decisions_with_an_explored_alternative():
    f0, f1 = np.zeros(len(FEATURES)), np.ones(len(FEATURES))
    tree = Tree()
    # small, small fails; small, large passes (reward 1 - 0.5 * 0.5); large, large passes
    # but costs more (1 - 0.5 * 1.0)
    tree.add(Rollout((False, False), (f0, f1), False, 0.0), cost=0.5)
    tree.add(Rollout((False, True), (f0, f1), True, 0.5), cost=0.5)
    tree.add(Rollout((True, True), (f0, f0), True, 1.0), cost=0.5)
    ex = sorted(examples([tree]), key=lambda e: e.weight)
    # root: Q(large) = 0.5, Q(small) = best below it = 0.75 -> small, by 0.25;
    # after "small": Q(large) = 0.75, Q(small) = 0 -> large, by 0.75
    assert [(e.large, round(e.advantage, 6)) for e in ex] == [(False, -0.25), (True, 0.75)]
    assert ex[0].features is f0 and ex[1].features is f1
    # the decision after "large" had no alternative tried: no example from it
    assert len(ex) == 2


def test_the_trained_policy_routes_like_the_optimum(tmp_path):
    rng = np.random.default_rng(2)
    policy = fit([])  # starts by always picking the small model
    train = Toy(60, seed=3)
    all_examples = []
    for _ in range(3):  # search with the current policy, refit on everything seen
        trees = search(train, 60, probability(policy), branches=10, cost=0.2, rng=rng)
        all_examples += examples(trees)
        policy = fit(all_examples)
    path = tmp_path / "policy.json"
    save(policy, path)
    router = make_router({"kind": "learned", "policy": str(path)})  # as the engine loads it
    test = Toy(100, seed=4)
    right = passed = large = 0
    for t in range(100):
        ds: list[bool] = []
        for _ in range(T):
            ds.append(router(test.features(t, ds)))
        right += sum(a == b for a, b in zip(ds, test.optimal(t), strict=True))
        passed += all(ds[h] for h in test.hard[t])
        large += sum(ds)
    assert right / (100 * T) >= 0.95
    assert passed >= 90
    assert large / (100 * T) == pytest.approx(2 / T, abs=0.05)  # no more large than needed
