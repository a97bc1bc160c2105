"""The learned routing policy: logistic regression over the decision point's features,
fitted to the tree's advantage-weighted examples, and its versioned file (the one
``engines.collab.router.Learned`` reads).

Fitting maximises the advantage-weighted log-likelihood of the better decision at each
branch node (a policy-gradient step with counterfactual advantages, taken to
convergence), with L2 regularisation, on standardised features.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engines.collab.router import FEATURES, POLICY_VERSION
from .advantages import Example


def fit(examples: Sequence[Example], *, names: Sequence[str] = FEATURES, l2: float = 1e-3,
        steps: int = 500, lr: float = 0.5) -> dict[str, Any]:
    """A policy (the file's dict, without ``trained``) over features ``names`` fitted to
    ``examples``; with none, the policy that always picks the small model."""
    import numpy as np

    n = len(names)
    if not examples:
        return {"version": POLICY_VERSION, "features": list(names), "weights": [0.0] * n,
                "bias": -10.0, "mean": [0.0] * n, "scale": [1.0] * n, "threshold": 0.5}
    x = np.array([e.features for e in examples], dtype=np.float64)
    y = np.array([1.0 if e.large else 0.0 for e in examples])
    w = np.array([e.weight for e in examples])
    w = w / w.sum()
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale < 1e-9] = 1.0
    z = (x - mean) / scale
    theta, b = np.zeros(n), 0.0
    for _ in range(steps):  # full-batch gradient ascent on a concave objective
        p = 1.0 / (1.0 + np.exp(-np.clip(z @ theta + b, -60, 60)))
        g = w * (y - p)
        theta += lr * (z.T @ g - l2 * theta)
        b += lr * float(g.sum())
    return {"version": POLICY_VERSION, "features": list(names),
            "weights": [float(v) for v in theta], "bias": float(b),
            "mean": [float(v) for v in mean], "scale": [float(v) for v in scale],
            "threshold": 0.5}


def probability(policy: dict[str, Any]) -> Any:
    """The policy as a function: features -> probability the large model writes."""
    import numpy as np

    theta = np.asarray(policy["weights"])
    mean, scale, b = np.asarray(policy["mean"]), np.asarray(policy["scale"]), policy["bias"]

    def p(f: Any) -> float:
        x = float(np.dot(theta, (np.asarray(f) - mean) / scale)) + b
        return 1.0 / (1.0 + math.exp(-max(min(x, 60.0), -60.0)))

    return p


def save(policy: dict[str, Any], path: str | Path) -> None:
    """Write the policy file (JSON) atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(policy, indent=1) + "\n")
    tmp.replace(p)
