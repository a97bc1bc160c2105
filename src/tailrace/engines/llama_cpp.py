"""Text generation on llama.cpp (``llama-cpp-python``) with multi-sequence batch decoding.

One ``LlamaCppEngine`` loads one GGUF model and one llama.cpp context that holds
``n_seq_max`` sequences, decoded by one loop on the engine's own thread (continuous
batching): every decode step sends ONE ``llama_batch`` with the next token of each
active sequence (``seq_id`` = slot) plus chunks of prompts still being prefilled, then
samples each sequence's next token from its logits row. A finished sequence is dropped
from the KV cache (``llama_memory_seq_rm``) and its slot is refilled with the next
waiting request. ``generate`` calls from any number of threads hand their requests to
that loop, which takes them in between steps: a short request arriving while long ones
generate starts at the next step instead of waiting for them to finish.

Context: the KV cache is split per sequence (llama.cpp's non-unified cache), created
with ``n_ctx * n_seq_max`` cells, so every sequence gets its own ``n_ctx`` tokens:
``context_length == n_ctx`` (capped at the model's training context).

Structured output: a request with a ``response_format`` (``json_object``, or
``json_schema`` turned into a GBNF grammar by llama-cpp-python's ``json_schema_to_gbnf``)
gets its own llama.cpp grammar sampler, cloned from a compiled grammar cached by schema
(``llama_grammar``). Each step its token is sampled from the logits as usual and
then checked against the grammar; only a token the grammar rejects costs a pass of the
grammar over the whole vocabulary and a new draw from the allowed tokens (the same
distribution as sampling from the masked logits). End-of-generation is allowed only
where the grammar is complete, and stop strings do not apply to such a sequence (the
grammar decides where the JSON ends). Constrained and free sequences share each step.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ContextOverflow, EngineError
from ._sampling import TextStream, penalise, sample
from .base import Generation, GenerationRequest, TokenCallback
from .llama_grammar import Grammars, grammar_text, token_arrays
from .models import MODELS, model_info, model_path

_BACKEND_LOCK = threading.Lock()
_BACKEND_READY = False
_LOG = logging.getLogger(__name__)
_LOG_STATE = {"level": 0}
_LOG_CALLBACK: Any = None  # the ctypes callback; must stay referenced while installed
#: llama.cpp's most sequences per context (LLAMA_MAX_SEQ)
MAX_SEQUENCES = 256


def _on_llama_log(level: int, text: bytes | None, _user: Any) -> None:
    """llama.cpp's log messages go to Python logging, errors only (ggml level 4)."""
    if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous message
        _LOG_STATE["level"] = level
    if _LOG_STATE["level"] == 4 and text:
        _LOG.error("llama.cpp: %s", text.decode("utf-8", errors="replace").rstrip())


def llama_lib() -> Any:
    """The ``llama_cpp`` module, its backends initialised once per process and its stderr
    logging silenced; EngineError with the install command if it is missing."""
    global _BACKEND_READY, _LOG_CALLBACK
    try:
        import llama_cpp as lib
    except ImportError:
        raise EngineError("the llama_cpp backend needs llama-cpp-python; install it "
                          "with: pip install llama-cpp-python") from None
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            _LOG_CALLBACK = lib.llama_log_callback(_on_llama_log)
            lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
            lib.llama_backend_init()
            _BACKEND_READY = True
    return lib


class _Call:
    """One ``generate`` call: its requests' results, filled in by the decode loop."""

    __slots__ = ("results", "on_token", "remaining", "done", "error")

    def __init__(self, n: int, on_token: TokenCallback | None):
        self.results: list[Generation | None] = [None] * n
        self.on_token = on_token
        self.remaining = n
        self.done = threading.Event()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.done.set()


