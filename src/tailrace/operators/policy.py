"""A learned allocation policy: each provider's chance to solve a request, from cheap
features of its prompt, and the order of providers that maximises expected margin.

Features are the prompt's words hashed into ``DIM`` buckets (log counts) plus its
length; each provider has a logistic regression over them, fit offline from recorded
outcomes (``fit``; ``tailrace route fit TRACE``) and updated online from verified
outcomes (``update``). A plan is an ordered subset of providers: with ``p`` the success
chances, ``c`` the expected costs and ``R`` the revenue of a solved request, its
expected margin is ``sum_k prod_{j<k} (1 - p_j) * (p_k * R - c_k)``; ``best_plan``
searches every plan (providers are few) and returns the best, or ``[]`` (decline) when
none is expected to pay. The file is a small, versioned JSON (``save``/``load``).

>>> pol = Policy(["small", "large"])
>>> for _ in range(200):
...     pol.update("small", features("add two numbers"), True)
...     pol.update("small", features("prove the riemann hypothesis"), False)
...     pol.update("large", features("prove the riemann hypothesis"), True)
>>> pol.success("small", features("add two numbers")) > 0.8
True
>>> best_plan({"small": 0.9, "large": 0.95}, {"small": 0.1, "large": 1.0}, revenue=2.0)
['small', 'large']
>>> best_plan({"small": 0.01, "large": 0.1}, {"small": 0.1, "large": 1.0}, revenue=2.0)
[]
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from itertools import permutations
from pathlib import Path
from typing import Any

FORMAT = "tailrace-route-policy"
VERSION = 1
DIM = 256  # hashed word buckets; the length features follow
_WORD = re.compile(r"[A-Za-z_]+|\d+")


def features(text: str) -> dict[int, float]:
    """Sparse features of a prompt: hashed word buckets (log counts), then the log
    of its length in characters and words, then a bias."""
    counts: dict[int, float] = {}
    words = _WORD.findall(text.lower())
    for w in words:
        h = zlib.crc32(w.encode()) % DIM
        counts[h] = counts.get(h, 0.0) + 1.0
    out = {k: math.log1p(v) for k, v in counts.items()}
    out[DIM] = math.log1p(len(text)) / 8.0
    out[DIM + 1] = math.log1p(len(words)) / 6.0
    out[DIM + 2] = 1.0
    return out


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))


class Policy:
    """Per-provider logistic regressions and mean completion tokens.

    engines: the providers it knows (route ``escalate:`` names).
    weights: provider -> DIM + 3 weights (default zeros: every chance 0.5).
    completion_tokens: provider -> mean completion tokens of its recorded calls.
    seen: provider -> outcomes it learnt from (offline and online).
    """

    def __init__(self, engines: Sequence[str], weights: Mapping[str, list[float]] | None = None,
                 completion_tokens: Mapping[str, float] | None = None,
                 seen: Mapping[str, int] | None = None, lr: float = 0.1, l2: float = 1e-3):
        self.engines = list(engines)
        self.weights = {e: list((weights or {}).get(e) or [0.0] * (DIM + 3))
                        for e in self.engines}
        self.completion_tokens = {e: float((completion_tokens or {}).get(e, 0.0))
                                  for e in self.engines}
        self.seen = {e: int((seen or {}).get(e, 0)) for e in self.engines}
        self.lr, self.l2 = lr, l2

    def success(self, engine: str, x: Mapping[int, float]) -> float:
        """The chance ``engine``'s answer to a prompt with features ``x`` passes."""
        w = self.weights[engine]
        return _sigmoid(sum(w[i] * v for i, v in x.items()))

    def update(self, engine: str, x: Mapping[int, float], passed: bool,
               completion_tokens: int | None = None) -> None:
        """One online step from a verified outcome (and the call's completion tokens)."""
        if engine not in self.weights:
            return
        w = self.weights[engine]
        g = (1.0 if passed else 0.0) - self.success(engine, x)
        for i, v in x.items():
            w[i] += self.lr * (g * v - self.l2 * w[i])
        n = self.seen[engine] = self.seen[engine] + 1
        if completion_tokens is not None:
            m = self.completion_tokens[engine]
            self.completion_tokens[engine] = m + (completion_tokens - m) / n

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "dim": DIM, "engines": self.engines,
                "weights": {e: [round(v, 6) for v in w] for e, w in self.weights.items()},
                "completion_tokens": self.completion_tokens, "seen": self.seen}

    def save(self, path: str | Path) -> None:
        """Write the policy file (atomically: a temporary file, then a rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        """The policy in ``path``; ValueError naming the file and what is wrong."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"policy file {path}: cannot read it ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"policy file {path}: not a tailrace route policy (make one "
                             "with: tailrace route fit TRACE --out FILE)")
        if data.get("version") != VERSION or data.get("dim") != DIM:
            raise ValueError(f"policy file {path}: version {data.get('version')} / dim "
                             f"{data.get('dim')}; this tailrace reads version {VERSION} / "
                             f"dim {DIM}: fit it again")
        engines = data.get("engines")
        weights = data.get("weights")
        if not isinstance(engines, list) or not isinstance(weights, dict) or any(
                not isinstance(weights.get(e), list) or len(weights[e]) != DIM + 3
                for e in engines):
            raise ValueError(f"policy file {path}: engines and weights do not match")
        return cls(engines, weights, data.get("completion_tokens"), data.get("seen"))


