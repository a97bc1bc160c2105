"""A pipeline's measured profile: each stage's and each engine's service time as a
function of what drives it, fitted on the real engines (``tailrace profile``) and read
by the simulator (``tailrace simulate --profile``).

Every model is linear in its drivers, ``seconds = sum(coef[d] * x[d])`` with ``x["const"]
= 1``, fitted by least squares (non-negative coefficients) with its fit error (the mean
absolute percentage error over the samples) kept beside it:

- a stage: drivers ``records`` (records in one call) and ``tokens`` (their predicted
  prompt tokens); for a stage that calls an engine, what the stage adds around the engine
  call, plus the shape of the requests it sends (``prompt_tokens`` as a model of the
  record's prompt tokens, ``output_tokens`` measured);
- a continuously batching generation engine (llama.cpp): one decode step, drivers
  ``const``, ``decoding`` (sequences decoding a token), ``prefill`` (prompt tokens
  fed) and ``starts`` (sequences started in it: each request's own set-up, sampler and
  template), for its real scheduler (``engines/llama_cpp/scheduler.py``) to be
  replayed with;
- a remote server that runs each request as its own sequence (``sequences``: an
  OpenAI-compatible server): one request's prompt (``const``, ``prefill`` per token,
  not delaying the others) and each token (``tokens``, plus ``crowd`` per other
  sequence holding a slot);
- any other engine (an embedder, a server that takes one call at a time): one call,
  drivers ``const``, ``items`` and ``tokens``.

The file is JSON (``version: 1``); ``load_profile`` names the file and key of anything
malformed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TailraceError

VERSION = 1
STAGE_DRIVERS = ("const", "records", "tokens")
STEP_DRIVERS = ("const", "decoding", "prefill", "starts")
CALL_DRIVERS = ("const", "items", "tokens")
SEQUENCE_DRIVERS = ("const", "prefill", "tokens", "crowd")
TOKEN_DRIVERS = ("const", "tokens")
MAX_CV = 1.0  # the widest spread a duration is drawn with (exponential)
OUTPUT_SAMPLES = 101  # output token counts a profile keeps per stage (order statistics)


#: engine kind -> the drivers of its model
KINDS = {"continuous": STEP_DRIVERS, "calls": CALL_DRIVERS, "sequences": SEQUENCE_DRIVERS}


class ProfileError(TailraceError):
    """A profile file is missing, malformed or does not fit the pipeline."""


@dataclass(frozen=True)
class LinearModel:
    """``seconds = sum(coef[d] * x[d])``; ``error``: its fit's mean absolute percentage
    error (0.05 is 5%); ``samples``: the measurements it was fitted on."""

    coef: Mapping[str, float]
    error: float = 0.0
    samples: int = 0
    cv: float = 0.0  # spread of a measurement around the model: std / mean (0: none)

    def __call__(self, **x: float) -> float:
        """The model at drivers ``x`` (``const`` defaults to 1: the intercept once)."""
        c = self.coef
        total = c.get("const", 0.0) * x.get("const", 1.0)
        for k, v in x.items():
            w = c.get(k)
            if w and k != "const":
                total += w * v
        return total

    def draw(self, rng: Any, **x: float) -> float:
        """One duration: the model's mean, spread by ``cv`` (a gamma draw: ``cv`` 1 is
        exponential, 0 exact; a cv above ``MAX_CV`` counts as ``MAX_CV``: a fit's spread
        that wide is a model of nearly nothing, whose draws would be 0 or seconds)."""
        return self.spread(rng, self(**x))

    def spread(self, rng: Any, mean: float) -> float:
        """A duration of mean ``mean`` drawn as ``draw`` does (for hot loops that compute
        the mean themselves)."""
        if self.cv <= 0 or mean <= 0:
            return mean
        cv = min(self.cv, MAX_CV)
        k = 1.0 / (cv * cv)
        return rng.gammavariate(k, mean / k)

    def to_dict(self) -> dict[str, Any]:
        return {"coef": dict(self.coef), "error": self.error, "samples": self.samples,
                "cv": self.cv}

    @classmethod
    def fit(cls, rows: Sequence[Mapping[str, float]], seconds: Sequence[float],
            drivers: Sequence[str]) -> LinearModel:
        """Least squares with non-negative coefficients over ``drivers`` (``const`` is
        the intercept); drivers a row lacks count 0. Needs at least one row."""
        import numpy as np

        if not rows or len(rows) != len(seconds):
            raise ValueError("fit: needs as many measurements as rows, at least one")
        a = np.array([[1.0 if d == "const" else float(r.get(d, 0.0)) for d in drivers]
                      for r in rows])
        y = np.asarray(seconds, dtype=float)
        keep = list(range(len(drivers)))
        coef = np.zeros(len(drivers))
        while keep:  # drop drivers whose best coefficient is negative, refit the rest
            sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
            if (sol >= 0).all():
                coef[:] = 0.0
                coef[keep] = sol
                break
            keep.pop(int(np.argmin(sol)))
        pred = a @ coef
        ok = (y > 0) & (pred > 0)
        err = float(np.mean(np.abs(pred[ok] - y[ok]) / y[ok])) if ok.any() else 0.0
        cv = float(np.std(y[ok] / pred[ok])) if ok.sum() > 1 else 0.0
        return cls({d: float(c) for d, c in zip(drivers, coef, strict=True)}, err, len(rows),
                   cv)


@dataclass(frozen=True)
class StageProfile:
    """One stage: its own service time per call (``service``, drivers ``records`` and
    ``tokens``); for a stage calling an engine, that engine's name and the requests it
    sends: prompt tokens as a model of the record's (``prompt_tokens``, drivers
    ``tokens``), the output tokens measured (``output_tokens``, a mean) and the leading
    prompt tokens all its requests share (``shared_tokens``). ``output_samples``: the output
    tokens measured, sorted (at most ``OUTPUT_SAMPLES`` order statistics), which a
    simulated request draws from: a call that waits for its longest answer lasts as the
    longest, not as the mean (empty: every request gets the mean)."""

    service: LinearModel
    engine: str | None = None
    prompt_tokens: LinearModel | None = None
    output_tokens: float = 0.0
    shared_tokens: int = 0  # leading prompt tokens every request of the stage shares
    # (its system prompt and template's head): what a prefix cache can reuse
    output_samples: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineProfile:
    """One engine: ``kind`` ``continuous`` (a step model for its scheduler, with
    ``n_seq_max``, ``chunk`` and ``n_batch``), ``sequences`` (a server's per-sequence
    model, ``n_seq_max`` slots) or ``calls`` (a model per call)."""

    kind: str
    model: LinearModel
    n_seq_max: int = 8
    chunk: int = 16
    n_batch: int = 512
    start_s: float = 1.0  # seconds a replica takes to start (restarts after a kill)
    ranks: bool = True  # continuous: the engine starts the most urgent request first
    # (llama.cpp's scheduler ranks by class and deadline); False: first come, first
    # served (a remote server, which ignores a request's priority)


@dataclass(frozen=True)
class Profile:
    """A pipeline's measured stages and engines (``tailrace profile``)."""

    pipeline: str
    stages: Mapping[str, StageProfile]
    engines: Mapping[str, EngineProfile]
    machine: str = ""
    created: str = ""
    notes: tuple[str, ...] = field(default=())
    input_tokens: float = 0.0  # mean predicted prompt tokens of the records profiled

    def to_dict(self) -> dict[str, Any]:
        def stage(s: StageProfile) -> dict[str, Any]:
            out: dict[str, Any] = {"service": s.service.to_dict()}
            if s.engine is not None:
                out["engine"] = s.engine
                out["prompt_tokens"] = (s.prompt_tokens or LinearModel({})).to_dict()
                out["output_tokens"] = s.output_tokens
                if s.output_samples:
                    out["output_samples"] = list(s.output_samples)
                out["shared_tokens"] = s.shared_tokens
            return out

        return {"version": VERSION, "pipeline": self.pipeline, "machine": self.machine,
                "created": self.created, "notes": list(self.notes),
                "input_tokens": self.input_tokens,
                "stages": {k: stage(s) for k, s in self.stages.items()},
                "engines": {k: {"kind": e.kind, "model": e.model.to_dict(),
                                "n_seq_max": e.n_seq_max, "chunk": e.chunk,
                                "n_batch": e.n_batch, "start_s": e.start_s,
                                "ranks": e.ranks}
                            for k, e in self.engines.items()}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _model(raw: Any, where: str, drivers: Sequence[str]) -> LinearModel:
    if not isinstance(raw, dict) or not isinstance(raw.get("coef"), dict):
        raise ProfileError(f"{where}: must be a mapping with 'coef' (driver -> seconds)")
    coef = {}
    for k, v in raw["coef"].items():
        if k not in drivers:
            raise ProfileError(f"{where}.coef: unknown driver {k!r}; known: "
                               f"{', '.join(drivers)}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v < 0:
            raise ProfileError(f"{where}.coef.{k}: must be a number >= 0, got {v!r}")
        coef[k] = float(v)
    err, n, cv = raw.get("error", 0.0), raw.get("samples", 0), raw.get("cv", 0.0)
    for key, v in (("error", err), ("cv", cv)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v < 0:
            raise ProfileError(f"{where}.{key}: must be a number >= 0, got {v!r}")
    return LinearModel(coef, float(err), int(n) if isinstance(n, int) else 0, float(cv))


def _count(raw: dict, key: str, where: str, default: int) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ProfileError(f"{where}.{key}: must be an integer >= 1, got {v!r}")
    return v


def parse_profile(raw: Any, where: str = "profile") -> Profile:
    """A ``Profile`` from its JSON form; ``ProfileError`` naming the key that is wrong."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: must be a JSON object")
    if raw.get("version") != VERSION:
        raise ProfileError(f"{where}: version must be {VERSION}, got {raw.get('version')!r}")
    known = {"version", "pipeline", "machine", "created", "notes", "stages", "engines",
             "input_tokens"}
    for key in raw:
        if key not in known:
            raise ProfileError(f"{where}: unknown key {key!r}; known: {', '.join(sorted(known))}")
    stages, engines = raw.get("stages", {}), raw.get("engines", {})
    if not isinstance(stages, dict) or not isinstance(engines, dict):
        raise ProfileError(f"{where}: 'stages' and 'engines' must be mappings")
    out_stages = {}
    for sid, s in stages.items():
        w = f"{where}: stages.{sid}"
        if not isinstance(s, dict) or "service" not in s:
            raise ProfileError(f"{w}: must be a mapping with 'service'")
        engine = s.get("engine")
        if engine is not None and engine not in engines:
            raise ProfileError(f"{w}.engine: {engine!r} is not among the profile's engines")
        out = s.get("output_tokens", 0.0)
        if isinstance(out, bool) or not isinstance(out, int | float) or out < 0:
            raise ProfileError(f"{w}.output_tokens: must be a number >= 0, got {out!r}")
        shared = s.get("shared_tokens", 0)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ProfileError(f"{w}.shared_tokens: must be an integer >= 0, got {shared!r}")
        samples = s.get("output_samples", [])
        if not isinstance(samples, list) or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in samples):
            raise ProfileError(f"{w}.output_samples: must be a list of integers >= 0, got "
                               f"{samples!r}"[:200])
        out_stages[sid] = StageProfile(
            _model(s["service"], f"{w}.service", STAGE_DRIVERS), engine,
            _model(s["prompt_tokens"], f"{w}.prompt_tokens", TOKEN_DRIVERS)
            if engine is not None and "prompt_tokens" in s else None, float(out), shared,
            tuple(sorted(samples)))
    out_engines = {}
    for name, e in engines.items():
        w = f"{where}: engines.{name}"
        if not isinstance(e, dict) or e.get("kind") not in KINDS:
            raise ProfileError(f"{w}.kind: must be one of {', '.join(KINDS)}")
        drivers = KINDS[e["kind"]]
        start = e.get("start_s", 1.0)
        if isinstance(start, bool) or not isinstance(start, int | float) or start < 0:
            raise ProfileError(f"{w}.start_s: must be a number >= 0, got {start!r}")
        ranks = e.get("ranks", True)
        if not isinstance(ranks, bool):
            raise ProfileError(f"{w}.ranks: must be true or false, got {ranks!r}")
        out_engines[name] = EngineProfile(
            e["kind"], _model(e.get("model"), f"{w}.model", drivers),
            _count(e, "n_seq_max", w, 8), _count(e, "chunk", w, 16),
            _count(e, "n_batch", w, 512), float(start), ranks)
    tokens = raw.get("input_tokens", 0.0)
    if isinstance(tokens, bool) or not isinstance(tokens, int | float) or tokens < 0:
        raise ProfileError(f"{where}: input_tokens must be a number >= 0, got {tokens!r}")
    return Profile(str(raw.get("pipeline", "")), out_stages, out_engines,
                   str(raw.get("machine", "")), str(raw.get("created", "")),
                   tuple(str(n) for n in raw.get("notes", ())), float(tokens))


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; ``ProfileError`` with the file's name when it is not one."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{p}: no such profile (make one with: tailrace profile "
                           f"PIPELINE.yaml --out {p})") from None
    except (OSError, ValueError) as e:
        raise ProfileError(f"{p}: not a JSON profile ({e})") from None
    return parse_profile(raw, str(p))
