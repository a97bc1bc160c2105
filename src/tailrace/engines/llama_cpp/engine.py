"""Text generation on llama.cpp (``llama-cpp-python``) with multi-sequence batch decoding.

One ``LlamaCppEngine`` loads one GGUF model and one context of ``n_seq_max`` sequences,
decoded by one loop on the engine's own thread (continuous batching): ``generate`` calls
from any thread put their requests (``Job``) in the engine's inbox, and the loop takes
them in between steps, so a short request starts at the next step instead of waiting for
long ones to finish (docs/engines.md, "How the engine is built").

The KV cache is split per sequence (llama.cpp's non-unified cache) into ``n_ctx *
n_streams`` cells, so every sequence gets its own ``n_ctx`` tokens: ``context_length ==
n_ctx`` (capped at the model's training context).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...errors import ContextOverflow, EngineError
from ..base import Generation, GenerationRequest, TokenCallback
from ..call import Call
from ..models import MODELS, model_info, model_path
from .decoder import Decoder
from .grammar import Grammars, grammar_text, tool_request
from .prefix_cache import PrefixCache
from .scheduler import Job, Scheduler, Seq
from .vocab import Vocab, llama_lib

#: llama.cpp's most sequences per context (LLAMA_MAX_SEQ)
MAX_SEQUENCES = 256


class LlamaCppEngine:
    """A GGUF model on llama.cpp serving batches of requests with multi-sequence decoding.

    Thread-safe: concurrent ``generate`` calls share the decode loop (continuous batching).
    """

    #: ``GenerationRequest.response_format`` types enforced (by a grammar)
    response_formats = frozenset({"json_object", "json_schema"})
    #: it answers ``GenerationRequest.tools`` (a grammar holds a call to the schema)
    tool_calls = True
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
                 cache_sequences: int = 0, prefill_chunk: int = 16, flash_attn: bool = True):
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
                   from the idle slot holding its longest prefix (``prefix_cache.py``).
        cache_sequences: KV streams beyond ``n_seq_max`` that only hold cached prefixes
                   (each ``n_ctx`` tokens: the cache's memory budget, ``cache_bytes``);
                   at most ``n_seq_max`` sequences still decode at once.
        prefill_chunk: prompt tokens a sequence sends per decode step; the prefix cache
                   reuses whole chunks only.
        flash_attn: llama.cpp's flash attention where it has it (its default). False:
                   plain attention, whose CPU prefill of pieces under 64 tokens was 2x
                   faster on the 2-core VM (decode ~10% slower); greedy answers differ in
                   the last bits from the default's (docs/engines.md).
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
        if not isinstance(flash_attn, bool):
            raise EngineError(f"flash_attn must be true or false, got {flash_attn!r}")
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
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"llama-{model}")
        self._model = None
        self._ctx = None
        self._lock = threading.Lock()  # guards the context's life and the inbox
        self._inbox: deque[Job] = deque()  # requests for the decode loop to take
        self._looping = False  # the decode loop is running (or queued) on _thread
        self._idle = threading.Event()  # set last: close() reads it as "all of these exist"
        self._idle.set()
        n_threads = int(n_threads or os.cpu_count() or 1)
        self.n_threads = n_threads
        self.n_seq_max = n_seq_max
        self.n_batch = max(n_batch, n_seq_max)
        self.prefix_cache = bool(prefix_cache)
        self.prefill_chunk = prefill_chunk
        self.n_streams = n_seq_max + cache_sequences  # KV streams: decoding + cache-only
        self._scheduler = Scheduler(n_seq_max, self.n_streams, prefill_chunk, self.n_batch)

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
            self._vocab = Vocab(lib, self._model, model)
            self._grammars = Grammars(lib, self._vocab.ptr)  # compiled response_formats
            self.n_vocab = self._vocab.n_tokens
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
            if not flash_attn:
                cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
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
            if info is not None:
                self.chat = info.chat
                self.default_stop: tuple[str, ...] = info.stop
            else:
                self.chat = bool(self._vocab.template)
                self.default_stop = ()
            mem, seq_rm = lib.llama_get_memory(self._ctx), lib.llama_memory_seq_rm
            cache = PrefixCache(self.n_streams, prefill_chunk,
                                lambda stream, p0, p1: seq_rm(mem, stream, p0, p1),
                                enabled=self.prefix_cache)
            self._decoder = Decoder(lib, self._ctx, self._vocab, self.n_batch, cache,
                                    np.random.default_rng(seed),
                                    () if self.chat else self.default_stop)
        except BaseException:
            self.close()
            raise

    # -- public API -------------------------------------------------------------------

    @property
    def preemptions(self) -> int:
        """Sequences paused so far for a more urgent request."""
        return self._scheduler.preemptions

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes in this model's tokenizer (as a raw prompt, with BOS)."""
        if self._model is None:
            raise EngineError(f"engine '{self.model}' is closed")
        return self._vocab.count(text)

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
        np = self._np
        with self._lock:
            if self._ctx is None:
                raise EngineError(f"engine '{self.model}' is closed")
            if any(r.tools is not None for r in requests):  # client tools: text + grammar
                requests = [r if r.tools is None else tool_request(r) for r in requests]
            prompts = [self._vocab.prompt(r) for r in requests]
            for r, p in zip(requests, prompts, strict=True):
                if len(p) + max(r.max_tokens, 0) > self.context_length:
                    raise ContextOverflow(
                        f"prompt has {len(p)} tokens; with max_tokens={r.max_tokens} it "
                        f"exceeds the model context of {self.context_length} tokens; shorten "
                        "the prompt (e.g. a refine stage's max_tokens) or lower max_tokens")
            call = Call(len(requests), on_token)
            grammars = self._grammars.samplers(requests)
            for i, (r, p) in enumerate(zip(requests, prompts, strict=True)):
                if r.max_tokens <= 0:
                    call.complete(i, Generation("", len(p), 0, "length"))
                    if grammars[i] is not None:
                        self._lib.llama_sampler_free(grammars[i])
                else:
                    self._inbox.append(Job(call, i, r, np.asarray(p, dtype=np.int32),
                                           grammars[i]))
            if call.done.is_set():
                return call.results
            if not self._looping:
                # Decode on the engine's own thread: llama.cpp's OpenMP keeps a thread team
                # per calling thread, and teams of several callers spin against each other
                # (measured: -20% tok/s once a second thread had called in). One thread.
                self._looping = True
                self._idle.clear()
                self._thread.submit(self._loop)
        return call.wait()

    def parts(self) -> tuple[Any, Any, Vocab, PrefixCache]:
        """(the ``llama_cpp`` module, the context, the vocabulary, the prefix cache), for
        an engine that drives this context with its own loop (``engines.collab``); the
        caller then never calls ``generate`` on this engine."""
        if self._ctx is None:
            raise EngineError(f"engine '{self.model}' is closed")
        return self._lib, self._ctx, self._vocab, self._decoder.cache

    def cache_statistics(self) -> dict[str, float]:
        """The prefix cache's counters: requests started (``lookups``), their prompt
        tokens, the prompt tokens whose KV was reused (``hit_tokens``), their ratio, and
        the cache-only streams' memory (``cache_bytes``; idle decoding slots cache too)."""
        return {**self._decoder.cache.statistics(), "cache_bytes": self.cache_bytes}

    def close(self) -> None:
        """Free the llama.cpp context and model (the engine cannot be used afterwards)."""
        idle = getattr(self, "_idle", None)
        if idle is None:
            return  # __init__ failed before the model was loaded
        lock, lib = self._lock, self._lib
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
            if self._ctx is not None:
                lib.llama_free(self._ctx)
                self._ctx = None
            if self._model is not None:
                lib.llama_model_free(self._model)
                self._model = None
            self._thread.shutdown(wait=False)
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

    # -- the decode loop (on the engine's thread) -------------------------------------

    def _loop(self) -> None:
        """Runs while any call has requests waiting, generating or paused; it only
        orchestrates: arrivals in, the scheduler's choice, one decode step."""
        scheduler, decoder, inbox, lock = self._scheduler, self._decoder, self._inbox, self._lock
        try:
            while True:
                with lock:
                    for job in inbox:
                        scheduler.add(job)
                    inbox.clear()
                    if scheduler.idle():
                        self._looping = False
                        self._idle.set()
                        return
                scheduler.schedule(decoder.start)
                if scheduler.active:
                    decoder.step(scheduler.active, scheduler.prefill())
                    scheduler.retire()
        except BaseException as e:
            self._fail_all(e)
            if not isinstance(e, Exception):
                raise

    def _fail_all(self, error: BaseException) -> None:
        """The loop failed: the KV is cleared and every call still waiting, generating or
        paused gets ``error``."""
        scheduler, decoder = self._scheduler, self._decoder
        decoder.reset()
        with self._lock:
            for job in self._inbox:
                scheduler.add(job)
            self._inbox.clear()
            self._looping = False
            self._idle.set()
        seqs, jobs = scheduler.drain()
        holders: list[Job | Seq] = [*seqs, *jobs]
        for x in holders:
            decoder.free_grammar(x)
        for job in [s.job for s in seqs] + jobs:
            job.call.fail(error)  # once per call: a call that ended ignores it
