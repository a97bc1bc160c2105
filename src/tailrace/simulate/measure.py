"""``tailrace profile``: measure what the simulator needs on the real engines and the
real local runtime, fit its models (``profile.py``) and say how well they fit.

1. Every engine of the pipeline's ``engines:`` (a pool's replica spec), opened fresh
   (``start_s``) and called alone with requests of known shapes:

   - a generation engine that batches continuously: calls of 1..8 distinct requests (no
     prefix cache hit) of about 32..384 prompt tokens and 8..32 output tokens. For
     llama.cpp (``continuous``) each call's step-model drivers come from replaying its
     requests on the real scheduler (``engines.step_features``) and the step model is
     fitted to the calls' wall times; a remote server (the ``openai`` backend,
     ``sequences``) is fitted per sequence (``engines.sequence_features``);
   - any other engine: calls of 1..64 texts of about 8..128 tokens, fitted per call.

   Each shape runs ``repeat`` times (after a warm-up call); the lower median of its
   times is fitted, so a spike of a busy machine does not skew the model.
2. The stages: the compiled plan runs on the local runtime (the ``run`` the caller
   passes, ``tailrace.runtime.run``) over the input records, once one record at a time
   and once all at once, ``repeat`` times, so a stage's per-call cost (``const``) and
   per-record cost (``records``, ``tokens``) are told apart. A stage's time per call is
   what the run's stats metered (its operators' service time times the mean batch). For
   a stage that called an engine, the engine's predicted time for the requests it sent
   (observed at the engine) is taken out of it, and the requests' shape is kept: prompt
   tokens as a model of the record's predicted prompt tokens, and the mean output tokens.

``profile_pipeline`` returns the ``Profile`` and a ``Report`` (``format_report``: the
table ``tailrace profile`` prints).
"""

from __future__ import annotations

import os
import platform
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from time import perf_counter
from typing import IO, Any

from ..compiler import Plan
from ..control.gate import approx_prompt_tokens
from ..engines.base import GenerationRequest
from ..engines.models import backend, batches_continuously, create_engine
from ..engines.opener import is_pool, split_pool
from ..errors import TailraceError
from ..operators import BuildContext
from .engines import sequence_features, step_features
from .profile import (
    CALL_DRIVERS,
    OUTPUT_SAMPLES,
    SEQUENCE_DRIVERS,
    STAGE_DRIVERS,
    STEP_DRIVERS,
    TOKEN_DRIVERS,
    EngineProfile,
    LinearModel,
    Profile,
    ProfileError,
    StageProfile,
)

#: Words the measuring prompts are drawn from: every request a different sequence, so
#: no request shares a prefix with another (the prefix cache never hits).
_WORDS = """
able acid aged also area army away baby back ball band bank base bath bear beat bell
belt bird blow blue boat body bone book boot born boss both bowl busy cake call calm
camp card care case cash cast cell chat chip city club coal coat code cold cook cool
copy corn cost crew crop dark data date dawn deal dear deep desk diet disk dish door
down draw drop drum duck dust duty earn east easy edge else even ever face fact fair
farm fast fear feel file fill film fine fire firm fish flat flow food foot form fort
free fuel full fund gain game gate gift girl glad goal gold golf good grey grow hair
half hall hand hard head hear heat hero hill hint hold hole home hope horn host hour
huge idea inch iron item jazz join joke jump jury keen kind king knee lake lamp land
lane last late lawn lead leaf lean left lens life lift line lion list load loan lock
"""
WORDS = tuple(_WORDS.split())

#: what each measuring prompt ends with: text a model continues without stopping early
COUNT = " Count from 1 to 200: 1, 2, 3,"

#: the shapes measured: full, and with ``--quick`` (a smoke test)
GENERATION_SHAPES = {False: ((1, 2, 4, 8), (32, 128, 384), (8, 32)),
                     True: ((1, 4), (32, 96), (4, 16))}
CALL_SHAPES = {False: ((1, 4, 16, 64), (8, 32, 128)), True: ((1, 16), (8, 128))}
MAX_CALL_PROMPT = 1536  # prompt tokens of one measuring call at most (8 x 384 is skipped:
# it takes many seconds on a small CPU and adds nothing 4 x 384 does not)
GROUPS = 4  # rows a stage's one-at-a-time records are fitted as (by prompt tokens)

RunFn = Callable[[Plan, list], Any]  # (plan, records) -> a result with .stats and .errors


@dataclass
class Settings:
    """How much to measure: input records used, repeats of each shape and run, the
    sequences an OpenAI-compatible server decodes at once, fewer shapes (``quick``)."""

    records: int = 64
    repeat: int = 2
    n_seq_max: int | None = None
    quick: bool = False


