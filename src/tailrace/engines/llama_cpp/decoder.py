"""One llama.cpp context's decode steps: start a request in a KV stream, send one
``llama_batch`` (each decoding sequence's next token plus the allotted prompt chunks),
sample each sequence whose logits came back, finish sequences. ``step`` is the engine's
hot path: per token it only reads a logits row, samples, feeds the text stream and hands
the text on.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from ...errors import EngineError
from ..base import Generation
from .grammar import GrammarMask
from .prefix_cache import PrefixCache
from .sampling import Sampler, TextStream
from .scheduler import Job, Seq, State
from .vocab import Vocab


class Batch:
    """A ``llama_batch`` whose arrays are numpy buffers, refilled every step."""

    def __init__(self, lib: Any, n: int):
        import numpy as np

        self.tok = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self._nseq = np.ones(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.out = np.zeros(n, dtype=np.int8)
        seq_ptr = ctypes.POINTER(lib.llama_seq_id)
        base = self.seq.ctypes.data
        self._seqp = (seq_ptr * n)(*[ctypes.cast(base + 4 * i, seq_ptr) for i in range(n)])
        b = self.c = lib.llama_batch()
        b.n_tokens = 0
        b.token = self.tok.ctypes.data_as(ctypes.POINTER(lib.llama_token))
        b.embd = None
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(lib.llama_pos))
        b.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seqp, ctypes.POINTER(seq_ptr))
        b.logits = self.out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, active: Sequence[Seq], allot: dict[Seq, int]) -> int:
        """Each decoding sequence's next token and the allotted prompt chunks, in
        ``active``'s order; sets each sequence's logits ``row``; the tokens in the batch."""
        import numpy as np

        tok, pos, seq, out = self.tok, self.pos, self.seq, self.out
        n = 0
        for s in active:
            if s.state is State.DECODING:
                tok[n], pos[n], seq[n], out[n] = s.last, s.pos, s.slot, 1
                s.row = n
                s.pos += 1
                n += 1
            elif s in allot:
                c = allot[s]
                end = n + c
                tok[n:end] = s.prompt[s.fed:s.fed + c]
                pos[n:end] = np.arange(s.fed, s.fed + c, dtype=np.int32)
                seq[n:end] = s.slot
                out[n:end] = 0
                s.feed(c)
                if s.state is State.DECODING:  # the prompt's last token: its logits
                    out[end - 1] = 1
                    s.row = end - 1
                else:
                    s.row = None
                n = end
            else:
                s.row = None
        self.c.n_tokens = n
        return n


class Decoder:
    """The decode steps of one context; used by the engine's decode thread only."""

    def __init__(self, lib: Any, ctx: Any, vocab: Vocab, n_batch: int, cache: PrefixCache,
                 rng: Any, stops: tuple[str, ...]):
        """lib, ctx: the ``llama_cpp`` module and the context. vocab: the model's.
        n_batch: most tokens a step. cache: the context's streams. rng: draws the seeds of
        requests without their own. stops: stop strings every free-text request gets."""
        self._lib, self._ctx, self._vocab, self.cache = lib, ctx, vocab, cache
        self._mem = lib.llama_get_memory(ctx)
        self._batch = Batch(lib, n_batch)
        self._row_type = ctypes.c_float * vocab.n_tokens
        self._mask = GrammarMask(lib, vocab.n_tokens)
        self._rng, self._stops = rng, stops
        import numpy as np

        self._np: Any = np

    def start(self, job: Job) -> Seq | None:
        """``job`` as a sequence in the idle stream holding its longest cached prefix
        (None: its call already failed; its grammar is freed)."""
        if job.call.failed:
            self.free_grammar(job)
            return None
        r = job.request
        seed = r.seed if r.seed is not None else int(self._rng.integers(1 << 63))
        rng = self._np.random.default_rng(seed) if r.temperature > 0 else None
        stream = TextStream(() if job.grammar is not None else tuple(r.stop) + self._stops)
        slot, hit = self.cache.take(job.prompt)
        return Seq(job, slot, hit, Sampler(r, rng), stream)

    def step(self, active: Sequence[Seq], allot: dict[Seq, int]) -> None:
        """Decode one batch and take each sequence's next token; a sequence that ends is
        finished (``State.DONE``)."""
        ctx, batch = self._ctx, self._batch
        n = batch.fill(active, allot)
        rc = self._lib.llama_decode(ctx, batch.c)
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} (batch of {n} tokens, "
                              f"{len(active)} sequences)")
        get_logits, void_p, row_type = self._lib.llama_get_logits_ith, ctypes.c_void_p, \
            self._row_type
        frombuffer, float32 = self._np.frombuffer, self._np.float32
        pieces, vocab, mask = self._vocab.pieces, self._vocab, self._mask
        for s in active:
            if s.row is None:
                continue
            addr = ctypes.cast(get_logits(ctx, s.row), void_p).value
            sampler = s.sampler
            logits = sampler.logits(frombuffer(row_type.from_address(addr),  # type: ignore[arg-type]
                                               dtype=float32))
            t = sampler.draw(logits)
            if s.grammar is not None:
                t = mask.constrain(s.grammar, logits, t, sampler.draw)
                if t < 0:  # a dead end: the JSON cannot go on
                    self._finish(s, "stop")
                    continue
            sampler.took(logits, t)
            piece = pieces[t] if t in pieces else vocab.piece(t)
            if piece is None:  # end of generation
                self._finish(s, "stop")
                continue
            if s.grammar is not None:
                mask.accept(s.grammar, t)
            s.n_gen += 1
            text = s.stream.feed(piece)
            call = s.job.call
            if text and not call.emit(s.job.index, text) or call.failed:
                self._finish(s, "cancelled")  # the caller went away: free the slot now
            elif s.stream.stopped:
                self._finish(s, "stop")
            elif s.n_gen >= s.job.request.max_tokens:
                self._finish(s, "length")
            else:
                s.last = t

    def _finish(self, s: Seq, reason: str) -> None:
        """``s`` ends: its result goes to its call, its stream keeps its prompt's KV."""
        tail = s.stream.finish()
        job = s.job
        if tail and reason != "cancelled":
            job.call.emit(job.index, tail)
        extra: dict[str, Any] = {}
        mean = s.sampler.mean_logprob()
        if mean is not None:
            extra["mean_logprob"] = mean
        if s.cached:
            extra["cached_tokens"] = s.cached
        self.free_grammar(s)
        self.cache.release(s.slot, s.prompt, s.fed)
        s.state = State.DONE
        job.call.complete(job.index, Generation(s.stream.text, s.n_prompt, s.n_gen, reason,
                                                extra))  # last: its caller may go on now

    def free_grammar(self, holder: Job | Seq) -> None:
        """Free the grammar sampler a job or sequence holds, if any."""
        if holder.grammar is not None:
            self._lib.llama_sampler_free(holder.grammar)
            holder.grammar = None

    def reset(self) -> None:
        """After a failure: the context's KV is cleared, no stream holds or runs anything."""
        self._lib.llama_memory_clear(self._mem, True)
        self.cache.clear()
