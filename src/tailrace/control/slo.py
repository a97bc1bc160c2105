"""What a pipeline is promised (``PipelineSLO``) and what a request will cost (``CostModel``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..api.pipeline import PRIORITY_CLASSES, is_int

if TYPE_CHECKING:
    from .admission import Request

PRIORITIES = PRIORITY_CLASSES  # name -> class; higher is more urgent


def is_number(x: object) -> bool:
    """True for a finite int or float (not a bool)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def is_count(x: object) -> bool:
    """True for an int >= 0 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def is_priority(x: object) -> bool:
    """True for a priority class: a name in ``PRIORITIES`` or an int (not a bool)."""
    return x in PRIORITIES if isinstance(x, str) else is_int(x)


def rank_of(priority: str | int) -> int:
    """A priority class as an int; higher is more urgent (``interactive`` is 2)."""
    return PRIORITIES[priority] if isinstance(priority, str) else priority


def require(ok: bool, where: str, name: str, want: str, value: object) -> None:
    """ValueError ``"{where}: {name} must be {want}, got {value!r}"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{where}: {name} must be {want}, got {value!r}")


@dataclass(frozen=True)
class PipelineSLO:
    """A pipeline's latency objective, urgency class and fair-share weight."""

    p99_ms: float  # latency budget; a request's default deadline is arrival + p99_ms
    priority: str | int = "standard"  # interactive, standard, batch or an int: higher first
    weight: float = 1.0  # share of contended capacity relative to other pipelines' weights
    pipeline: str = ""  # the pipeline's name, used in error messages

    def __post_init__(self) -> None:
        where = f"slo for pipeline {self.pipeline!r}" if self.pipeline else "slo"
        require(is_number(self.p99_ms) and self.p99_ms > 0, where, "p99_ms",
                "a positive number of milliseconds", self.p99_ms)
        require(is_priority(self.priority), where, "priority",
                "'interactive', 'standard', 'batch' or an integer class (higher is more "
                "urgent)", self.priority)
        require(is_number(self.weight) and self.weight > 0, where, "weight",
                "a positive number", self.weight)

    @property
    def rank(self) -> int:
        """The priority as an int class; higher is more urgent."""
        return rank_of(self.priority)

    @classmethod
    def from_config(cls, pipeline: str, config: Mapping[str, Any]) -> PipelineSLO:
        """Build from the YAML ``slo:`` mapping of ``pipeline`` (e.g. ``{"p99_ms": 3000,
        "priority": "interactive"}``), rejecting unknown keys."""
        known = ("p99_ms", "priority", "weight")
        for key in config:
            if key not in known:
                raise ValueError(f"slo for pipeline {pipeline!r}: unknown key {key!r}; "
                                 f"known keys: {', '.join(known)}")
        if "p99_ms" not in config:
            raise ValueError(f"slo for pipeline {pipeline!r}: p99_ms is required")
        return cls(pipeline=pipeline, **config)


class CostModel:
    """Predicts a request's service seconds from its tokens, calibrated by observations.

    prefill_tps: prompt tokens processed per second.
    decode_tps: output tokens generated per second, per sequence.
    overhead_s: fixed seconds per request (tokenizing, retrieval, scheduling).
    alpha: weight in (0, 1] of a new observation in the EWMA of actual / token estimate.
    """

    def __init__(self, prefill_tps: float = 1000.0, decode_tps: float = 50.0,
                 overhead_s: float = 0.005, alpha: float = 0.2) -> None:
        for name, value in (("prefill_tps", prefill_tps), ("decode_tps", decode_tps)):
            require(is_number(value) and value > 0, "cost model", name,
                    "a positive number of tokens per second", value)
        require(is_number(overhead_s) and overhead_s >= 0, "cost model", "overhead_s",
                "a non-negative number of seconds", overhead_s)
        require(is_number(alpha) and 0 < alpha <= 1, "cost model", "alpha", "in (0, 1]", alpha)
        self.prefill_tps, self.decode_tps = float(prefill_tps), float(decode_tps)
        self.overhead_s, self.alpha = float(overhead_s), float(alpha)
        self._scale: dict[str, float] = {}  # per pipeline; unseen pipelines use the global one
        self._global = 1.0

    def estimate(self, request: Request) -> float:
        """Uncalibrated seconds of ``request`` from tokens alone."""
        return (self.overhead_s + request.prompt_tokens / self.prefill_tps
                + request.max_tokens / self.decode_tps)

    def scale(self, pipeline: str) -> float:
        """The calibration factor (EWMA of actual / estimate) applied to ``pipeline``."""
        return self._scale.get(pipeline, self._global)

    def predict(self, request: Request) -> float:
        """Predicted service seconds of ``request``: the token estimate times its
        pipeline's calibration."""
        return self.estimate(request) * self.scale(request.pipeline)

    def observe(self, request: Request, seconds: float) -> None:
        """Move the calibration of the request's pipeline (and the global one) toward
        ``seconds``, the measured service time of ``request``."""
        require(is_number(seconds) and seconds >= 0, "cost model", "observed seconds",
                "a non-negative number", seconds)
        base = self.estimate(request)
        if base <= 0:
            return  # nothing to scale: a zero estimate stays zero
        ratio, a = seconds / base, self.alpha
        self._scale[request.pipeline] = (1 - a) * self.scale(request.pipeline) + a * ratio
        self._global = (1 - a) * self._global + a * ratio
