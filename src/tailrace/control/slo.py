"""What a pipeline is promised (``PipelineSLO``) and what a request will cost (``CostModel``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .admission import Request

PRIORITIES = {"batch": 0, "standard": 1, "interactive": 2}


def is_number(x: object) -> bool:
    """True for a finite int or float (not a bool)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def is_count(x: object) -> bool:
    """True for an int >= 0 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(frozen=True)
class PipelineSLO:
    """A pipeline's latency objective, urgency class and fair-share weight.

    p99_ms: latency budget in milliseconds; a request's default deadline is arrival + p99_ms.
    priority: "interactive", "standard", "batch" or an int class; higher is more urgent.
    weight: share of contended capacity relative to the other pipelines' weights.
    pipeline: the pipeline's name, used in error messages.
    """

    p99_ms: float
    priority: str | int = "standard"
    weight: float = 1.0
    pipeline: str = ""

    def __post_init__(self) -> None:
        where = f"slo for pipeline {self.pipeline!r}" if self.pipeline else "slo"
        if not is_number(self.p99_ms) or self.p99_ms <= 0:
            raise ValueError(f"{where}: p99_ms must be a positive number of milliseconds, "
                             f"got {self.p99_ms!r}")
        if not (self.priority in PRIORITIES
                or isinstance(self.priority, int) and not isinstance(self.priority, bool)):
            raise ValueError(f"{where}: priority must be 'interactive', 'standard', 'batch' "
                             f"or an integer class (higher is more urgent), got {self.priority!r}")
        if not is_number(self.weight) or self.weight <= 0:
            raise ValueError(f"{where}: weight must be a positive number, got {self.weight!r}")

    @property
    def rank(self) -> int:
        """The priority as an int class; higher is more urgent."""
        return PRIORITIES[self.priority] if isinstance(self.priority, str) else self.priority

    @classmethod
    def from_config(cls, pipeline: str, config: Mapping[str, Any]) -> PipelineSLO:
        """Build from a YAML ``slo:`` mapping, rejecting unknown keys.

        pipeline: the pipeline's name, used in error messages.
        config: the mapping, e.g. ``{"p99_ms": 3000, "priority": "interactive"}``.
        """
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
            if not is_number(value) or value <= 0:
                raise ValueError(f"cost model: {name} must be a positive number of tokens "
                                 f"per second, got {value!r}")
        if not is_number(overhead_s) or overhead_s < 0:
            raise ValueError(f"cost model: overhead_s must be a non-negative number of "
                             f"seconds, got {overhead_s!r}")
        if not is_number(alpha) or not 0 < alpha <= 1:
            raise ValueError(f"cost model: alpha must be in (0, 1], got {alpha!r}")
        self.prefill_tps, self.decode_tps = float(prefill_tps), float(decode_tps)
        self.overhead_s, self.alpha = float(overhead_s), float(alpha)
        self._scale: dict[str, float] = {}  # per pipeline; unseen pipelines use the global one
        self._global = 1.0

    def estimate(self, request: Request) -> float:
        """Uncalibrated seconds from tokens alone.

        request: the request to estimate.
        """
        return (self.overhead_s + request.prompt_tokens / self.prefill_tps
                + request.max_tokens / self.decode_tps)

    def scale(self, pipeline: str) -> float:
        """The calibration factor (EWMA of actual / estimate) applied to a pipeline.

        pipeline: the pipeline's name.
        """
        return self._scale.get(pipeline, self._global)

    def predict(self, request: Request) -> float:
        """Predicted service seconds: the token estimate times the pipeline's calibration.

        request: the request to predict.
        """
        return self.estimate(request) * self.scale(request.pipeline)

    def observe(self, request: Request, seconds: float) -> None:
        """Move the pipeline's (and the global) calibration toward an observed service time.

        request: the request that was served.
        seconds: its measured service time.
        """
        if not is_number(seconds) or seconds < 0:
            raise ValueError(f"cost model: observed seconds must be a non-negative number, "
                             f"got {seconds!r}")
        base = self.estimate(request)
        if base <= 0:
            return  # nothing to scale: a zero estimate stays zero
        ratio, a = seconds / base, self.alpha
        self._scale[request.pipeline] = (1 - a) * self.scale(request.pipeline) + a * ratio
        self._global = (1 - a) * self._global + a * ratio
