"""A learned allocation policy: each provider's chance to solve a request, from cheap
features of its prompt, and the order of providers that maximises expected margin.

Features are the prompt's words hashed into ``DIM`` buckets (log counts) plus its
length, and what the request has been through (``with_history``): which providers
already failed it, how (the verdict's kind: ``AssertionError``, ``SyntaxError``,
``timeout``...) and the last one's own confidence (its mean token log-probability, when
the engine reports it). Each provider has a logistic regression over them, fit offline
from recorded outcomes (``fit``; ``tailrace route fit TRACE``) and updated online from
verified outcomes (``update``). A plan is an order of providers, stopping at the first
verified answer: with ``p`` a provider's chance given the failures before it, ``c`` its
expected cost and ``R`` the revenue of a solved request, the value of trying ``e`` next
is ``p * R - c + (1 - p) * (the best value of going on after e failed)``, where going on
may also be stopping (0); ``best_plan`` searches every order (providers are few) and
returns the best, or ``[]`` (decline) when no order is expected to pay. The allocator
plans again after each failure, with what it learnt from it. The file is a small,
versioned JSON (``save``/``load``).

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
from pathlib import Path
from typing import Any

FORMAT = "tailrace-route-policy"
VERSION = 2
DIM = 256  # hashed word buckets; the length features, the bias and the confidence follow
WIDTH = DIM + 4
_WORD = re.compile(r"[A-Za-z_]+|\d+")


def features(text: str, embedding: Sequence[float] | None = None,
             words: bool = True) -> dict[int, float]:
    """Sparse features of a prompt: hashed word buckets (log counts; ``words``), the
    log of its length in characters and words, a bias, and its ``embedding`` (a unit
    vector from the policy's embedder) from index ``WIDTH`` on."""
    counts: dict[int, float] = {}
    found = _WORD.findall(text.lower())
    for w in found if words else ():
        h = zlib.crc32(w.encode()) % DIM
        counts[h] = counts.get(h, 0.0) + 1.0
    out = {k: math.log1p(v) for k, v in counts.items()}
    out[DIM] = math.log1p(len(text)) / 8.0
    out[DIM + 1] = math.log1p(len(found)) / 6.0
    out[DIM + 2] = 1.0
    if embedding is not None:  # a unit vector: small entries, a gentle pull per example
        out.update({WIDTH + k: float(v) for k, v in enumerate(embedding)})
    return out


def _bucket(token: str) -> int:
    return zlib.crc32(token.encode()) % DIM


def with_history(x: Mapping[int, float], history: Sequence[Mapping[str, Any]]
                 ) -> dict[int, float]:
    """``x`` plus what the request has been through: each failed call's provider
    (``{"engine", "reason"}``; the reason's first word is its kind) and the last call's
    confidence (``"confidence"``, a mean token log-probability, when known)."""
    if not history:
        return dict(x)
    out = dict(x)
    for call in history:
        e = call["engine"]
        for token in (f"after:{e}", f"after:{e}:{str(call.get('reason') or '').split(' ')[0]}"):
            b = _bucket(token)
            out[b] = out.get(b, 0.0) + 1.0
    conf = history[-1].get("confidence")
    if isinstance(conf, (int, float)):
        out[DIM + 3] = max(-5.0, float(conf)) / 5.0
    return out


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))


