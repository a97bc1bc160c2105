"""Structure-aware chunking of long documents into passages of a token budget.

A document's text is split at Markdown headings (``# Title``, ``## Part``) into sections,
each section into paragraphs (blank lines) and each paragraph into sentences; sentences
are packed into chunks of at most ``max_tokens`` tokens of the embedder's own tokenizer
(special tokens and the chunk's context line included), preferring to end a chunk at a
paragraph end, never crossing a heading, and starting each chunk with up to ``overlap``
tokens of the previous chunk's last sentences. A sentence longer than the budget is cut
at token boundaries. Every chunk is a span ``text[start:end]`` of the document, so its
offsets map back to the text exactly. ``tailrace ingest`` and ``semantic_state`` (with
``chunk_tokens:``) share this chunker. ``tokenizers`` is imported on first use.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..engines.models import model_info, tokenizer_path
from ..errors import StoreError

#: default budget: fits MiniLM's 256-token window with room to spare
DEFAULT_CHUNK_TOKENS = 200
DEFAULT_OVERLAP = 32

_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#\r]*$", re.MULTILINE)
#: a fenced code block (``` or ~~~ up to the matching fence, or the end): its ``#``
#: lines are shell comments, not headings
_FENCE = re.compile(r"^[ \t]*(```|~~~).*?(?:^[ \t]*\1[ \t]*\r?$|\Z)", re.MULTILINE | re.DOTALL)
_PARAGRAPH = re.compile(r"\n[ \t\r]*\n\s*")
_SENTENCE = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=\S)")


@dataclass(frozen=True)
class Chunk:
    """One passage: ``text == document[start:end]``; ``heading``: the heading path
    (``"Guide > Install"``, ``""`` before the first heading); ``tokens``: what its
    ``context`` takes, special tokens included."""

    text: str
    start: int
    end: int
    heading: str
    tokens: int

    def context(self, title: str) -> str:
        """What to embed: the title and heading path, then the passage."""
        head = _head(title, self.heading)
        return f"{head}. {self.text}" if head else self.text


def _head(title: str, heading: str) -> str:
    if heading and heading != title:
        return f"{title} > {heading}" if title else heading
    return title


def load_tokenizer(model: str) -> Any:
    """The ``tokenizers`` tokenizer of a catalog embedding model (no padding or
    truncation), as the ONNX embedder loads it."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise StoreError(f"chunking needs the tokenizers package ({e}); install it with: "
                         "pip install tokenizers") from None
    tok = Tokenizer.from_file(str(tokenizer_path(model_info(model, "onnx"))))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _spans(text: str, pattern: re.Pattern[str], start: int, end: int) -> list[tuple[int, int]]:
    """The non-blank pieces of ``text[start:end]`` between matches of ``pattern``."""
    out = []
    pos = start
    for m in pattern.finditer(text, start, end):
        out.append((pos, m.start()))
        pos = m.end()
    out.append((pos, end))
    spans = []
    for a, b in out:
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if a < b:
            spans.append((a, b))
    return spans