@dataclass(slots=True, eq=False)
class _Seq:
    """One request occupying a sequence slot while it is prefilled and generated."""

    call: _Call
    index: int
    slot: int
    prompt: Any  # numpy int32 token ids
    max_tokens: int
    temperature: float
    rng: Any
    stream: TextStream
    top_p: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    counts: dict[int, int] | None = None  # tokens generated so far (penalties only)
    grammar: Any = None  # the llama.cpp grammar sampler (response_format), freed at the end
    n_lp: int = -1  # tokens in lp_sum; -1: not asked for (GenerationRequest.logprobs)
    lp_sum: float = 0.0  # summed log-probabilities of the sampled tokens
    n_prompt: int = 0
    fed: int = 0  # prompt tokens already sent to the model
    pos: int = 0  # position of the next token sent for this sequence
    last: int = -1  # the last sampled token, sent in the next step
    n_gen: int = 0
    row: int = -1  # batch index whose logits belong to this sequence (-1: none)
    cached: int = 0  # prompt tokens whose KV came from the prefix cache
    priority: int = 0  # the request's class: higher is more urgent
    deadline: float = math.inf  # wall-clock seconds (EDF within a class)
    order: int = 0  # arrival order (FIFO within a class and deadline)

    def rank(self) -> tuple[int, float, int]:
        """Sort key: most urgent first."""
        return -self.priority, self.deadline, self.order

    def __post_init__(self) -> None:
        self.n_prompt = len(self.prompt)