def margin(plan: Sequence[str], p: Mapping[str, float], c: Mapping[str, float],
           revenue: float) -> float:
    """Expected margin of trying ``plan`` in order, stopping at the first success."""
    total, reach = 0.0, 1.0
    for e in plan:
        total += reach * (p[e] * revenue - c[e])
        reach *= 1.0 - p[e]
    return total


def best_plan(p: Mapping[str, float], c: Mapping[str, float], revenue: float,
              budget: float | None = None) -> list[str]:
    """The order of providers with the highest expected margin whose expected costs fit
    in ``budget`` (None: any); ``[]`` when no plan's expected margin is positive."""
    names = list(p)
    best: tuple[float, list[str]] = (0.0, [])
    for k in range(1, len(names) + 1):
        for plan in permutations(names, k):
            if budget is not None and sum(c[e] for e in plan) > budget:
                continue
            m = margin(plan, p, c, revenue)
            if m > best[0] + 1e-12:
                best = (m, list(plan))
    return best[1]


def outcomes(record: Mapping[str, Any], prompt_field: str,
             route_field: str) -> tuple[str, list[dict[str, Any]]] | None:
    """(prompt text, tried calls) of one trace line, or None when it has neither: a
    route stage's output (or error) record, whose ``route`` field lists the calls it
    tried (``{"engine", "passed", "completion_tokens", ...}``)."""
    text = record.get(prompt_field)
    tried = (record.get(route_field) or {}).get("tried") \
        if isinstance(record.get(route_field), dict) else None
    if not isinstance(text, str) or not isinstance(tried, list):
        return None
    return text, [t for t in tried if isinstance(t, dict) and isinstance(t.get("engine"), str)
                  and isinstance(t.get("passed"), bool)]


def fit(trace: Iterable[tuple[str, list[dict[str, Any]]]], engines: Sequence[str] | None = None,
        epochs: int = 30, seed: int = 0) -> Policy:
    """A policy fit on recorded outcomes: ``(prompt, [{"engine", "passed",
    "completion_tokens"}, ...])`` per request (what ``outcomes`` reads from a trace)."""
    import random

    rows = [(features(text), t) for text, tried in trace for t in tried]
    names = list(engines) if engines else list(dict.fromkeys(t["engine"] for _, t in rows))
    pol = Policy(names)
    for _, t in rows:  # the mean completion tokens first, so ``seen`` ends as the count
        if t["engine"] in pol.seen and isinstance(t.get("completion_tokens"), int):
            e = t["engine"]
            pol.seen[e] += 1
            pol.completion_tokens[e] += (t["completion_tokens"] - pol.completion_tokens[e]) \
                / pol.seen[e]
    counted = dict(pol.seen)
    rng = random.Random(seed)
    for epoch in range(epochs):
        rng.shuffle(rows)
        pol.lr = 0.2 / (1.0 + epoch / 5.0)
        for x, t in rows:
            if t["engine"] in pol.weights:
                pol.update(t["engine"], x, t["passed"])
    pol.seen, pol.lr = counted, 0.1
    return pol