class Chunker:
    """Splits documents into ``Chunk``\\ s of at most ``max_tokens`` embedder tokens.

        >>> c = Chunker("minilm-l6-int8", max_tokens=16, overlap=0)
        >>> [ch.text for ch in c.chunk("# Cats\\nCats purr. Cats sleep a lot.\\n\\n"
        ...                            "# Dogs\\nDogs bark.")]
        ['Cats purr. Cats sleep a lot.', 'Dogs bark.']

    model:      the catalog embedding model whose tokenizer measures the budget.
    max_tokens: tokens per chunk, special tokens and the context line included (must fit
                the embedder's ``max_length``, 256 for MiniLM).
    overlap:    tokens of the previous chunk's last sentences repeated at the start of the
                next one (0: none; must be below half of ``max_tokens``).
    """

    def __init__(self, model: str = "minilm-l6-int8", *, max_tokens: int = DEFAULT_CHUNK_TOKENS,
                 overlap: int = DEFAULT_OVERLAP, tokenizer: Any = None) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 16:
            raise StoreError(f"chunk tokens must be an integer >= 16, got {max_tokens!r}")
        if (isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0
                or overlap * 2 >= max_tokens):
            raise StoreError(f"overlap must be an integer from 0 to below half the chunk "
                             f"tokens ({max_tokens}), got {overlap!r}")
        self.model = model
        self.max_tokens = max_tokens
        self.overlap = overlap
        self._tok = tokenizer

    def __getstate__(self) -> dict:  # ship the settings, not the tokenizer (Ray)
        return {**self.__dict__, "_tok": None}

    def _tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = load_tokenizer(self.model)
        return self._tok

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text, without special tokens."""
        if not texts:
            return []
        encs = self._tokenizer().encode_batch(list(texts), add_special_tokens=False)
        return [len(e.ids) for e in encs]

    def chunk(self, text: str, title: str = "") -> list[Chunk]:
        """The chunks of ``text`` in order; ``title`` (part of each chunk's context line)
        counts against the budget."""
        if not isinstance(text, str):
            raise StoreError(f"chunking needs text, got {type(text).__name__}")
        out: list[Chunk] = []
        for start, end, heading in self._sections(text):
            context = _head(title, heading)
            extra = 2 + (self.count([context + "."])[0] if context else 0)
            budget = self.max_tokens - extra
            if budget < 8:
                raise StoreError(f"the title and heading take the whole chunk budget of "
                                 f"{self.max_tokens} tokens: {context[:80]!r}; raise it")
            out.extend(self._pack(text, start, end, heading, budget, extra))
        return out

    def _sections(self, text: str) -> list[tuple[int, int, str]]:
        """(start, end, heading path) of the text between headings."""
        sections = []
        path: list[tuple[int, str]] = []
        pos = 0
        fences = [(f.start(), f.end()) for f in _FENCE.finditer(text)] if "`" in text \
            or "~" in text else []
        for m in _HEADING.finditer(text):
            if any(a <= m.start() < b for a, b in fences):
                continue
            sections.append((pos, m.start(), " > ".join(t for _, t in path)))
            level = len(m.group(1))
            path = [(lv, t) for lv, t in path if lv < level] + [(level, m.group(2).strip())]
            pos = m.end()
        sections.append((pos, len(text), " > ".join(t for _, t in path)))
        return [s for s in sections if text[s[0]:s[1]].strip()]

    def _pieces(self, text: str, start: int, end: int,
                budget: int) -> list[tuple[int, int, int, bool]]:
        """Sentence spans ``(start, end, tokens, ends_paragraph)``; a sentence over the
        budget is cut at token boundaries."""
        spans: list[tuple[int, int, bool]] = []
        for pa, pb in _spans(text, _PARAGRAPH, start, end):
            sents = _spans(text, _SENTENCE, pa, pb)
            spans.extend((a, b, i == len(sents) - 1) for i, (a, b) in enumerate(sents))
        counts = self.count([text[a:b] for a, b, _ in spans])
        pieces = []
        for (a, b, last), n in zip(spans, counts, strict=True):
            if n <= budget:
                pieces.append((a, b, n, last))
                continue
            enc = self._tokenizer().encode(text[a:b], add_special_tokens=False)
            offs = enc.offsets
            for i in range(0, len(offs), budget):
                window = offs[i:i + budget]
                pa_, pb_ = a + window[0][0], a + window[-1][1]
                pieces.append((pa_, pb_, len(window), last and i + budget >= len(offs)))
        return pieces

    def _pack(self, text: str, start: int, end: int, heading: str, budget: int,
              extra: int) -> list[Chunk]:
        pieces = self._pieces(text, start, end, budget)
        chunks: list[Chunk] = []
        cur: list[tuple[int, int, int, bool]] = []
        fresh = 0  # pieces of cur not carried over from the previous chunk
        used = 0

        def flush() -> None:
            a, b = cur[0][0], cur[-1][1]
            chunks.append(Chunk(text[a:b], a, b, heading, used + extra))

        for i, p in enumerate(pieces):
            if cur and used + p[2] > budget:
                flush()
                carry: list[tuple[int, int, int, bool]] = []
                n = 0
                for q in reversed(cur):
                    if n + q[2] > self.overlap or n + q[2] + p[2] > budget:
                        break
                    carry.insert(0, q)
                    n += q[2]
                cur, used, fresh = carry, n, 0
            cur.append(p)
            used += p[2]
            fresh += 1
            # end a well-filled chunk at a paragraph end rather than split the next one
            if p[3] and i + 1 < len(pieces) and used * 2 >= budget:
                para = 0
                for q in pieces[i + 1:]:
                    para += q[2]
                    if q[3]:
                        break
                if used + para > budget and para <= budget:
                    flush()
                    cur, used, fresh = [], 0, 0
        if cur and fresh:
            flush()
        return chunks