@dataclass
class Report:
    """What ``tailrace profile`` prints: the profile and how it was measured."""

    profile: Profile
    records: int = 0
    failed: int = 0
    engine_s: float = 0.0
    stage_s: float = 0.0
    source: str = ""
    call_errors: dict[str, float] = field(default_factory=dict)  # stage -> a whole call's
    # fit error (its own time and its engine's predicted), for stages calling an engine


class Progress:
    """One progress line per task on ``stream``: a counter redrawn in place on a
    terminal; elsewhere (a log) the count every ``every`` seconds, and the final count
    and time."""

    def __init__(self, stream: IO[str] | None, label: str, total: int,
                 every: float = 30.0) -> None:
        self.stream, self.label, self.total, self.every = stream, label, total, every
        self.done = 0
        self.t0 = self._shown = perf_counter()
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._draw()

    def step(self) -> None:
        self.done += 1
        self._draw()

    def _draw(self) -> None:
        if self.stream is None:
            return
        if self.tty:
            self.stream.write(f"\r{self.label}: {self.done}/{self.total}")
        elif perf_counter() - self._shown >= self.every:
            self._shown = perf_counter()
            self.stream.write(f"{self.label}: {self.done}/{self.total} ...\n")
        else:
            return
        self.stream.flush()

    def close(self) -> float:
        dt = perf_counter() - self.t0
        if self.stream is not None:
            self.stream.write(f"{chr(13) if self.tty else ''}{self.label}: "
                              f"{self.done}/{self.total} in {dt:.1f} s\n")
            self.stream.flush()
        return dt


# -- engines ------------------------------------------------------------------------------