class LlamaCppEngine:
    """A GGUF model on llama.cpp serving batches of requests with multi-sequence decoding.

    Thread-safe: concurrent ``generate`` calls share the decode loop (continuous batching).
    """

    #: ``GenerationRequest.response_format`` types enforced (by a grammar)
    response_formats = frozenset({"json_object", "json_schema"})
    #: the calls it batches itself (the decode loop): a pool in front sends them on unbatched
    continuous_batching = frozenset({"generate"})

    @staticmethod
    def check_constraint(fmt: dict[str, Any]) -> None:
        """StructuredOutputError if the checked ``response_format`` cannot become a grammar
        (a JSON Schema feature llama-cpp-python's converter lacks, e.g. ``not``)."""
        grammar_text(fmt)

    def __init__(self, model: str = "smollm2-135m-instruct", *, path: str | None = None,
                 n_threads: int | None = None, n_ctx: int = 2048, n_seq_max: int = 8,
                 n_batch: int = 512, seed: int = 0, prefix_cache: bool = True,
                 cache_sequences: int = 0, prefill_chunk: int = 64):
        """Load the model and create its multi-sequence context.

        model:     catalog name (see ``registry.MODELS``); with ``path``, just the name.
        path:      a GGUF file to load instead of the catalog's (chat/stop settings still
                   come from the catalog when ``model`` names a known model; otherwise the
                   model is a chat model if the file has a chat template).
        n_threads: CPU threads for decoding (default: ``os.cpu_count()``).
        n_ctx:     tokens of context per sequence (prompt + generated).
        n_seq_max: sequences decoded together; the context holds ``n_ctx * n_seq_max``.
        n_batch:   most tokens per decode step (prompt prefill is chunked by it).
        seed:      seeds the sampling RNG of requests without their own ``seed``.
        prefix_cache: keep a finished sequence's KV in its slot and start a new request
                   from the idle slot holding its longest prefix (see ``_loop``).
        cache_sequences: KV streams beyond ``n_seq_max`` that only hold cached prefixes
                   (each ``n_ctx`` tokens: the cache's memory budget, ``cache_bytes``);
                   at most ``n_seq_max`` sequences still decode at once.
        """
        lib = llama_lib()
        import numpy as np  # a dependency of llama-cpp-python

        if n_ctx < 1 or n_seq_max < 1 or n_batch < 1:
            raise EngineError(f"n_ctx, n_seq_max and n_batch must be positive (got {n_ctx}, "
                              f"{n_seq_max}, {n_batch})")
        if isinstance(cache_sequences, bool) or not isinstance(cache_sequences, int) \
                or cache_sequences < 0 or n_seq_max + cache_sequences > MAX_SEQUENCES:
            raise EngineError(f"cache_sequences must be an integer >= 0 with n_seq_max + "
                              f"cache_sequences <= {MAX_SEQUENCES} (got {cache_sequences!r})")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
                or prefill_chunk < 1:
            raise EngineError(f"prefill_chunk must be a positive integer, got "
                              f"{prefill_chunk!r}")
        if cache_sequences and not prefix_cache:
            raise EngineError("cache_sequences needs prefix_cache: true")
        self._np = np
        self._lib = lib
        self.model = model
        info = MODELS.get(model)
        if path is None:
            info = model_info(model, "llama_cpp")
            file = model_path(info)
        else:
            file = Path(path)
            if not file.exists():
                raise EngineError(f"model file not found: {path}")
            if info is not None and info.backend != "llama_cpp":
                info = None
        self.path = str(file)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()  # guards the context's life and the inbox
        self._inbox: deque[tuple[_Call, int, GenerationRequest, list[int], Any]] = deque()
        self._looping = False  # the decode loop is running (or queued) on _decoder
        self._idle = threading.Event()
        self._idle.set()
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix=f"llama-{model}")
        self._model = None
        self._ctx = None
        n_threads = int(n_threads or os.cpu_count() or 1)
        self.n_threads = n_threads
        self.n_seq_max = n_seq_max
        self.n_batch = max(n_batch, n_seq_max)
        self.prefix_cache = bool(prefix_cache)
        self.prefill_chunk = prefill_chunk
        self.n_streams = n_seq_max + cache_sequences  # KV streams: decoding + cache-only
        # per stream: the tokens whose KV it holds (a finished sequence's, for reuse),
        # and when it was last used (LRU); the decode loop owns them
        self._kv: list[Any] = [None] * self.n_streams
        self._used = [0] * self.n_streams
        self._tick = 0
        self.cache_lookups = 0  # requests started (prompt tokens: cache_prompt_tokens)
        self.cache_prompt_tokens = 0
        self.cache_hit_tokens = 0  # prompt tokens not computed: their KV was reused
        self.preemptions = 0  # sequences paused for a more urgent request

        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = 0
        # no weight repacking into extra buffer types: the AMX one faults where the OS
        # does not grant AMX tile state (VMs), and repacked gemm/gemv kernels would make
        # a sequence's logits depend on how many sequences share its batch
        mparams.use_extra_bufts = False
        self._model = lib.llama_model_load_from_file(self.path.encode(), mparams)
        if not self._model:
            self._model = None
            raise EngineError(f"llama.cpp could not load the model file {self.path}")
        try:
            self._vocab = lib.llama_model_get_vocab(self._model)
            self._grammars = Grammars(lib, self._vocab)  # compiled response_format grammars
            self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
            n_ctx = min(n_ctx, int(lib.llama_model_n_ctx_train(self._model)) or n_ctx)
            cparams = lib.llama_context_default_params()
            cparams.n_ctx = n_ctx * self.n_streams
            cparams.n_batch = self.n_batch
            cparams.n_ubatch = self.n_batch
            cparams.n_seq_max = self.n_streams
            cparams.n_threads = n_threads
            cparams.n_threads_batch = n_threads
            cparams.kv_unified = False  # one KV stream per sequence: each gets n_ctx cells
            cparams.no_perf = True
            self._ctx = lib.llama_init_from_model(self._model, cparams)
            if not self._ctx:
                self._ctx = None
                raise EngineError(f"llama.cpp could not create a context of "
                                  f"{n_ctx * self.n_streams} tokens for {self.path}")
            self.context_length = min(n_ctx, int(lib.llama_n_ctx_seq(self._ctx)))
            # K and V, f16, per layer: what one cached token costs
            kv_per_token = 2 * 2 * int(lib.llama_model_n_layer(self._model)) * (
                int(lib.llama_model_n_embd(self._model))
                * int(lib.llama_model_n_head_kv(self._model))
                // max(1, int(lib.llama_model_n_head(self._model))))
            self.cache_bytes = cache_sequences * self.context_length * kv_per_token
            self._mem = lib.llama_get_memory(self._ctx)
            self._template = self._meta("tokenizer.chat_template")
            if info is not None:
                self.chat = info.chat
                self.default_stop: tuple[str, ...] = info.stop
            else:
                self.chat = bool(self._template)
                self.default_stop = ()
            self._pieces: dict[int, bytes | None] = {}  # token -> piece, None for EOG
            self._formatter: Any = None
            self._init_batch()
        except BaseException:
            self.close()
            raise

    # -- public API -------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes in this model's tokenizer (as a raw prompt, with BOS)."""
        if self._model is None:
            raise EngineError(f"engine '{self.model}' is closed")
        return len(self._tokenize(text, add_special=True))

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        """Run a batch of requests together on the shared context; results in request order.

        requests: the requests; ``messages`` are rendered with the model's chat template,
                  ``prompt`` is used as is.
        on_token: called as ``on_token(request_index, piece)`` for each piece of text as it
                  is produced (never text that turns out to belong to a stop string); when
                  it returns ``False`` that sequence stops at once (``finish_reason``
                  ``"cancelled"``) and its slot goes to the next waiting request.
        """
        with self._lock:
            if self._ctx is None:
                raise EngineError(f"engine '{self.model}' is closed")
            prompts = [self._prompt_tokens(r) for r in requests]
            for r, p in zip(requests, prompts, strict=True):
                if len(p) + max(r.max_tokens, 0) > self.context_length:
                    raise ContextOverflow(
                        f"prompt has {len(p)} tokens; with max_tokens={r.max_tokens} it "
                        f"exceeds the model context of {self.context_length} tokens; shorten "
                        "the prompt (e.g. a refine stage's max_tokens) or lower max_tokens")
            call = _Call(len(requests), on_token)
            grammars = self._grammars.samplers(requests)
            for i, (r, p) in enumerate(zip(requests, prompts, strict=True)):
                if r.max_tokens <= 0:
                    call.results[i] = Generation("", len(p), 0, "length")
                    call.remaining -= 1
                    if grammars[i] is not None:
                        self._lib.llama_sampler_free(grammars[i])
                else:
                    self._inbox.append((call, i, r, p, grammars[i]))
            if call.remaining == 0:
                return call.results  # type: ignore[return-value]
            if not self._looping:
                # Decode on the engine's own thread: llama.cpp's OpenMP keeps a thread team
                # per calling thread, and teams of several callers spin against each other
                # (measured: -20% tok/s once a second thread had called in). One thread.
                self._looping = True
                self._idle.clear()
                self._decoder.submit(self._loop)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.results  # type: ignore[return-value]

    def cache_statistics(self) -> dict[str, float]:
        """The prefix cache's counters: requests started (``lookups``), their prompt
        tokens, the prompt tokens whose KV was reused (``hit_tokens``), their ratio, and
        the cache-only streams' memory (``cache_bytes``; idle decoding slots cache too)."""
        total = self.cache_prompt_tokens
        return {"lookups": self.cache_lookups, "prompt_tokens": total,
                "hit_tokens": self.cache_hit_tokens,
                "hit_ratio": self.cache_hit_tokens / total if total else 0.0,
                "cache_bytes": self.cache_bytes}

    def close(self) -> None:
        """Free the llama.cpp context and model (the engine cannot be used afterwards)."""
        lock, lib = getattr(self, "_lock", None), getattr(self, "_lib", None)
        idle = getattr(self, "_idle", None)
        if lib is None or lock is None or idle is None:
            return  # __init__ failed before the model was loaded
        deadline = time.monotonic() + 60
        while True:  # wait for calls still decoding (new ones may start meanwhile)
            if not idle.wait(timeout=max(deadline - time.monotonic(), 0)) or \
                    not lock.acquire(timeout=max(deadline - time.monotonic(), 0)):
                return
            if not self._looping:
                break
            lock.release()
        try:
            if getattr(self, "_grammars", None) is not None:
                self._grammars.close()
            if getattr(self, "_ctx", None) is not None:
                lib.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_model", None) is not None:
                lib.llama_model_free(self._model)
                self._model = None
            if getattr(self, "_decoder", None) is not None:
                self._decoder.shutdown(wait=False)
        finally:
            lock.release()

    def __del__(self) -> None:
        try:  # noqa: SIM105 - at interpreter exit, module globals (contextlib) may be gone
            self.close()
        except Exception:  # noqa: BLE001, S110
            pass

    def __repr__(self) -> str:
        return (f"LlamaCppEngine(model={self.model!r}, context_length="
                f"{getattr(self, 'context_length', '?')}, n_seq_max={self.n_seq_max})")

    # -- tokens -----------------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        size = 1 << 14
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def _tokenize(self, text: str, *, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        lib = self._lib
        cap = len(data) + 8
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, True)
        if n < 0:
            cap = -n
            buf = (lib.llama_token * cap)()
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, True)
            if n < 0:
                raise EngineError(f"llama.cpp failed to tokenize a text of {len(data)} bytes")
        return buf[:n]

    def _render(self, messages: Sequence[dict[str, str]]) -> str:
        if not self._template:
            raise EngineError(f"model '{self.model}' has no chat template; send a 'prompt' "
                              "instead of 'messages'")
        if self._formatter is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            def text(tok: int) -> str:
                if tok < 0:
                    return ""
                return self._lib.llama_vocab_get_text(self._vocab, tok).decode(
                    "utf-8", errors="replace")

            self._formatter = Jinja2ChatFormatter(
                template=self._template, eos_token=text(self._lib.llama_vocab_eos(self._vocab)),
                bos_token=text(self._lib.llama_vocab_bos(self._vocab)),
                add_generation_prompt=True)
        try:
            return self._formatter(messages=[dict(m) for m in messages]).prompt
        except Exception as e:
            raise EngineError(f"model '{self.model}': chat template failed: {e}") from e

    def _prompt_tokens(self, req: GenerationRequest) -> list[int]:
        if req.messages is not None:
            tokens = self._tokenize(self._render(req.messages), add_special=False)
        elif req.prompt is not None:
            tokens = self._tokenize(req.prompt, add_special=True)
        else:
            raise EngineError("a generation request needs 'prompt' or 'messages'")
        if not tokens:
            raise EngineError("the prompt is empty (it has no tokens)")
        return tokens

    def _piece(self, tok: int) -> bytes | None:
        """The bytes of token ``tok``; None for end-of-generation tokens (cached)."""
        lib = self._lib
        if lib.llama_vocab_is_eog(self._vocab, tok):
            piece = None
        else:
            buf = ctypes.create_string_buffer(64)
            n = lib.llama_token_to_piece(self._vocab, tok, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lib.llama_token_to_piece(self._vocab, tok, buf, -n, 0, False)
            piece = buf.raw[:max(n, 0)]
        self._pieces[tok] = piece
        return piece

    # -- batch decoding ---------------------------------------------------------------

    def _init_batch(self) -> None:
        """A ``llama_batch`` whose arrays are numpy buffers owned by the engine."""
        np, lib = self._np, self._lib
        n = self.n_batch
        self._b_tok = np.zeros(n, dtype=np.int32)
        self._b_pos = np.zeros(n, dtype=np.int32)
        self._b_nseq = np.ones(n, dtype=np.int32)
        self._b_seq = np.zeros(n, dtype=np.int32)
        self._b_out = np.zeros(n, dtype=np.int8)
        seq_ptr = ctypes.POINTER(lib.llama_seq_id)
        base = self._b_seq.ctypes.data
        self._b_seqp = (seq_ptr * n)(*[ctypes.cast(base + 4 * i, seq_ptr) for i in range(n)])
        batch = lib.llama_batch()
        batch.n_tokens = 0
        batch.token = self._b_tok.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        batch.embd = None
        batch.pos = self._b_pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        batch.n_seq_id = self._b_nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = ctypes.cast(self._b_seqp, ctypes.POINTER(seq_ptr))
        batch.logits = self._b_out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = batch
        self._row_type = ctypes.c_float * self.n_vocab

    def _loop(self) -> None:
        """The decode loop: runs while any call has requests waiting or generating."""
        np, lib = self._np, self._lib
        ctx, mem, batch = self._ctx, self._mem, self._batch
        tok, pos, seq, out = self._b_tok, self._b_pos, self._b_seq, self._b_out
        pieces, n_batch = self._pieces, self.n_batch
        row_type, frombuffer, float32 = self._row_type, np.frombuffer, np.float32
        get_logits, decode = lib.llama_get_logits_ith, lib.llama_decode
        void_p = ctypes.c_void_p
        stops_default = () if self.chat else self.default_stop
        apply, accept, free_grammar = (lib.llama_sampler_apply, lib.llama_sampler_accept,
                                       lib.llama_sampler_free)
        one, one_arr, full, full_arr = token_arrays(lib, self.n_vocab)
        one_ref, full_ref, full_data = ctypes.byref(one_arr), ctypes.byref(full_arr), full_arr.data
        neg_inf = -math.inf

        def constrain(s: _Seq, logits: Any, t: int) -> int:
            """``t`` if the grammar allows it, else a new draw among the tokens it allows
            (-1: it allows none, which a well-formed grammar never does)."""
            one[0] = (t, 0.0, 0.0)
            one_arr.size, one_arr.selected, one_arr.sorted = 1, -1, False
            apply(s.grammar, one_ref)
            if one["logit"][0] != neg_inf:
                return t
            full["logit"] = logits
            full_arr.data, full_arr.size, full_arr.selected, full_arr.sorted = (
                full_data, self.n_vocab, -1, False)
            apply(s.grammar, full_ref)
            masked = full["logit"]
            if masked.max() == neg_inf:
                return -1
            return sample(masked, s.temperature, s.rng, s.top_p)

        # requests not started: a heap by (class, deadline, arrival), most urgent first
        waiting: list[tuple[tuple[int, float, int], tuple]] = []
        paused: list[_Seq] = []  # preempted sequences: their KV stays in their stream
        arrivals = itertools.count()
        inbox, lock = self._inbox, self._lock

        def arrive(items: Any) -> None:
            for item in items:
                r = item[2]
                deadline = r.deadline if r.deadline is not None else math.inf
                heapq.heappush(waiting, ((-r.priority, deadline, next(arrivals)), item))
        kv, used = self._kv, self._used
        busy: set[int] = set()  # streams of active sequences
        active: list[_Seq] = []  # kept sorted by slot: llama.cpp splits per-seq streams
        chunk = self.prefill_chunk
        n_streams = self.n_streams
        n_active_max, reuse = self.n_seq_max, self.prefix_cache  # into ubatches of
        seq_rm = lib.llama_memory_seq_rm  # consecutive seq ids

        def take_slot(prompt: Any) -> tuple[int, int]:
            """The idle stream for ``prompt`` and how many of its tokens it holds: the
            longest cached prefix, else the least recently used (an empty one first).
            The stream keeps that prefix's KV; the rest is removed."""
            best, best_n = -1, 0
            if reuse:
                for slot in range(len(kv)):
                    held = kv[slot]
                    if slot in busy or held is None or not len(held):
                        continue
                    n = min(len(held), len(prompt) - 1)  # the last token is always run:
                    if n < chunk or n // chunk * chunk <= best_n:  # its logits start
                        continue  # the generation
                    diff = np.flatnonzero(held[:n] != prompt[:n])
                    n = (int(diff[0]) if len(diff) else n) // chunk * chunk
                    if n > best_n:
                        best, best_n = slot, n
            if best < 0:
                best = min((slot for slot in range(len(kv)) if slot not in busy),
                           key=lambda slot: (kv[slot] is not None, used[slot]))
            if best_n == 0 or not seq_rm(mem, best, best_n, -1):
                seq_rm(mem, best, -1, -1)
                best_n = 0
            kv[best] = None
            busy.add(best)
            return best, best_n

        def emit(s: _Seq, text: str) -> bool:
            """Give ``text`` to the call's callback; False: stop this sequence."""
            cb = s.call.on_token
            if cb is None:
                return True
            try:
                return cb(s.index, text) is not False
            except Exception as e:  # the caller's callback failed: only its call fails
                s.call.fail(e)
                return False

        def finish(s: _Seq, reason: str) -> None:
            tail = s.stream.finish()
            if tail and reason != "cancelled":
                emit(s, tail)
            call = s.call
            extra = {"mean_logprob": s.lp_sum / s.n_lp} if s.n_lp > 0 else {}
            if s.cached:
                extra["cached_tokens"] = s.cached
            call.results[s.index] = Generation(s.stream.text, s.n_prompt, s.n_gen, reason, extra)
            if s.grammar is not None:
                free_grammar(s.grammar)
                s.grammar = None
            if reuse:  # its prompt's KV stays for a later request with the same prefix
                # (and only the prompt's: generated tokens' KV was computed one token a
                # step, which differs in the last bits from a prefill's; reusing it made
                # greedy chats diverge from a run without the cache)
                whole = s.fed // chunk * chunk  # a partial chunk's KV would differ too
                seq_rm(mem, s.slot, whole, -1)
                kv[s.slot] = s.prompt[:whole]
                self._tick += 1
                used[s.slot] = self._tick
            else:
                seq_rm(mem, s.slot, -1, -1)
            busy.discard(s.slot)
            call.remaining -= 1
            if call.remaining == 0:
                call.done.set()

        try:
            while True:
                with lock:
                    arrive(inbox)
                    inbox.clear()
                    if not waiting and not active and not paused:
                        self._looping = False
                        self._idle.set()
                        return
                # preemption: a more urgent request waits, every decoding slot is taken
                # and a stream is spare: the least urgent sequence pauses, keeping its KV
                while waiting and len(active) >= n_active_max and len(busy) < n_streams:
                    victim = max(active, key=_Seq.rank)
                    if -waiting[0][0][0] <= victim.priority:
                        break
                    active.remove(victim)
                    paused.append(victim)
                    self.preemptions += 1
                changed = False
                while len(active) < n_active_max and (waiting or paused):
                    back = min(paused, key=_Seq.rank) if paused else None
                    if back is not None and (not waiting or len(busy) >= n_streams
                                             or back.rank() <= waiting[0][0]):
                        paused.remove(back)  # resumes where it stopped
                        active.append(back)
                        changed = True
                        continue
                    if len(busy) >= n_streams:
                        break
                    _, (call, i, r, prompt, grammar) = heapq.heappop(waiting)
                    if call.error is not None:  # its call already failed
                        if grammar is not None:
                            free_grammar(grammar)
                        continue
                    rseed = r.seed if r.seed is not None else int(self._rng.integers(1 << 63))
                    rng = np.random.default_rng(rseed) if r.temperature > 0 else None
                    stream = TextStream(() if grammar is not None
                                        else tuple(r.stop) + stops_default)
                    tokens = np.asarray(prompt, dtype=np.int32)
                    slot, hit = take_slot(tokens)
                    self.cache_lookups += 1
                    self.cache_prompt_tokens += len(tokens)
                    self.cache_hit_tokens += hit
                    active.append(_Seq(call, i, slot, tokens,
                                       r.max_tokens, r.temperature, rng, stream,
                                       r.top_p, r.presence_penalty, r.frequency_penalty,
                                       {} if r.presence_penalty or r.frequency_penalty
                                       else None, grammar, n_lp=0 if r.logprobs else -1,
                                       fed=hit, pos=hit, cached=hit,
                                       priority=r.priority,
                                       deadline=(r.deadline if r.deadline is not None
                                                 else math.inf),
                                       order=next(arrivals)))
                    changed = True
                if changed:
                    active.sort(key=lambda s: s.slot)
                if not active:
                    continue

                # prefill: most urgent first, and only the prompts of the most urgent
                # class active: a less urgent prompt waits (its sequence holds its slot
                # and KV) while a more urgent sequence is prefilled or decoded. A prompt
                # chunk costs as much as dozens of decode steps on a CPU, so one in every
                # step would stretch each of the urgent sequence's tokens by that much
                top = max(s.priority for s in active)
                budget = n_batch - sum(1 for s in active if s.fed == s.n_prompt)
                allot: dict[int, int] = {}
                for s in sorted((s for s in active if s.fed < s.n_prompt), key=_Seq.rank):
                    c = min(chunk, s.n_prompt - s.fed)
                    if s.priority < top:
                        break  # sorted: every one after it is less urgent still
                    if c > budget:
                        continue
                    allot[id(s)] = c
                    budget -= c

                # one batch: the next token of every generating sequence, prompt chunks
                n = 0
                for s in active:
                    if s.fed == s.n_prompt:
                        tok[n] = s.last
                        pos[n] = s.pos
                        seq[n] = s.slot
                        out[n] = 1
                        s.row = n
                        s.pos += 1
                        n += 1
                    elif id(s) in allot:
                        c = allot[id(s)]
                        end = n + c
                        tok[n:end] = s.prompt[s.fed:s.fed + c]
                        pos[n:end] = np.arange(s.fed, s.fed + c, dtype=np.int32)
                        seq[n:end] = s.slot
                        out[n:end] = 0
                        s.fed += c
                        s.pos = s.fed
                        if s.fed == s.n_prompt:
                            out[end - 1] = 1
                            s.row = end - 1
                        else:
                            s.row = -1
                        n = end
                    else:
                        s.row = -1
                batch.n_tokens = n
                rc = decode(ctx, batch)
                if rc != 0:
                    raise EngineError(f"llama_decode failed with code {rc} (batch of {n} "
                                      f"tokens, {len(active)} sequences)")

                done = False
                for s in active:
                    if s.row < 0:
                        continue
                    addr = ctypes.cast(get_logits(ctx, s.row), void_p).value
                    logits = frombuffer(row_type.from_address(addr),  # type: ignore[arg-type]
                                        dtype=float32)
                    if s.counts is not None:
                        logits = penalise(logits, s.counts, s.presence, s.frequency)
                    t = sample(logits, s.temperature, s.rng, s.top_p)
                    if s.grammar is not None:
                        t = constrain(s, logits, t)
                        if t < 0:  # a dead end: the JSON cannot go on
                            finish(s, "stop")
                            s.row = -2
                            done = True
                            continue
                    if s.counts is not None:
                        s.counts[t] = s.counts.get(t, 0) + 1
                    if s.n_lp >= 0:  # log-softmax of the sampled token, stable form
                        m = logits.max()
                        s.lp_sum += float(logits[t] - m) - math.log(float(np.exp(logits - m).sum()))
                        s.n_lp += 1
                    piece = pieces[t] if t in pieces else self._piece(t)
                    if piece is None:  # end of generation
                        finish(s, "stop")
                        s.row = -2
                        done = True
                        continue
                    if s.grammar is not None:
                        accept(s.grammar, t)
                    s.n_gen += 1
                    text = s.stream.feed(piece)
                    if text and not emit(s, text) or s.call.error is not None:
                        finish(s, "cancelled")  # the caller went away: free the slot now
                    elif s.stream.stopped:
                        finish(s, "stop")
                    elif s.n_gen >= s.max_tokens:
                        finish(s, "length")
                    else:
                        s.last = t
                        continue
                    s.row = -2
                    done = True
                if done:
                    active = [s for s in active if s.row != -2]
        except BaseException as e:  # every call still waiting or generating gets the error
            lib.llama_memory_clear(mem, True)
            kv[:] = [None] * len(kv)
            with lock:
                arrive(inbox)
                inbox.clear()
                self._looping = False
                self._idle.set()
            active += paused
            for s in active:
                if s.grammar is not None:
                    free_grammar(s.grammar)
                    s.grammar = None
            for call in {id(x.call): x.call for x in active}.values():
                call.fail(e)
            for _, (call, *_, grammar) in waiting:
                if grammar is not None:
                    free_grammar(grammar)
                call.fail(e)
            if not isinstance(e, Exception):
                raise