class Policy:
    """Per-provider logistic regressions and mean completion tokens.

    engines: the providers it knows (route ``escalate:`` names).
    weights: provider -> ``width`` weights (default zeros: every chance 0.5).
    completion_tokens: provider -> mean completion tokens of its recorded calls.
    seen: provider -> outcomes it learnt from (offline and online).
    words: whether prompt words are features (``features``).
    embedder: the embedding model whose vectors of the prompt are features (an engine
              ``model:`` name, e.g. ``minilm-l6-int8``), or None; ``embed_dim`` their size.
    """

    def __init__(self, engines: Sequence[str], weights: Mapping[str, list[float]] | None = None,
                 completion_tokens: Mapping[str, float] | None = None,
                 seen: Mapping[str, int] | None = None, lr: float = 0.1, l2: float = 1e-2,
                 words: bool = True, embedder: str | None = None, embed_dim: int = 0):
        self.engines = list(engines)
        self.words, self.embedder, self.embed_dim = words, embedder, int(embed_dim)
        self.width = WIDTH + self.embed_dim
        self.weights = {e: list((weights or {}).get(e) or [0.0] * self.width)
                        for e in self.engines}
        self.completion_tokens = {e: float((completion_tokens or {}).get(e, 0.0))
                                  for e in self.engines}
        self.seen = {e: int((seen or {}).get(e, 0)) for e in self.engines}
        self.lr, self.l2 = lr, l2

    def features(self, text: str, embedding: Sequence[float] | None = None) -> dict[int, float]:
        """``features`` of a prompt as this policy reads them."""
        if (embedding is None) != (self.embedder is None):
            raise ValueError("the policy was fit with an embedder; pass the prompt's "
                             "embedding" if self.embedder else "the policy has no embedder")
        return features(text, embedding, self.words)

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
        return {"format": FORMAT, "version": VERSION, "dim": self.width, "words": self.words,
                "embedder": self.embedder, "embed_dim": self.embed_dim, "engines": self.engines,
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
        edim = data.get("embed_dim", 0)
        if data.get("version") != VERSION or not isinstance(edim, int) or \
                data.get("dim") != WIDTH + edim:
            raise ValueError(f"policy file {path}: version {data.get('version')} / dim "
                             f"{data.get('dim')}; this tailrace reads version {VERSION} / "
                             f"dim {WIDTH} + the embedding's: fit it again")
        engines = data.get("engines")
        weights = data.get("weights")
        if not isinstance(engines, list) or not isinstance(weights, dict) or any(
                not isinstance(weights.get(e), list) or len(weights[e]) != WIDTH + edim
                for e in engines):
            raise ValueError(f"policy file {path}: engines and weights do not match")
        return cls(engines, weights, data.get("completion_tokens"), data.get("seen"),
                   words=bool(data.get("words", True)), embedder=data.get("embedder"),
                   embed_dim=edim)


def best_plan(p: Any, c: Mapping[str, float], revenue: float,
              budget: float | None = None) -> list[str]:
    """The order of providers with the best expected margin (see the module doc) whose
    expected costs fit in ``budget`` (None: any); ``[]`` when none is expected to pay.
    ``p``: each provider's chance, a mapping, or ``p(engine, failed)`` given the
    providers that failed before it (a tuple)."""
    chance = (lambda e, failed: p[e]) if isinstance(p, Mapping) else p
    memo: dict[tuple, tuple[float, list[str]]] = {}

    def value(failed: tuple[str, ...], left: float) -> tuple[float, list[str]]:
        key = (frozenset(failed), failed[-1:], round(left, 12))
        if key in memo:
            return memo[key]
        best: tuple[float, list[str]] = (0.0, [])
        for e in c:
            if e in failed or c[e] > left + 1e-12:
                continue
            pe = chance(e, failed)
            rest, then = value(failed + (e,), left - c[e])
            m = pe * revenue - c[e] + (1.0 - pe) * rest
            if m > best[0] + 1e-12:
                best = (m, [e] + then)
        memo[key] = best
        return best

    return value((), math.inf if budget is None else budget)[1]


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
        epochs: int = 30, seed: int = 0, words: bool = True,
        embed: Any = None, embedder: str | None = None) -> Policy:
    """A policy fit on recorded outcomes: ``(prompt, [{"engine", "passed", "reason",
    "completion_tokens"}, ...])`` per request, the calls in the order they were made
    (each after the failures before it: what ``outcomes`` reads from a trace).
    ``embed(texts) -> vectors`` with ``embedder`` (its model name): embeddings as
    features too; ``words``: prompt words as features."""
    trace = list(trace)
    vecs = list(embed([t for t, _ in trace])) if embed is not None else [None] * len(trace)
    rows = [(with_history(features(text, vec, words), tried[:k]), t)
            for (text, tried), vec in zip(trace, vecs, strict=True)
            for k, t in enumerate(tried)]
    first = vecs[0] if vecs else None
    dim = len(first) if first is not None else 0
    return fit_rows(rows, engines, epochs, seed, Policy(engines or [], words=words,
                                                       embedder=embedder, embed_dim=dim))


def fit_rows(rows: list[tuple[dict[int, float], dict[str, Any]]],
             engines: Sequence[str] | None = None, epochs: int = 30, seed: int = 0,
             like: Policy | None = None) -> Policy:
    """A policy fit on ``(features, {"engine", "passed", "completion_tokens"})`` rows
    (``like``: a policy whose feature settings it takes)."""
    import random

    rows = list(rows)
    names = list(engines) if engines else list(dict.fromkeys(t["engine"] for _, t in rows))
    like = like or Policy(names)
    pol = Policy(names, words=like.words, embedder=like.embedder, embed_dim=like.embed_dim)
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


def next_plan(pol: Policy, x: Mapping[int, float], costs: Mapping[str, float],
              calls: Sequence[Mapping[str, Any]], revenue: float | None,
              left: float | None) -> list[str]:
    """The best order of the providers in ``costs`` not yet tried, for a request with
    features ``x`` whose failed ``calls`` so far are given (``best_plan``; ``[]``: none
    is expected to pay). ``revenue`` None: nothing is paid for a solution, so the best
    chance goes first; ``left``: the budget left (None: unbounded)."""
    tried = {k["engine"] for k in calls}
    c = {n: v for n, v in costs.items() if n not in tried}
    def chance(e: str, failed: tuple) -> float:
        return pol.success(e, with_history(x, [*calls, *({"engine": f} for f in failed)]))

    if revenue is None:
        return sorted(c, key=lambda n: -chance(n, ()))
    return best_plan(chance, c, revenue, left)