def replica_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec one replica of ``spec`` opens (a pool's base spec; a remote pool's first
    endpoint); ``_`` keys dropped."""
    base = dict(spec)
    if is_pool(spec):
        base, _ = split_pool(spec)
        endpoints = spec.get("endpoints")
        if endpoints:
            base["base_url"] = endpoints[0]
    return {k: v for k, v in base.items() if not k.startswith("_")}


def engine_kind(spec: dict[str, Any]) -> str:
    """``generate`` or ``embed``: what the engine of ``spec`` serves (as ``EnginePool``)."""
    return str(spec.get("kind") or backend(spec.get("backend"))[2][0])


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))


def _prompt(engine: Any, rng: random.Random, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens in the engine's tokenizer: random words, then
    a request to count."""
    count = getattr(engine, "count_tokens", None)
    k = max(tokens - 12, 1)
    words = [rng.choice(WORDS) for _ in range(4 * tokens)]
    text = " ".join(words[:k]) + COUNT
    if count is None:
        return text
    for _ in range(3):
        n = count(text)
        if abs(n - tokens) <= max(2, tokens // 20):
            break
        k = max(1, min(len(words), round(k * tokens / max(n, 1))))
        text = " ".join(words[:k]) + COUNT
    return text


def _lower_median(xs: Sequence[float]) -> int:
    """The index of the lower median of ``xs``."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    return order[(len(xs) - 1) // 2]


Samples = dict[Any, list[tuple[dict[str, float], float]]]  # shape -> (drivers, seconds)


def _medians(samples: Samples) -> tuple[list[dict[str, float]], list[float]]:
    """One row per shape: the lower median of its repeats (a busy moment's spike, or
    one repeat in two, does not move it)."""
    rows, secs = [], []
    for runs in samples.values():
        i = _lower_median([s for _, s in runs])
        rows.append(runs[i][0])
        secs.append(runs[i][1])
    return rows, secs


def fit_steps(rows: Sequence[dict[str, float]], seconds: Sequence[float]) -> LinearModel:
    """The step model from calls: a call of ``step_features`` ``x`` lasts ``const * x[const]
    + decoding * x[decoding] + prefill * x[prefill]``, its ``const`` driver the steps it
    took (not an intercept, as ``LinearModel.fit`` has it: fitted as ``steps``). Fitted
    on relative error (``fit_relative``): unweighted, the calls of 8 long requests set
    the model and a lone request, a pipeline's usual call, came out 20-60% slow."""
    renamed = [{"steps": r.get("const", 0.0), **{d: r.get(d, 0.0) for d in STEP_DRIVERS[1:]}}
               for r in rows]
    m = fit_relative(renamed, seconds, ("steps",) + STEP_DRIVERS[1:])
    coef = {"const": m.coef["steps"], **{d: m.coef[d] for d in STEP_DRIVERS[1:]}}
    return LinearModel(coef, m.error, m.samples, m.cv)


def fit_relative(rows: Sequence[dict[str, float]], seconds: Sequence[float],
                 drivers: Sequence[str]) -> LinearModel:
    """``LinearModel.fit`` weighing each row by 1 / its seconds: least squares of the
    relative error, which the fit error (a mean relative error) measures, so rows of a
    fraction of a millisecond count as much as a batch of a hundred milliseconds. A row
    of 0 seconds weighs as one of 5% of the median. ``cv`` is robust: 1.4826 x the
    median absolute deviation of measured / predicted, so one row of a busy moment does
    not make every simulated call erratic (a gamma draw of cv 5 is mostly near 0)."""
    pos = sorted(s for s in seconds if s > 0)
    if not pos:
        return LinearModel({d: 0.0 for d in drivers}, 0.0, len(rows), 0.0)
    floor = 0.05 * pos[len(pos) // 2]
    weights = [1.0 / max(s, floor) for s in seconds]
    scaled = [{("one" if d == "const" else d): w * (1.0 if d == "const" else r.get(d, 0.0))
               for d in drivers} for r, w in zip(rows, weights, strict=True)]
    names = ["one" if d == "const" else d for d in drivers]
    m = LinearModel.fit(scaled, [w * s for s, w in zip(seconds, weights, strict=True)], names)
    # relative errors are unchanged by the weights: the fit's error stands
    model = LinearModel({d: m.coef[n] for d, n in zip(drivers, names, strict=True)})
    ratios = [s / p for s, p in ((s, model(**r)) for r, s in zip(rows, seconds, strict=True))
              if s > 0 and p > 0]
    cv = 0.0
    if len(ratios) > 1:
        mid = statistics.median(ratios)
        cv = 1.4826 * statistics.median(abs(x - mid) for x in ratios)
    return replace(model, error=m.error, samples=m.samples, cv=cv)


def _fed(g: Any) -> int:
    """Prompt tokens a generation fed (its cached prefix, if any, was not)."""
    cached = g.extra.get("cached_tokens") if isinstance(g.extra, dict) else 0
    return max(int(g.prompt_tokens) - int(cached or 0), 1)


def generation_shapes(quick: bool, most: int | None = None) -> list[tuple[int, int]]:
    """(requests, prompt tokens) of the measuring calls of a generation engine that
    batches continuously (``most``: requests a call at most, a server's slots)."""
    ns, ps, _ = GENERATION_SHAPES[quick]
    return [(n, p) for n in ns for p in ps
            if n * p <= MAX_CALL_PROMPT and (most is None or n <= most)]


def call_features(eprof: EngineProfile, shapes: list[tuple[int, int]]) -> dict[str, float]:
    """The drivers of the model of ``eprof``'s kind for one call of requests shaped
    ``(prompt tokens fed, output tokens)`` alone on the engine: replayed on the real
    scheduler (``continuous``), or the server's sequences in step (``sequences``)."""
    if eprof.kind == "sequences":
        return sequence_features(shapes)
    return step_features(eprof, shapes)


def measure_generation(engine: Any, eprof: EngineProfile, settings: Settings,
                       progress: Progress, seed: int = 0) -> LinearModel:
    """The model (a decode step's, or a server's sequences') of a continuously batching
    generation engine, fitted on calls of the shapes of ``generation_shapes``."""
    ms = GENERATION_SHAPES[settings.quick][2]
    rng = random.Random(f"tailrace-profile-{seed}")
    engine.generate([GenerationRequest(prompt=_prompt(engine, rng, 32), max_tokens=8)])  # warm
    most = eprof.n_seq_max if eprof.kind == "sequences" else None
    samples: Samples = {}
    for _ in range(settings.repeat):
        for n, p in generation_shapes(settings.quick, most):
            for m in ms:
                reqs = [GenerationRequest(prompt=_prompt(engine, rng, p), max_tokens=m)
                        for _ in range(n)]
                t0 = perf_counter()
                gens = engine.generate(reqs)
                dt = perf_counter() - t0
                x = call_features(eprof, [(_fed(g), max(int(g.completion_tokens), 1))
                                          for g in gens])
                samples.setdefault((n, p, m), []).append((x, dt))
                progress.step()
    if eprof.kind == "sequences":
        return fit_relative(*_medians(samples), SEQUENCE_DRIVERS)
    return fit_steps(*_medians(samples))


def measure_calls(engine: Any, kind: str, settings: Settings, progress: Progress,
                  seed: int = 0) -> LinearModel:
    """The per-call model of an engine that takes one call at a time: embeddings of
    ``CALL_SHAPES`` texts, or generation calls of as many requests."""
    ns, ts = CALL_SHAPES[settings.quick]
    rng = random.Random(f"tailrace-profile-{seed}")

    def call(n: int, t: int) -> tuple[dict[str, float], float]:
        if kind == "embed":
            texts = [_words(rng, t)[:4 * t] for _ in range(n)]
            t0 = perf_counter()
            engine.embed(texts)
            dt = perf_counter() - t0
            return {"items": n, "tokens": sum(len(x) // 4 + 1 for x in texts)}, dt
        reqs = [GenerationRequest(prompt=_prompt(engine, rng, t), max_tokens=16)
                for _ in range(n)]
        t0 = perf_counter()
        gens = engine.generate(reqs)
        dt = perf_counter() - t0
        return {"items": n, "tokens": sum(int(g.prompt_tokens) for g in gens)}, dt

    call(1, ts[0])  # warm-up
    samples: Samples = {}
    for _ in range(settings.repeat):
        for n in ns:
            for t in ts:
                samples.setdefault((n, t), []).append(call(n, t))
                progress.step()
    return fit_relative(*_medians(samples), CALL_DRIVERS)


def measure_engine(name: str, spec: dict[str, Any], settings: Settings,
                   stream: IO[str] | None) -> tuple[EngineProfile, list[str]]:
    """Open the engine of ``spec`` (timed: ``start_s``), measure it, close it; with the
    notes to keep about how."""
    base = replica_spec(spec)
    try:
        kind = engine_kind(base)
        t0 = perf_counter()
        engine = create_engine(base)
        start_s = perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - any backend's failure to open, said in one line
        raise ProfileError(f"engine '{name}': cannot open it: {e}") from None
    notes: list[str] = []
    try:
        if kind == "generate" and batches_continuously(base, "generate"):
            if hasattr(engine, "prefill_chunk"):  # llama.cpp: its scheduler's settings
                eprof = EngineProfile("continuous", LinearModel({}), int(engine.n_seq_max),
                                      int(engine.prefill_chunk),
                                      int(getattr(engine, "n_batch", 512)), start_s)
                how = "step drivers replayed on the real scheduler"
            else:  # a remote server: how it batches is not visible from here
                n_seq = int(settings.n_seq_max or getattr(engine, "n_seq_max", 0) or 8)
                eprof = EngineProfile("sequences", LinearModel({}), n_seq, start_s=start_s,
                                      ranks=False)
                how = "a request's prefill and tokens fitted per sequence"
                notes.append(f"engine '{name}' (backend {base.get('backend')}): a server "
                             "that batches continuously, modelled as sequences sharing its "
                             f"decode; assumed {n_seq} slots (--n-seq-max), requests "
                             "started in arrival order: not read from the server")
            ns, ps, ms = GENERATION_SHAPES[settings.quick]
            most = eprof.n_seq_max if eprof.kind == "sequences" else None
            shapes = generation_shapes(settings.quick, most)
            prog = Progress(stream, f"engine {name}", len(shapes) * len(ms) * settings.repeat)
            model = measure_generation(engine, eprof, settings, prog)
            notes.append(f"engine '{name}': {prog.done} generate calls alone "
                         f"(1..{max(n for n, _ in shapes)} distinct requests, "
                         f"~{min(ps)}..{max(ps)} prompt and {min(ms)}..{max(ms)} output "
                         f"tokens) in {prog.close():.1f} s; {how}")
            return replace(eprof, model=model), notes
        ns, ts = CALL_SHAPES[settings.quick]
        prog = Progress(stream, f"engine {name}", len(ns) * len(ts) * settings.repeat)
        model = measure_calls(engine, kind, settings, prog)
        notes.append(f"engine '{name}': {prog.done} {kind} calls alone (1..{max(ns)} items "
                     f"of ~{min(ts)}..{max(ts)} tokens) in {prog.close():.1f} s")
        return EngineProfile("calls", model, start_s=start_s), notes
    except ProfileError:
        raise
    except Exception as e:  # noqa: BLE001 - a call failed: name the engine
        why = str(e) if isinstance(e, TailraceError) else f"{type(e).__name__}: {e}"
        raise ProfileError(f"engine '{name}': a measuring call failed: {why}") from None
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


# -- stages -------------------------------------------------------------------------------

@dataclass
class Seen:
    """One engine call a stage made, as the engine saw it."""

    stage: str
    engine: str
    kind: str  # generate | embed
    shapes: list[tuple[int, int]]  # generate: (prompt tokens fed, output tokens)
    prompts: list[int]  # generate: each request's prompt tokens; embed: each text's
    seconds: float
    requests: list[Any] = field(default_factory=list)  # generate: the requests
    tap: Tap | None = None  # the engine it was made on (to tokenize ``requests``)


class Tap:
    """An engine as a stage sees it, every ``generate`` and ``embed`` call logged."""

    def __init__(self, inner: Any, stage: str, engine: str, log: list[Seen]) -> None:
        self._inner, self._stage, self._engine, self._log = inner, stage, engine, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, requests: Any, *args: Any, **kw: Any) -> Any:
        t0 = perf_counter()
        gens = self._inner.generate(requests, *args, **kw)
        dt = perf_counter() - t0
        self._log.append(Seen(self._stage, self._engine, "generate",
                              [(_fed(g), max(int(g.completion_tokens), 1)) for g in gens],
                              [int(g.prompt_tokens) for g in gens], dt, list(requests), self))
        return gens

    def head(self, req: GenerationRequest) -> list[int] | str:
        """``req``'s prompt tokens where the engine's vocabulary is at hand (llama.cpp),
        else its text (the chat messages, tagged by role)."""
        parts = getattr(self._inner, "parts", None)
        if callable(parts):  # llama.cpp: (lib, context, vocabulary, cache)
            try:
                return list(parts()[2].prompt(req))
            except Exception:  # noqa: BLE001 - closed, or not that: the text will do
                pass
        if req.messages is not None:
            return "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in req.messages)
        return req.prompt or ""

    def count(self, text: str) -> int:
        count = getattr(self._inner, "count_tokens", None)
        return int(count(text)) if callable(count) else len(text) // 4 + 1

    def embed(self, texts: Any, *args: Any, **kw: Any) -> Any:
        t0 = perf_counter()
        out = self._inner.embed(texts, *args, **kw)
        dt = perf_counter() - t0
        self._log.append(Seen(self._stage, self._engine, "embed", [],
                              [len(t) // 4 + 1 for t in texts], dt))
        return out


def tapped(plan: Plan, log: list[Seen]) -> Plan:
    """``plan`` with every engine its operators open wrapped in a ``Tap`` into ``log``."""
    def wrap(build: Callable, sid: str) -> Callable:
        def build_tapped(params: dict[str, Any], ctx: BuildContext) -> Any:
            opener = ctx.open_engine

            def open_tapped(spec: dict[str, Any]) -> Any:
                name = str(spec.get("_name") or params.get("engine") or "")
                return Tap(opener(spec), sid, name, log)

            return build(params, BuildContext(ctx.contract, open_tapped))
        return build_tapped

    stages = []
    for s in plan.stages:
        if s.execution is None:
            stages.append(s)
            continue
        ops = tuple(replace(o, op=replace(o.op, build=wrap(o.op.build, s.id))) for o in s.ops)
        stages.append(replace(s, ops=ops))
    return replace(plan, stages=tuple(stages))


@dataclass
class StageRun:
    """What one stage did in one run: calls, records, seconds (metered), the records'
    predicted prompt tokens added up, and the engine calls it made."""

    calls: int
    records: int
    seconds: float
    tokens: float
    seen: list[Seen] = field(default_factory=list)


def stage_runs(plan: Plan, stats: Any, log: list[Seen], tokens: float) -> dict[str, StageRun]:
    """Per plan stage (not the sources): what ``stats`` (a ``RunStats``) metered of its
    operators; ``tokens``: the mean predicted prompt tokens of the run's records."""
    by_op = {s.stage: s for s in stats.stages}
    out = {}
    for s in plan.stages:
        if s.execution is None:
            continue
        first = by_op.get(s.ops[0].id)
        if first is None:
            continue
        calls = int(first.batch_size.count)
        records = int(first.service_us.count)
        secs = sum(by_op[o.id].service_us.mean * by_op[o.id].service_us.count
                   for o in s.ops if o.id in by_op) / 1e6
        out[s.id] = StageRun(calls, records, secs, records * tokens,
                             [c for c in log if c.stage == s.id])
    return out


class EngineTime:
    """The fitted engines' predicted time for the calls a stage made."""

    def __init__(self, engines: dict[str, EngineProfile]) -> None:
        self.engines = engines
        self._steps: dict[tuple, dict[str, float]] = {}

    def __call__(self, c: Seen) -> float:
        e = self.engines.get(c.engine)
        if e is None:
            return 0.0
        if c.kind == "embed" or e.kind == "calls":
            return e.model(items=len(c.prompts), tokens=sum(c.prompts))
        key = (e.kind, e.n_seq_max, e.chunk, e.n_batch, tuple(c.shapes))
        x = self._steps.get(key)
        if x is None:
            x = self._steps[key] = call_features(e, c.shapes)
        return e.model(**x)  # a step model's const is per step: x["const"] steps


def _engine_of(runs: list[StageRun], engines: dict[str, EngineProfile]) -> str | None:
    """The engine a stage called most (by requests), among the profiled ones."""
    counts: dict[str, int] = {}
    for r in runs:
        for c in r.seen:
            if c.engine in engines:
                counts[c.engine] = counts.get(c.engine, 0) + len(c.prompts)
    return max(counts, key=lambda k: counts[k]) if counts else None


@dataclass
class Row:
    """A fit row of one stage: per call, mean records and tokens, the time the stage took
    (metered) and its engine's predicted time for the calls it made."""

    x: dict[str, float]
    seconds: float
    engine_s: float

    @property
    def own(self) -> float:
        """The stage's own time: its engine's predicted time taken out, at least 0."""
        return max(self.seconds - self.engine_s, 0.0)


def _row(runs: list[StageRun], engine: str | None, predict: EngineTime) -> Row | None:
    """The row of several runs of one stage (None: they made no call)."""
    calls = sum(r.calls for r in runs)
    if not calls:
        return None
    pred = sum(predict(c) for r in runs for c in r.seen if c.engine == engine)
    return Row({"records": sum(r.records for r in runs) / calls,
                "tokens": sum(r.tokens for r in runs) / calls},
               sum(r.seconds for r in runs) / calls, pred / calls)


@dataclass
class StageFit:
    """A stage's profile, the notes about it and, for a stage calling an engine, the
    mean relative error of a whole call's predicted time (its own and its engine's)
    against the measured (None: no engine)."""

    profile: StageProfile
    notes: list[str]
    call_error: float | None = None


def fit_stage(sid: str, alone: list[list[tuple[float, StageRun]]],
              together: list[StageRun], engines: dict[str, EngineProfile],
              predict: EngineTime) -> StageFit:
    """A stage's profile from its runs: ``alone``, per repeat, (the record's predicted
    prompt tokens, the run of that record alone); ``together``: the runs of all
    records at once."""
    notes: list[str] = []
    every = [r for rep in alone for _, r in rep] + together
    engine = _engine_of(every, engines)
    others = {c.engine for r in every for c in r.seen} - {engine}
    if others:
        notes.append(f"stage '{sid}' also called {', '.join(sorted(others))}: their time "
                     f"counts as the stage's own (the simulator sends its calls to "
                     f"'{engine}' only)")
    rows: list[Row] = []
    for rep in alone:  # by prompt tokens, in GROUPS rows: records 1, tokens told apart
        ordered = [r for _, r in sorted(rep, key=lambda x: x[0])]
        k = min(GROUPS, len(ordered))
        for g in range(k):
            row = _row(ordered[g * len(ordered) // k:(g + 1) * len(ordered) // k], engine,
                       predict)
            if row is not None:
                rows.append(row)
    for r in together:
        row = _row([r], engine, predict)
        if row is not None:
            rows.append(row)
    if not rows:
        notes.append(f"stage '{sid}' saw no records: its service time is 0")
        return StageFit(StageProfile(LinearModel({})), notes)
    service = fit_relative([r.x for r in rows], [r.own for r in rows], STAGE_DRIVERS)
    if engine is None:
        return StageFit(StageProfile(service), notes)
    measured = [(service(**r.x) + r.engine_s, r.seconds) for r in rows if r.seconds > 0]
    call_error = (sum(abs(p - m) / m for p, m in measured) / len(measured)
                  if measured else 0.0)
    calls = [c for r in every for c in r.seen if c.engine == engine]
    prompt_model = None
    output = 0.0
    if engines[engine].kind == "continuous" or any(c.kind == "generate" for c in calls):
        pairs = [({"tokens": t}, float(p)) for rep in alone for t, r in rep
                 for c in r.seen if c.engine == engine for p in c.prompts]
        if pairs:
            prompt_model = LinearModel.fit([x for x, _ in pairs], [p for _, p in pairs],
                                           TOKEN_DRIVERS)
        outs = sorted(o for c in calls for _, o in c.shapes)
        output = sum(outs) / len(outs) if outs else 0.0
    return StageFit(StageProfile(service, engine, prompt_model, output, shared_tokens(calls),
                                 order_statistics(outs) if output else ()), notes, call_error)


def order_statistics(xs: list[int], n: int = OUTPUT_SAMPLES) -> tuple[int, ...]:
    """``xs`` sorted, or ``n`` of its order statistics evenly spaced (first and last
    kept) when it has more."""
    xs = sorted(xs)
    if len(xs) <= n:
        return tuple(xs)
    return tuple(xs[round(i * (len(xs) - 1) / (n - 1))] for i in range(n))


def shared_tokens(calls: list[Seen]) -> int:
    """The leading prompt tokens every request of ``calls`` shares (its system prompt and
    the template's head): exact where the engine's vocabulary is at hand, else the
    shared text's tokens counted. 0 unless at least two different requests were seen."""
    reqs = [(c.tap, r) for c in calls if c.tap is not None for r in c.requests]
    if len({repr(r) for _, r in reqs}) < 2:
        return 0
    tap = reqs[0][0]
    assert tap is not None
    heads = [t.head(r) for t, r in reqs if t is not None]
    first = heads[0]
    n = len(first)
    for h in heads[1:]:
        if type(h) is not type(first):
            return 0
        n = min(n, len(h))
        for i in range(n):
            if h[i] != first[i]:
                n = i
                break
    if isinstance(first, str):
        return tap.count(first[:n]) if n else 0
    return n


def measure_stages(plan: Plan, records: list, run: RunFn,
                   engines: dict[str, EngineProfile], settings: Settings,
                   stream: IO[str] | None
                   ) -> tuple[dict[str, StageProfile], list[str], int, dict[str, float]]:
    """Run ``plan`` over ``records`` one at a time and all at once, ``settings.repeat``
    times; each stage's profile, notes, how many records failed (in the last repeat's
    one-at-a-time runs) and, per stage calling an engine, its whole calls' fit error."""
    log: list[Seen] = []
    plan_t = tapped(plan, log)
    toks = [float(approx_prompt_tokens(r)) for r in records]
    mean_tok = sum(toks) / len(toks)
    prog = Progress(stream, "stages", (len(records) + 1) * settings.repeat + 1)

    def once(recs: list, tokens: float) -> tuple[dict[str, StageRun], int]:
        log.clear()
        res = run(plan_t, recs)
        prog.step()
        return stage_runs(plan, res.stats, list(log), tokens), len(res.errors)

    _, failed = once(records[:4], mean_tok)  # warm-up: engines, indexes, first calls
    alone: dict[str, list[list[tuple[float, StageRun]]]] = {}
    together: dict[str, list[StageRun]] = {}
    for _ in range(settings.repeat):
        reps: dict[str, list[tuple[float, StageRun]]] = {}
        failed = 0
        for rec, t in zip(records, toks, strict=True):
            got, bad = once([rec], t)
            failed += bad
            for sid, r in got.items():
                reps.setdefault(sid, []).append((t, r))
        for sid, rs in reps.items():
            alone.setdefault(sid, []).append(rs)
        got, _ = once(records, mean_tok)
        for sid, r in got.items():
            together.setdefault(sid, []).append(r)
    dt = prog.close()
    if failed == len(records):
        raise ProfileError(f"pipeline '{plan.name}': every input record failed; run it "
                           "with `tailrace run` to see why")
    predict = EngineTime(engines)
    stages: dict[str, StageProfile] = {}
    call_errors: dict[str, float] = {}
    notes = [f"stages: {len(records)} records run on the local runtime one at a time and "
             f"all at once, {settings.repeat} time(s), in {dt:.1f} s; a stage's time is its "
             "operators' metered service time per call, less its engine's predicted time"]
    for s in plan.stages:
        if s.execution is None:
            continue
        fit = fit_stage(s.id, alone.get(s.id, []), together.get(s.id, []), engines, predict)
        stages[s.id] = fit.profile
        notes += fit.notes
        if fit.call_error is not None:
            call_errors[s.id] = fit.call_error
            notes.append(f"stage '{s.id}': a whole call's predicted time (its own and "
                         f"that of engine '{fit.profile.engine}') is off the measured by "
                         f"{fit.call_error:.1%} on average")
        used = {str(o.params.get("engine")) for o in s.ops if o.params.get("engine")}
        if used and fit.profile.engine is None and s.id in alone:
            notes.append(f"stage '{s.id}' opens engine {', '.join(sorted(used))} but made "
                         "no generate or embed call (e.g. only counts tokens): it has no "
                         "engine in the profile")
    if failed:
        notes.append(f"{failed} of {len(records)} records failed in the one-at-a-time runs")
    return stages, notes, failed, call_errors


# -- the whole -----------------------------------------------------------------------------

def machine() -> str:
    """This machine, in one line: OS, CPU and how many."""
    cpu = platform.processor() or platform.machine()
    return f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs"


def profile_pipeline(plan: Plan, records: list, run: RunFn, settings: Settings | None = None,
                     source: str = "", stream: IO[str] | None = None) -> Report:
    """Measure ``plan``'s engines and stages (``run(plan, records)`` runs a plan on the
    local runtime) over ``records``; progress lines go to ``stream`` (None: none)."""
    settings = settings or Settings()
    if settings.repeat < 1 or settings.records < 1:
        raise ProfileError("--repeat and --records must be at least 1")
    records = list(records)[:settings.records]
    if not records:
        raise ProfileError(f"pipeline '{plan.name}': no input records to profile with")
    check = run(plan, records[:2])  # before minutes of measuring: does the plan run at all?
    if check.errors and len(check.errors) >= min(2, len(records)):
        e = check.errors[0]
        raise ProfileError(f"pipeline '{plan.name}': its input records fail (stage "
                           f"'{e.stage}': {e.error}: {e.message}); check them with "
                           "`tailrace run`")
    engines: dict[str, EngineProfile] = {}
    notes: list[str] = []
    t0 = perf_counter()
    for name, spec in (plan.pipeline.engines or {}).items():
        engines[name], more = measure_engine(name, dict(spec), settings, stream)
        notes += more
    t1 = perf_counter()
    stages, more, failed, call_errors = measure_stages(plan, records, run, engines, settings,
                                                       stream)
    notes += more
    if source:
        notes.insert(0, f"input: {source}")
    tokens = sum(approx_prompt_tokens(r) for r in records) / len(records)
    prof = Profile(plan.name, stages, engines, machine(),
                   datetime.now().astimezone().isoformat(timespec="seconds"), tuple(notes),
                   float(tokens))
    return Report(prof, len(records), failed, t1 - t0, perf_counter() - t1, source,
                  call_errors)


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g}ms"


def _formula(m: LinearModel, drivers: Sequence[str]) -> str:
    parts = [_ms(m.coef.get("const", 0.0))]
    parts += [f"{_ms(m.coef.get(d, 0.0))}*{d}" for d in drivers if d != "const"]
    return " + ".join(parts)


def format_report(report: Report) -> str:
    """The table ``tailrace profile`` prints: each engine and stage, its model's
    coefficients, fit error and samples."""
    p = report.profile
    lines = [f"profile of '{p.pipeline}': {report.records} input records "
             f"(~{p.input_tokens:.0f} prompt tokens each), engines measured in "
             f"{report.engine_s:.1f} s, stages in {report.stage_s:.1f} s", ""]
    rows: list[tuple[str, ...]] = [("ENGINE", "KIND", "MODEL (seconds)", "FIT ERR", "SAMPLES",
                                    "")]
    for name, e in p.engines.items():
        if e.kind == "continuous":
            rows.append((name, e.kind, _formula(e.model, STEP_DRIVERS) + " per step",
                         f"{e.model.error:.1%}", str(e.model.samples),
                         f"n_seq_max {e.n_seq_max}, chunk {e.chunk}, start {e.start_s:.2f}s"))
        elif e.kind == "sequences":
            rows.append((name, e.kind, _formula(e.model, SEQUENCE_DRIVERS) + " per request",
                         f"{e.model.error:.1%}", str(e.model.samples),
                         f"{e.n_seq_max} slots, start {e.start_s:.2f}s"))
        else:
            rows.append((name, e.kind, _formula(e.model, CALL_DRIVERS) + " per call",
                         f"{e.model.error:.1%}", str(e.model.samples),
                         f"start {e.start_s:.2f}s"))
    lines += (_table(rows) if p.engines else ["engines: none"]) + [""]
    rows = [("STAGE", "ENGINE", "OWN MODEL (seconds per call)", "FIT ERR", "SAMPLES",
             "CALL ERR", "REQUESTS")]
    for sid, s in p.stages.items():
        req = ""
        if s.prompt_tokens is not None:
            c = s.prompt_tokens.coef
            req = (f"prompt {c.get('const', 0.0):.0f} + {c.get('tokens', 0.0):.2f}*tokens "
                   f"({s.shared_tokens} shared), output {s.output_tokens:.1f}")
        err = report.call_errors.get(sid)
        rows.append((sid, s.engine or "-", _formula(s.service, STAGE_DRIVERS),
                     f"{s.service.error:.1%}", str(s.service.samples),
                     "-" if err is None else f"{err:.1%}", req))
    lines += _table(rows)
    if report.failed:
        lines += ["", f"{report.failed} of {report.records} records failed (see the notes)"]
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]
