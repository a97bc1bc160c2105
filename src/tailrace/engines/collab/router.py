"""Who writes the next span of a collaborative answer: the features a router reads and
the routers (docs/routing.md, "Collaborative generation").

At each decision point the small model has just computed its distribution over the next
token; ``features`` turns that row of logits and the answer's state into a short vector,
and a router maps it to a choice: True sends the next span to the large model. With
``span: draft`` the small model first drafts the line and ``draft_features`` describe
the draft (its least sure token, how many were unsure); True then has the large model
write the line instead. Pure numpy, no model: the routers are tested on their own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import EngineError

#: the feature vector, in order (``features``); a policy file names them to check
FEATURES = ("top1", "entropy", "margin", "position", "since_large", "large_share",
            "line_start")
#: the feature vector of a drafted line (``draft_features``); the first three have the
#: names, and the sides, of the next-token ones, for the least sure token of the draft
DRAFT_FEATURES = ("top1", "entropy", "margin", "mean_top1", "unsure", "length", "position",
                  "since_large", "large_share")
#: router kinds a spec may name
KINDS = ("small", "large", "random", "threshold", "learned")
#: threshold metrics: for each, the side on which the small model counts as unsure
METRICS = {"top1": "below", "margin": "below", "entropy": "above"}
POLICY_VERSION = 1


def features(row: Any, position: int, since_large: int, large_share: float,
             line_start: bool) -> Any:
    """The decision point's feature vector (float64, ``FEATURES`` order) from the small
    model's logits ``row`` (float32 over the vocabulary) and the answer so far:
    top-1 probability, entropy (nats), top-1 minus top-2 probability, output position
    (/256), tokens since the large model last wrote (/16, capped at 4), the large
    model's share of the tokens so far, and whether a line starts here."""
    import numpy as np

    p1, entropy, margin = confidence(row)
    return np.array([p1, entropy, margin, position / 256.0,
                     min(since_large / 16.0, 4.0), large_share, 1.0 if line_start else 0.0])


def confidence(row: Any) -> tuple[float, float, float]:
    """The small model's top-1 probability, entropy (nats) and top-1 minus top-2
    probability of one row of logits."""
    import numpy as np

    m = float(row.max())
    z = np.exp(row - m)
    s = float(z.sum())
    top2 = float(np.partition(row, -2)[-2])
    p1 = 1.0 / s
    return p1, math.log(s) - float(np.dot(z, row - m)) / s, p1 - math.exp(top2 - m) / s


def draft_features(draft: list[tuple[float, float, float]], position: int,
                   since_large: int, large_share: float) -> Any:
    """A drafted line's feature vector (float64, ``DRAFT_FEATURES`` order) from each draft
    token's ``confidence``: the least top-1 probability, the most entropy, the least
    margin, the mean top-1, the fraction of tokens with top-1 below 0.5, the draft's
    length (/32), and as in ``features`` the position, tokens since the large model last
    wrote and its share so far."""
    import numpy as np

    c = np.asarray(draft, dtype=np.float64).reshape(-1, 3)
    if not len(c):
        c = np.ones((1, 3))
    return np.array([c[:, 0].min(), c[:, 1].max(), c[:, 2].min(), c[:, 0].mean(),
                     float((c[:, 0] < 0.5).mean()), len(draft) / 32.0, position / 256.0,
                     min(since_large / 16.0, 4.0), large_share])


#: a router: the features -> True (the large model writes the next span)
Router = Callable[[Any], bool]


class Threshold:
    """The imitation-style baseline: the large model writes when the small one is unsure
    (its top-1 probability or margin below ``threshold``, or its entropy above it)."""

    def __init__(self, metric: str = "top1", threshold: float = 0.5):
        self.metric, self.threshold = metric, float(threshold)
        self._i = FEATURES.index(metric)
        self._below = METRICS[metric] == "below"

    def __call__(self, f: Any) -> bool:
        v = f[self._i]
        return bool(v < self.threshold) if self._below else bool(v > self.threshold)


class Random:
    """The large model writes each span with probability ``rate`` (a seeded draw)."""

    def __init__(self, rate: float, seed: int = 0):
        import numpy as np

        self.rate, self._rng = float(rate), np.random.default_rng(seed)

    def __call__(self, f: Any) -> bool:
        return bool(self._rng.random() < self.rate)


class Learned:
    """A trained policy: logistic regression over the features (``policy.py`` trains
    it); the large model writes when its probability is above ``threshold`` (the
    operating point; the file's own by default)."""

    def __init__(self, policy: dict[str, Any], threshold: float | None = None):
        import numpy as np

        self.policy = policy
        self.w = np.asarray(policy["weights"], dtype=np.float64)
        self.b = float(policy["bias"])
        self.mean = np.asarray(policy.get("mean", [0.0] * len(self.w)), dtype=np.float64)
        self.scale = np.asarray(policy.get("scale", [1.0] * len(self.w)), dtype=np.float64)
        self.threshold = float(policy.get("threshold", 0.5) if threshold is None else threshold)

    def probability(self, f: Any) -> float:
        import numpy as np

        x = float(np.dot(self.w, (f - self.mean) / self.scale)) + self.b
        return 1.0 / (1.0 + math.exp(-max(min(x, 60.0), -60.0)))

    def __call__(self, f: Any) -> bool:
        return self.probability(f) > self.threshold


