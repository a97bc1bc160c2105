"""The prefix cache: which KV stream a new sequence starts in, and what a finished one
leaves behind for the next (docs/engines.md, "The prefix cache").

A finished sequence's stream keeps its prompt's KV; a new request starts in the idle
stream holding its longest prefix (else the least recently used one, an empty one first)
and computes only the rest. Greedy answers stay the same with and without the cache
because only whole, aligned ``chunk``-token pieces of a prompt are reused (llama.cpp's
results depend on how a prompt is cut into batches) and generated tokens' KV is not
kept (computed one token a step, it differs in the last bits from a prefill's). The
last prompt token is always run again: its logits start the generation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``remove(stream, start, end)``: drop the KV of positions [start, end) (-1: open) from a
#: stream (``llama_memory_seq_rm``); False if the model's memory cannot cut there
Remove = Callable[[int, int, int], bool]


class PrefixCache:
    """The KV streams of one context: held prefixes, busy streams, LRU order, counters.
    Used by the decode loop's thread only."""

    def __init__(self, n_streams: int, chunk: int, remove: Remove, *, enabled: bool = True):
        """n_streams: KV streams in the context. chunk: the prefill chunk (tokens).
        remove: how to drop KV from a stream. enabled: False, nothing is kept."""
        self.chunk, self.enabled, self._remove = chunk, enabled, remove
        self.streams: list[Any] = [None] * n_streams  # the tokens whose KV each one holds
        self._used = [0] * n_streams  # when each stream was last released (LRU)
        self._tick = 0
        self.busy: set[int] = set()  # streams of started (running or paused) sequences
        self.lookups = 0  # sequences started
        self.prompt_tokens = 0  # their prompt tokens
        self.hit_tokens = 0  # of those, whose KV was reused instead of computed

    def take(self, prompt: Any) -> tuple[int, int]:
        """An idle stream for ``prompt`` (numpy int32 tokens) and how many of its first
        tokens already have their KV there. The stream keeps that prefix; the rest of
        what it held is removed. There must be an idle stream."""
        best, best_n, chunk = -1, 0, self.chunk
        if self.enabled:
            import numpy as np

            for slot, held in enumerate(self.streams):
                if slot in self.busy or held is None or not len(held):
                    continue
                n = min(len(held), len(prompt) - 1)  # the last token is always run
                if n < chunk or n // chunk * chunk <= best_n:
                    continue
                diff = np.flatnonzero(held[:n] != prompt[:n])
                n = (int(diff[0]) if len(diff) else n) // chunk * chunk
                if n > best_n:
                    best, best_n = slot, n
        if best < 0:
            best = min((s for s in range(len(self.streams)) if s not in self.busy),
                       key=lambda s: (self.streams[s] is not None, self._used[s]))
        if best_n == 0 or not self._remove(best, best_n, -1):
            self._remove(best, -1, -1)
            best_n = 0
        self.streams[best] = None
        self.busy.add(best)
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        self.hit_tokens += best_n
        return best, best_n

    def release(self, slot: int, prompt: Any, fed: int) -> None:
        """The sequence in ``slot`` ended having sent ``fed`` tokens of ``prompt``: keep
        the KV of its whole chunks for a later request (if enabled), drop the rest."""
        if self.enabled:
            whole = fed // self.chunk * self.chunk
            self._remove(slot, whole, -1)
            self.streams[slot] = prompt[:whole]
            self._tick += 1
            self._used[slot] = self._tick
        else:
            self._remove(slot, -1, -1)
        self.busy.discard(slot)

    def cut(self, slot: int, start: int) -> bool:
        """Drop the KV of positions ``start`` on from a busy stream (tokens taken back, as
        a rejected draft); False if the model's memory cannot cut there."""
        return bool(self._remove(slot, start, -1))

    def clear(self) -> None:
        """The context's KV was cleared (after a failure): nothing is held or busy."""
        self.streams = [None] * len(self.streams)
        self.busy.clear()

    def statistics(self) -> dict[str, float]:
        total = self.prompt_tokens
        return {"lookups": self.lookups, "prompt_tokens": total,
                "hit_tokens": self.hit_tokens,
                "hit_ratio": self.hit_tokens / total if total else 0.0}
