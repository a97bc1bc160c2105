"""Per-sequence token choice (``Sampler``) and streamed text (``TextStream``).

Pure Python plus numpy (imported lazily); no model needed, so sampling, the stop-string
and UTF-8 handling are tested on their own.
"""

from __future__ import annotations

import codecs
import math
from typing import Any

from ..base import GenerationRequest


def penalise(logits: Any, counts: dict[int, int], presence: float, frequency: float) -> Any:
    """A copy of ``logits`` (float32 over the vocabulary) with OpenAI's penalties: each
    token generated ``counts[token]`` times so far loses ``c * frequency + presence``."""
    import numpy as np

    out = logits.copy()
    if counts:
        ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        out[ids] -= n * np.float32(frequency) + np.float32(presence)
    return out


def sample(logits: Any, temperature: float, rng: Any, top_p: float = 1.0) -> int:
    """The next token id from one row of logits (not modified): greedy argmax at
    ``temperature`` 0 (``rng`` unused), else a draw from softmax(logits / temperature),
    below ``top_p`` 1 among the most likely tokens holding ``top_p`` of the mass."""
    if temperature <= 0.0:
        return int(logits.argmax())
    import numpy as np

    z = logits * (1.0 / temperature)
    z -= z.max()
    np.exp(z, out=z)
    if top_p < 1.0:
        order = np.argsort(z)[::-1]
        mass = np.cumsum(z[order], dtype=np.float64)
        keep = int(np.searchsorted(mass, top_p * mass[-1])) + 1
        z[order[keep:]] = 0.0
    cdf = np.cumsum(z, dtype=np.float64)
    idx = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(idx, len(cdf) - 1)


class Sampler:
    """One sequence's token choice: OpenAI's penalties, the temperature and top-p draw,
    and the summed log-probabilities of the drawn tokens when the request asks for them
    (``GenerationRequest.logprobs``)."""

    __slots__ = ("temperature", "top_p", "rng", "presence", "frequency", "counts", "n_lp",
                 "lp_sum")

    def __init__(self, req: GenerationRequest, rng: Any):
        """req: the request (its sampling fields). rng: a ``numpy.random.Generator``
        (None when greedy)."""
        self.temperature, self.top_p, self.rng = req.temperature, req.top_p, rng
        self.presence, self.frequency = req.presence_penalty, req.frequency_penalty
        # tokens generated so far (penalties only)
        self.counts: dict[int, int] | None = {} if self.presence or self.frequency else None
        self.n_lp = 0 if req.logprobs else -1  # tokens in lp_sum; -1: not asked for
        self.lp_sum = 0.0

    def logits(self, row: Any) -> Any:
        """The logits to draw from: ``row`` with the penalties applied (a copy), if any."""
        if self.counts is None:
            return row
        return penalise(row, self.counts, self.presence, self.frequency)

    def draw(self, logits: Any) -> int:
        return sample(logits, self.temperature, self.rng, self.top_p)

    def took(self, logits: Any, t: int) -> None:
        """Token ``t`` was chosen from ``logits``: count it (penalties, log-probability)."""
        if self.counts is not None:
            self.counts[t] = self.counts.get(t, 0) + 1
        if self.n_lp >= 0:  # log-softmax of the sampled token, stable form
            import numpy as np

            m = logits.max()
            self.lp_sum += float(logits[t] - m) - math.log(float(np.exp(logits - m).sum()))
            self.n_lp += 1

    def mean_logprob(self) -> float | None:
        """The drawn tokens' mean log-probability (None: not asked for, or no token)."""
        return self.lp_sum / self.n_lp if self.n_lp > 0 else None


class TextStream:
    """The text of one generating sequence, fed token bytes, with stop strings cut off.

    Bytes are decoded incrementally, so a UTF-8 character split across tokens comes out
    whole. ``feed`` returns only text that can no longer become part of a stop string:
    a suffix that is a prefix of some stop string is held back until it is decided.
    """

    __slots__ = ("_decoder", "_stops", "_longest", "text", "emitted", "stopped")

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        """stops: strings that end the text; the first one found, and everything after
        it, is dropped."""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # the text so far (already cut at a stop string once stopped)
        self.emitted = 0  # how much of ``text`` feed/finish have returned
        self.stopped = False  # a stop string was found

    def feed(self, data: bytes) -> str:
        """Add one token's bytes (may end inside a UTF-8 character); return the newly
        releasable text (often '')."""
        if self.stopped:
            return ""
        new = self._decoder.decode(data)
        return self._add(new) if new else ""

    def finish(self) -> str:
        """End the stream: flush undecodable bytes and release everything held back."""
        out = ""
        if not self.stopped:
            tail = self._decoder.decode(b"", final=True)
            if tail:
                out = self._add(tail)
        out += self.text[self.emitted:]
        self.emitted = len(self.text)
        return out

    def _add(self, new: str) -> str:
        text = self.text
        if not self._stops:
            self.text = text + new
            out = self.text[self.emitted:]
            self.emitted = len(self.text)
            return out
        start = max(0, len(text) - self._longest + 1)
        text = self.text = text + new
        cut = -1
        for s in self._stops:
            j = text.find(s, start)
            if j != -1 and (cut == -1 or j < cut):
                cut = j
        if cut != -1:
            self.text = text = text[:cut]
            self.stopped = True
            end = len(text)
        else:
            end = len(text) - self._held(text)
        if end <= self.emitted:
            return ""
        out = text[self.emitted:end]
        self.emitted = end
        return out

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that starts some stop string."""
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            suffix = text[-k:]
            for s in self._stops:
                if s.startswith(suffix):
                    return k
        return 0
