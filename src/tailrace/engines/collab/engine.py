"""Collaborative generation: a small and a large llama.cpp model write one answer
together, a router choosing at each decision point which of them writes the next span
(docs/routing.md, "Collaborative generation").

Both models keep a KV stream per answer. The small model runs at every decision point
(its next-token distribution is what the router reads); whichever model writes a span,
the other catches up on the tokens it did not write by one batched prefill the next time
it runs, so both caches stay in step with the answer. One decode thread drives both
contexts: each step sends every answer's pending tokens to the small model in one
``llama_batch``, lets the router decide, then does the same on the large model, so
concurrent requests' collaborations batch together on both engines.

With ``span: draft`` the small model drafts each line first and the router reads the
draft: kept, it is sent on; refused, the tokens are taken back (the small model's KV cut
at the line's start, the sampler restored) and the large model writes the line.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ContextOverflow, EngineError
from ..base import Generation, GenerationRequest, TokenCallback
from ..call import Call
from ..llama_cpp import LlamaCppEngine
from ..llama_cpp.decoder import Batch
from ..llama_cpp.sampling import Sampler, TextStream
from ..price import Price, price_of
from .router import (
    DRAFT_FEATURES,
    FEATURES,
    Router,
    check_router,
    confidence,
    draft_features,
    features,
    make_router,
)

SMALL, LARGE = 0, 1
#: engine spec keys of one model (a ``llama_cpp`` spec without its backend)
MODEL_KEYS = ("model", "path", "n_threads", "n_ctx", "flash_attn", "prefill_chunk",
              "prefix_cache", "price")
#: most tokens one span of the large model may write before the router is asked again
MAX_SPAN = 32


def parse_span(span: Any, where: str = "span") -> int:
    """``span``: ``token`` (a decision before every token), ``line`` (before every line,
    at most ``MAX_SPAN`` tokens), ``draft`` (after the small model drafted the line) or N
    (every N tokens) -> N, with 0 meaning ``line`` and -1 ``draft``."""
    if span == "token":
        return 1
    if span == "line":
        return 0
    if span == "draft":
        return -1
    if isinstance(span, bool) or not isinstance(span, int) or not 1 <= span <= 256:
        raise EngineError(f"{where} must be token, line, draft or a number of tokens from "
                          f"1 to 256, got {span!r}")
    return span


#: model file pairs whose vocabularies were found the same
_SAME: set[tuple[str, ...]] = set()


def _file(m: dict[str, Any]) -> str:
    from ..models import model_info, model_path

    return str(m["path"]) if m.get("path") else \
        str(model_path(model_info(m["model"], "llama_cpp")))


def check_spec(name: str, spec: dict[str, Any]) -> None:
    """Validate a ``backend: collab`` spec without loading a model."""
    from ..opener import check_spec as check_model

    where = f"engine '{name}'"
    known = {"backend", "small", "large", "router", "span", "n_seq_max", "seed", "price",
             "latency"}
    extra = sorted(set(spec) - known)
    if extra:
        raise EngineError(f"{where}: backend collab does not take {', '.join(extra)}; it "
                          f"takes: small, large, router, span, n_seq_max, seed")
    for role in ("small", "large"):
        m = spec.get(role)
        if not isinstance(m, dict) or not (m.get("model") or m.get("path")):
            raise EngineError(f"{where}: collab needs {role}: {{model: NAME}} (a llama.cpp "
                              f"model, e.g. qwen2.5-coder-{'0.5' if role == 'small' else '1.5'}"
                              "b-instruct)")
        bad = sorted(set(m) - set(MODEL_KEYS) - {"backend"})
        if bad or m.get("backend", "llama_cpp") != "llama_cpp":
            raise EngineError(f"{where}: {role} must be a llama_cpp model spec with keys "
                              f"from {', '.join(MODEL_KEYS)}; got {sorted(m)}")
        try:
            check_model(f"{name}.{role}", {**m, "backend": "llama_cpp"}, "generate")
        except EngineError as e:
            msg = str(e)
            raise EngineError(msg if msg.startswith("engine '") else
                              f"{where}: {role}: {msg}") from None
    paths = [_file(spec[role]) for role in ("small", "large")]
    if tuple(paths) not in _SAME:  # vocabularies only (milliseconds), once per pair
        from ..llama_cpp.vocab import LlamaVocab

        try:
            same_vocabulary(LlamaVocab(paths[0]).vocab, LlamaVocab(paths[1]).vocab,
                            (Path(paths[0]).name, Path(paths[1]).name))
        except EngineError as e:
            raise EngineError(f"{where}: {e}") from None
        _SAME.add(tuple(paths))
    draft = parse_span(spec.get("span", "draft"), f"{where}: span") < 0
    check_router(spec.get("router", {"kind": "threshold"}), f"{where}: router",
                 DRAFT_FEATURES if draft else FEATURES)
    n = spec.get("n_seq_max", 4)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
        raise EngineError(f"{where}: n_seq_max must be an integer from 1 to 64, got {n!r}")


def same_vocabulary(a: Any, b: Any, names: tuple[str, str]) -> None:
    """EngineError unless vocabularies ``a`` and ``b`` (``llama_cpp.vocab.Vocab``) have the
    same tokens with the same texts (checked token by token)."""
    if a.n_tokens != b.n_tokens:
        raise EngineError(f"models {names[0]} and {names[1]} do not share a "
                          f"tokenizer ({a.n_tokens:,} vs {b.n_tokens:,} tokens); pick two "
                          "models of one family (e.g. Qwen2.5-Coder 0.5B and 1.5B)")
    lib = a._lib
    for t in range(a.n_tokens):
        ta, tb = lib.llama_vocab_get_text(a.ptr, t), lib.llama_vocab_get_text(b.ptr, t)
        if ta != tb:
            raise EngineError(f"models {names[0]} and {names[1]} do not share a "
                              f"tokenizer (token {t} is {ta!r} in one, {tb!r} in the other)")


@dataclass(eq=False)
class Duet:
    """One answer written by two models: its tokens, each model's KV stream and how much
    of the answer it holds, who writes now, and the counts usage reports."""

    call: Call
    index: int
    request: GenerationRequest
    router: Router
    tokens: list[int]  # prompt + answer so far
    n_prompt: int
    sampler: Sampler
    stream: TextStream
    slot: list[int] = field(default_factory=lambda: [-1, -1])  # KV stream per model
    fed: list[int] = field(default_factory=lambda: [0, 0])  # tokens in each model's KV
    cached: int = 0  # prompt tokens the small model's prefix cache held
    writer: int = SMALL  # who writes the current span
    left: int = 0  # tokens left in the current span; 0: a decision comes first
    by: list[int] = field(default_factory=lambda: [0, 0])  # answer tokens per model
    read: list[int] = field(default_factory=lambda: [0, 0])  # tokens each model was sent
    decisions: int = 0
    switches: int = 0
    since_large: int = 1 << 20
    line_start: bool = True
    row: int = -1  # its logits row in this step's batch; -1: none
    trace: list[tuple[Any, bool, int]] | None = None  # (features, to large, position)
    done: bool = False
    # span: draft only
    draft_at: int = -1  # where the small model's pending draft starts; -1: none
    draft: list[tuple[float, float, float]] = field(default_factory=list)  # confidences
    held: list[bytes | None] = field(default_factory=list)  # its pieces (None: the end)
    saved: tuple[Any, ...] = ()  # the sampler's state at the draft's start
    prev: int = SMALL  # who wrote the last line
    thrown: int = 0  # drafted tokens taken back


class CollaborativeEngine:
    """Two llama.cpp models sharing a tokenizer, generating together under a router.

    Thread-safe: concurrent ``generate`` calls share one decode thread; up to
    ``n_seq_max`` answers are written at once, the rest wait in arrival order (by
    priority first).
    """

    continuous_batching = frozenset({"generate"})
    response_formats: frozenset[str] = frozenset()  # no grammar on a shared answer

    def __init__(self, small: dict[str, Any], large: dict[str, Any],
                 router: Any = None, span: Any = "draft", n_seq_max: int = 4, seed: int = 0):
        """small, large: llama_cpp model specs ({model: NAME} or {path: FILE}, plus
        n_threads, n_ctx, ...). router: a router spec (``router.make_router``; default a
        top-1 threshold of 0.5). span: token, line, draft (the default) or N."""
        import numpy as np

        check_spec("collab", {"small": small, "large": large,
                              "router": router or {"kind": "threshold"}, "span": span,
                              "n_seq_max": n_seq_max})
        self._np = np
        self.span = parse_span(span)
        self.router = make_router(router or {"kind": "threshold"}, "collab: router",
                                  self.features)
        self.n_seq_max = n_seq_max
        self._rng = np.random.default_rng(seed)
        self.engines: list[LlamaCppEngine] = []
        prices = [price_of(m) for m in (small, large)]
        self.prices: list[Price] | None = \
            [p for p in prices if p is not None] if None not in prices else None
        try:
            for m in (small, large):
                opts = {k: v for k, v in m.items() if k not in ("backend", "price")}
                if "path" in opts:
                    opts.setdefault("model", Path(opts["path"]).stem)
                self.engines.append(LlamaCppEngine(**opts, n_seq_max=n_seq_max,
                                                   seed=seed))
            parts = [e.parts() for e in self.engines]
            self._lib = parts[0][0]
            self._ctx = [p[1] for p in parts]
            self._vocab = parts[0][2]
            self._cache = [p[3] for p in parts]
            names = (self.engines[0].model, self.engines[1].model)
        except BaseException:
            self.close()
            raise
        self.model = f"{names[0]}+{names[1]}"
        self.names = names
        self.chat = self.engines[0].chat
        self._stops = () if self.chat else self.engines[0].default_stop
        self.context_length = min(e.context_length for e in self.engines)
        self._batch = [Batch(self._lib, e.n_batch) for e in self.engines]
        self._n_batch = [e.n_batch for e in self.engines]
        self._row_type = ctypes.c_float * self._vocab.n_tokens
        self._lock = threading.Lock()
        self._inbox: deque[Duet] = deque()
        self._active: list[Duet] = []
        self._looping = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="collab")

    # -- public API -------------------------------------------------------------------

    @property
    def features(self) -> tuple[str, ...]:
        """The features its routers read: ``DRAFT_FEATURES`` with ``span: draft``, else
        ``FEATURES``."""
        return DRAFT_FEATURES if self.span < 0 else FEATURES

    def count_tokens(self, text: str) -> int:
        return self.engines[0].count_tokens(text)

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        """The requests' answers, each written by the two models under the engine's
        router; ``extra`` says how many tokens each model wrote (``small_tokens``,
        ``large_tokens``, ``large_share``) and how often the router was asked."""
        return self.collaborate(requests, on_token)

    def collaborate(self, requests: Sequence[GenerationRequest],
                    on_token: TokenCallback | None = None, *,
                    router: Router | Sequence[Router] | None = None,
                    trace: bool = False) -> list[Generation]:
        """``generate`` with another router (one for all, or one per request; training
        and benchmarks sweep routers on one loaded engine) and, with ``trace``, each
        decision's features, choice and position in ``extra["trace"]``."""
        np = self._np
        routers: list[Router] = list(router) if isinstance(router, (list, tuple)) else \
            [router or self.router] * len(requests)  # type: ignore[list-item]
        if len(routers) != len(requests):
            raise EngineError(f"collab: {len(routers)} routers for {len(requests)} requests")
        call = Call(len(requests), on_token)
        duets = []
        for i, (r, route) in enumerate(zip(requests, routers, strict=True)):
            if r.response_format is not None:
                raise EngineError("collab: response_format is not supported by a "
                                  "collaborative engine (no grammar spans two models)")
            prompt = self._vocab.prompt(r)
            if len(prompt) + max(r.max_tokens, 0) > self.context_length:
                raise ContextOverflow(
                    f"prompt has {len(prompt)} tokens; with max_tokens={r.max_tokens} it "
                    f"exceeds the collaborative context of {self.context_length} tokens")
            seed = r.seed if r.seed is not None else int(self._rng.integers(1 << 63))
            rng = np.random.default_rng(seed) if r.temperature > 0 else None
            d = Duet(call, i, r, route, list(prompt), len(prompt), Sampler(r, rng),
                     TextStream(tuple(r.stop) + self._stops), trace=[] if trace else None)
            if r.max_tokens <= 0:
                call.complete(i, Generation("", len(prompt), 0, "length"))
            else:
                duets.append(d)
        with self._lock:
            if not self._ctx or self._ctx[0] is None:
                raise EngineError(f"engine '{self.model}' is closed")
            self._inbox.extend(duets)
            if duets and not self._looping:
                self._looping = True
                self._thread.submit(self._loop)
        return call.wait()

    def close(self) -> None:
        """Free both models (waits for the decode thread to go idle, up to 60 s)."""
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.shutdown(wait=True)
        for e in getattr(self, "engines", []):
            e.close()
        self._ctx = [None, None]

    def __repr__(self) -> str:
        return f"CollaborativeEngine({self.model!r}, span={self.span})"

    # -- the decode loop (on the engine's thread) -------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    waiting = sorted(self._inbox, key=lambda d: -d.request.priority)
                    while waiting and len(self._active) < self.n_seq_max:
                        d = waiting.pop(0)
                        self._inbox.remove(d)
                        self._start(d)
                    if not self._active:
                        self._looping = False
                        return
                self._step(SMALL)
                self._step(LARGE)
                self._active = [d for d in self._active if not d.done]
        except BaseException as e:
            self._fail_all(e)
            if not isinstance(e, Exception):
                raise

    def _start(self, d: Duet) -> None:
        prompt = self._np.asarray(d.tokens, dtype=self._np.int32)
        d.slot[SMALL], d.fed[SMALL] = self._cache[SMALL].take(prompt)
        d.slot[LARGE], d.fed[LARGE] = self._cache[LARGE].take(prompt)
        d.cached = d.fed[SMALL]
        if self.span < 0:
            self._open_draft(d)
        self._active.append(d)

    def _wants(self, d: Duet, m: int) -> bool:
        """Does model ``m`` run for ``d`` this step? The small model when it writes or a
        decision is due; the large one while it writes."""
        if m == SMALL:
            return d.writer == SMALL or d.left == 0
        return d.writer == LARGE and d.left > 0

    def _step(self, m: int) -> None:
        """One ``llama_batch`` on model ``m``: each answer it runs for sends the tokens
        that model has not seen (prompt chunks of ``prefill_chunk``, answer tokens all at
        once), then each answer whose last token was sent takes its next token."""
        np, batch = self._np, self._batch[m]
        tok, pos, seq, out = batch.tok, batch.pos, batch.seq, batch.out
        n, budget = 0, self._n_batch[m]
        ran = []
        for d in self._active:
            d.row = -1
            if d.done or not self._wants(d, m):
                continue
            start, end = d.fed[m], len(d.tokens)
            end = min(end, start + budget - n)
            if end <= start:
                continue
            k = end - start
            tok[n:n + k] = d.tokens[start:end]
            pos[n:n + k] = np.arange(start, end, dtype=np.int32)
            seq[n:n + k] = d.slot[m]
            out[n:n + k] = 0
            d.fed[m] = end
            d.read[m] += k
            if end == len(d.tokens):
                out[n + k - 1] = 1
                d.row = n + k - 1
                ran.append(d)
            n += k
        if n == 0:
            return
        batch.c.n_tokens = n
        rc = self._lib.llama_decode(self._ctx[m], batch.c)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} on the "
                              f"{'small' if m == SMALL else 'large'} model ({n} tokens)")
        logits_of, ctx = self._lib.llama_get_logits_ith, self._ctx[m]
        for d in ran:
            addr = ctypes.cast(logits_of(ctx, d.row), ctypes.c_void_p).value
            row = np.frombuffer(self._row_type.from_address(addr),  # type: ignore[arg-type]
                                dtype=np.float32)
            if m == SMALL and d.left == 0:
                self._decide(d, row)
                if d.writer == LARGE:
                    continue  # the large model writes this token (its step comes next)
            if d.draft_at >= 0:
                self._draft(d, row)
            else:
                self._write(d, row, m)

    def _decide(self, d: Duet, row: Any) -> None:
        """A decision point: the router reads the small model's distribution and picks
        who writes the next span."""
        written = d.by[SMALL] + d.by[LARGE]
        f = features(row, written, d.since_large,
                     d.by[LARGE] / written if written else 0.0, d.line_start)
        d.writer = self._ask(d, f, written, d.writer)
        d.left = self.span or MAX_SPAN

    def _ask(self, d: Duet, f: Any, position: int, last: int) -> int:
        """The router's choice on features ``f`` at answer ``position`` (traced and
        counted; a switch when it differs from ``last``, who wrote before)."""
        who = LARGE if d.router(f) else SMALL
        if d.trace is not None:
            d.trace.append((f, who == LARGE, position))
        d.decisions += 1
        if who != last:
            d.switches += 1
        return who

    def _draw(self, d: Duet, row: Any) -> tuple[int, bytes | None]:
        """The answer's next token drawn from ``row`` and its piece (None: end of text)."""
        sampler = d.sampler
        logits = sampler.logits(row)
        t = sampler.draw(logits)
        sampler.took(logits, t)
        vocab = self._vocab
        return t, vocab.pieces[t] if t in vocab.pieces else vocab.piece(t)

    # -- span: draft ------------------------------------------------------------------

    def _open_draft(self, d: Duet) -> None:
        """The small model starts drafting the next line."""
        s = d.sampler
        d.writer, d.left, d.draft_at = SMALL, MAX_SPAN, len(d.tokens)
        d.draft, d.held = [], []
        d.saved = (None if s.counts is None else dict(s.counts), s.n_lp, s.lp_sum)

    def _draft(self, d: Duet, row: Any) -> None:
        """The small model drafts the line's next token from ``row``; at the line's end
        (a newline, ``MAX_SPAN`` tokens, its end of text or ``max_tokens``) the router
        judges the draft."""
        t, piece = self._draw(d, row)
        d.draft.append(confidence(row))
        d.held.append(piece)
        d.left -= 1
        if piece is not None:
            d.tokens.append(t)
            d.by[SMALL] += 1
        if d.call.failed:
            self._finish(d, "cancelled")
        elif piece is None or b"\n" in piece or d.left == 0 \
                or d.by[SMALL] + d.by[LARGE] >= d.request.max_tokens:
            self._judge(d)

    def _judge(self, d: Duet) -> None:
        """The router reads the finished draft: kept, its text goes out and the next line
        is drafted; refused, it is taken back and the large model writes the line."""
        n = len(d.tokens) - d.draft_at
        before = d.by[SMALL] + d.by[LARGE] - n
        f = draft_features(d.draft, before, d.since_large,
                           d.by[LARGE] / before if before else 0.0)
        who = self._ask(d, f, before, d.prev)
        d.prev, d.draft_at = who, -1
        if who == SMALL:
            d.since_large += n
            for piece in d.held:
                if piece is None:
                    self._finish(d, "stop")
                    return
                if self._emit(d, piece):
                    return
            if d.by[SMALL] + d.by[LARGE] >= d.request.max_tokens:
                self._finish(d, "length")
            else:
                self._open_draft(d)
            return
        start = len(d.tokens) - n
        del d.tokens[start:]
        d.by[SMALL] -= n
        d.thrown += len(d.held)
        if d.fed[SMALL] > start:
            if not self._cache[SMALL].cut(d.slot[SMALL], start):
                raise EngineError(f"the small model {self.names[SMALL]} cannot take back "
                                  "a draft from its KV cache; use span: line")
            d.fed[SMALL] = start
        s = d.sampler
        s.counts, s.n_lp, s.lp_sum = d.saved
        d.writer, d.left = LARGE, MAX_SPAN

    def _emit(self, d: Duet, piece: bytes) -> bool:
        """Send ``piece`` of the answer to the caller; True if that ended the answer (the
        caller left, or a stop string)."""
        text = d.stream.feed(piece)
        if text and not d.call.emit(d.index, text) or d.call.failed:
            self._finish(d, "cancelled")
        elif d.stream.stopped:
            self._finish(d, "stop")
        else:
            return False
        return True

    def _write(self, d: Duet, row: Any, m: int) -> None:
        """Model ``m`` writes the answer's next token from ``row``."""
        t, piece = self._draw(d, row)
        if piece is None:
            self._finish(d, "stop")
            return
        d.tokens.append(t)
        d.by[m] += 1
        d.since_large = 0 if m == LARGE else d.since_large + 1
        d.left -= 1
        d.line_start = b"\n" in piece
        if d.line_start and self.span == 0:
            d.left = 0  # line mode: a decision at every line start
        if self._emit(d, piece):
            return
        if d.by[SMALL] + d.by[LARGE] >= d.request.max_tokens:
            self._finish(d, "length")
        elif self.span < 0 and (d.line_start or d.left == 0):
            self._open_draft(d)  # the large model's line is written: draft the next

    def _finish(self, d: Duet, reason: str) -> None:
        tail = d.stream.finish()
        if tail and reason != "cancelled":
            d.call.emit(d.index, tail)
        d.done = True
        prompt = self._np.asarray(d.tokens[:d.n_prompt], dtype=self._np.int32)
        for m in (SMALL, LARGE):
            self._cache[m].release(d.slot[m], prompt, min(d.fed[m], d.n_prompt))
        n = d.by[SMALL] + d.by[LARGE]
        extra: dict[str, Any] = {
            "small_model": self.names[SMALL], "small_tokens": d.by[SMALL],
            "large_model": self.names[LARGE], "large_tokens": d.by[LARGE],
            "large_share": d.by[LARGE] / n if n else 0.0,
            "decisions": d.decisions, "switches": d.switches}
        if self.span < 0:
            extra["drafted_away"] = d.thrown
        if self.prices is not None:  # each model at its price: what it wrote, and what
            # it read besides (the prompt, the other model's tokens it caught up on)
            # (the small model's drafts taken back count as its output)
            out = [d.by[SMALL] + d.thrown, d.by[LARGE]]
            extra["cost"] = sum([p.cost(max(d.read[m] - out[m], 0), out[m])
                                 for m, p in enumerate(self.prices)])
        mean = d.sampler.mean_logprob()
        if mean is not None:
            extra["mean_logprob"] = mean
        if d.cached:
            extra["cached_tokens"] = d.cached
        if d.trace is not None:
            extra["trace"] = d.trace
        d.call.complete(d.index, Generation(d.stream.text, d.n_prompt, n, reason, extra))

    def _fail_all(self, error: BaseException) -> None:
        for m in (SMALL, LARGE):
            if self._ctx[m] is not None:
                self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx[m]), True)
            self._cache[m].clear()
        with self._lock:
            duets = self._active + list(self._inbox)
            self._active, self._looping = [], False
            self._inbox.clear()
        for d in duets:
            d.call.fail(error)