def read_policy(path: str | Path, where: str = "router",
                names: tuple[str, ...] = FEATURES) -> dict[str, Any]:
    """A policy file (JSON, ``policy.py`` writes it) for features ``names`` (``FEATURES``,
    or ``DRAFT_FEATURES`` for ``span: draft``), checked; EngineError naming the file and
    what is wrong."""
    p = Path(path)
    if not p.is_file():
        raise EngineError(f"{where}: policy file not found: {p}")
    try:
        policy = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"{where}: policy file {p} is not JSON: {e}") from None
    if not isinstance(policy, dict) or policy.get("version") != POLICY_VERSION:
        raise EngineError(f"{where}: policy file {p} is not a version-{POLICY_VERSION} "
                          "tailrace router policy (train one with: tailrace route train)")
    if policy.get("features") != list(names):
        other = DRAFT_FEATURES if names == FEATURES else FEATURES
        hint = (f"it was trained for span: {'draft' if names == FEATURES else 'line'} "
                "decisions; use that span or train again") \
            if policy.get("features") == list(other) else "train it again"
        raise EngineError(f"{where}: policy file {p} reads features {policy.get('features')}"
                          f", this engine computes {list(names)}: {hint}")
    n = len(names)
    for key in ("weights", "mean", "scale"):
        v = policy.get(key)
        if (key == "weights" or v is not None) and (
                not isinstance(v, list) or len(v) != n
                or not all(isinstance(x, (int, float)) for x in v)):
            raise EngineError(f"{where}: policy file {p}: '{key}' must be {n} numbers")
    if not isinstance(policy.get("bias"), (int, float)):
        raise EngineError(f"{where}: policy file {p}: 'bias' must be a number")
    return policy


def check_router(spec: Any, where: str = "router",
                 names: tuple[str, ...] = FEATURES) -> None:
    """Validate a router spec without building it; EngineError says what to fix."""
    make_router(spec, where, names)


def make_router(spec: Any, where: str = "router",
                names: tuple[str, ...] = FEATURES) -> Router:
    """The router a spec names, reading features ``names`` (``FEATURES``, or
    ``DRAFT_FEATURES`` for ``span: draft``): ``{kind: threshold, metric: top1, threshold: 0.5}``,
    ``{kind: learned, policy: FILE[, threshold: P]}``, ``{kind: random, rate: R[, seed]}``,
    ``{kind: small}`` or ``{kind: large}`` (one model writes every span)."""
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, dict) or "kind" not in spec:
        raise EngineError(f"{where} must be a mapping like {{kind: threshold, metric: top1, "
                          f"threshold: 0.5}}; kinds: {', '.join(KINDS)}")
    kind = spec["kind"]
    allowed = {"small": (), "large": (), "random": ("rate", "seed"),
               "threshold": ("metric", "threshold"), "learned": ("policy", "threshold")}
    if kind not in allowed:
        raise EngineError(f"{where}: unknown router kind {kind!r}; kinds: {', '.join(KINDS)}")
    extra = sorted(set(spec) - {"kind", *allowed[kind]})
    if extra:
        raise EngineError(f"{where}: router {kind} does not take {', '.join(extra)}; it "
                          f"takes: {', '.join(allowed[kind]) or 'nothing'}")

    def number(key: str, default: float | None, lo: float, hi: float) -> float:
        v = spec.get(key, default)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) \
                or not lo <= v <= hi:
            raise EngineError(f"{where}: router {kind} needs {key} between {lo} and {hi}, "
                              f"got {v!r}")
        return float(v)

    if kind == "small":
        return lambda f: False
    if kind == "large":
        return lambda f: True
    if kind == "random":
        seed = spec.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise EngineError(f"{where}: router random's seed must be an integer, got {seed!r}")
        return Random(number("rate", None, 0.0, 1.0), seed)
    if kind == "threshold":
        metric = spec.get("metric", "top1")
        if metric not in METRICS:
            raise EngineError(f"{where}: threshold metric must be one of "
                              f"{', '.join(METRICS)}, got {metric!r}")
        hi = 20.0 if metric == "entropy" else 1.0
        return Threshold(metric, number("threshold", 0.5, 0.0, hi))
    if not spec.get("policy"):
        raise EngineError(f"{where}: router learned needs policy: FILE (train one with: "
                          "tailrace route train)")
    policy = read_policy(spec["policy"], where, names)
    t = number("threshold", None, 0.0, 1.0) if "threshold" in spec else None
    return Learned(policy, t)
