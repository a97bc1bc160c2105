"""What arrives in a simulation: a recorded trace (``tailrace run/serve --trace-out``) or
open-loop Poisson arrivals at a given rate.

A trace line (JSONL)::

    {"t": 0.0123, "pipeline": "wiki-qa", "prompt_tokens": 57, "max_tokens": 64,
     "output_tokens": 41, "latency_s": 1.234, "outcome": "ok"}

``t`` (seconds from the start) and ``pipeline`` are required; ``prompt_tokens`` and
``output_tokens`` give the request's size when known (else the profile's means);
``latency_s`` and ``outcome`` are what happened in the real run (kept for comparison).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import TailraceError


class WorkloadError(TailraceError):
    """A trace file or rate option the simulator cannot use."""


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: when it arrives, for which pipeline, and its size if known."""

    t: float
    pipeline: str
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    latency_s: float | None = None  # measured, in a recorded trace
    outcome: str | None = None


def _opt_count(v: object, where: str, key: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise WorkloadError(f"{where}: {key} must be an integer >= 0 or null, got {v!r}")
    return v


def read_trace(path: str | Path) -> list[Arrival]:
    """The arrivals of a trace file, by time; WorkloadError naming the line that is bad."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise WorkloadError(f"{p}: cannot read the trace ({e.strerror or e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            raw = json.loads(line)
        except ValueError as e:
            raise WorkloadError(f"{where}: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise WorkloadError(f"{where}: a trace line must be a JSON object")
        t, pipe = raw.get("t"), raw.get("pipeline")
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) \
                or t < 0:
            raise WorkloadError(f"{where}: t must be seconds >= 0, got {t!r}")
        if not isinstance(pipe, str) or not pipe:
            raise WorkloadError(f"{where}: pipeline must be a pipeline name, got {pipe!r}")
        lat = raw.get("latency_s")
        out.append(Arrival(float(t), pipe, _opt_count(raw.get("prompt_tokens"), where,
                                                        "prompt_tokens"),
                           _opt_count(raw.get("output_tokens"), where, "output_tokens"),
                           float(lat) if isinstance(lat, int | float) else None,
                           raw.get("outcome") if isinstance(raw.get("outcome"), str) else None))
    if not out:
        raise WorkloadError(f"{p}: the trace has no requests")
    out.sort(key=lambda a: a.t)
    return out


def parse_rates(text: str, pipelines: Iterable[str]) -> dict[str, float]:
    """``--rate``: ``R`` (requests per second to each pipeline) or ``NAME=R,NAME=R``."""
    names = list(pipelines)
    rates: dict[str, float] = {}
    parts = [x.strip() for x in text.split(",") if x.strip()]
    for part in parts:
        name, eq, value = part.rpartition("=")
        if not eq:
            name, value = "", part
        try:
            r = float(value)
        except ValueError:
            raise WorkloadError(f"--rate: {value!r} is not a number of requests per "
                                "second") from None
        if not math.isfinite(r) or r <= 0:
            raise WorkloadError(f"--rate: must be > 0 requests per second, got {value!r}")
        if not name:
            rates.update(dict.fromkeys(names, r))
        elif name not in names:
            raise WorkloadError(f"--rate: no pipeline {name!r}; pipelines: {', '.join(names)}")
        else:
            rates[name] = r
    if not rates:
        raise WorkloadError("--rate: give R or NAME=R,... (requests per second)")
    return rates


def poisson(rates: Mapping[str, float], requests: int, seed: int,
            sizes: Mapping[str, tuple[int | None, int | None]] | None = None) -> list[Arrival]:
    """``requests`` open-loop Poisson arrivals in all, each pipeline at its rate (merged
    by time); ``sizes``: a pipeline's (prompt, output) tokens (None: the profile's)."""
    rng = random.Random(f"tailrace-arrivals-{seed}")
    total = sum(rates.values())
    names, weights = list(rates), [rates[n] / total for n in rates]
    sizes = sizes or {}
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(total)
        name = rng.choices(names, weights)[0] if len(names) > 1 else names[0]
        p, o = sizes.get(name, (None, None))
        out.append(Arrival(t, name, p, o))
    return out
