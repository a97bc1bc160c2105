"""Verifiers of an answer's text: ``json_schema``, ``regex`` and ``grounded``.

>>> import asyncio
>>> asyncio.run(Regex(r"^\\d+$")("42", {}))
Verdict(ok=True, reason="matched '42'", verifier='regex')
>>> asyncio.run(Grounded(min_overlap=0.6)("Paris is in France.",
...                                      {"passages": [{"text": "Paris, capital of France"}]}))
Verdict(ok=True, reason='grounded: 2/2 terms in the passages (1.00 >= 0.6)', verifier='grounded')
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from .base import Verdict, Verifier, fenced_block, field_of


# -- json_schema --------------------------------------------------------------------------
class JsonSchema(Verifier):
    """Passes when the answer (or its first fenced block) is JSON valid against a schema.

    The schema is checked when the verifier is made; ``$ref``s resolve within the schema
    only (nothing is fetched)."""

    name = "json_schema"

    def __init__(self, schema: Mapping[str, Any]) -> None:
        try:
            import jsonschema
            from referencing import Registry  # (a jsonschema dependency)
        except ImportError:
            raise ValueError("needs the jsonschema package; install it with: "
                             "pip install jsonschema") from None
        if not isinstance(schema, Mapping):
            raise ValueError(f"takes a JSON Schema (a mapping like {{type: object, "
                             f"properties: {{...}}}}), got {schema!r:.60}")
        schema = dict(schema)
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            at = "/".join(str(p) for p in e.absolute_path)
            raise ValueError(f"not a valid JSON Schema{' at ' + at if at else ''}: "
                             f"{e.message}") from None
        self.schema = schema
        self._validator = cls(schema, registry=Registry())
        self._best_match = jsonschema.exceptions.best_match

    async def __call__(self, answer: str, record: Mapping[str, Any]) -> Verdict:
        block = fenced_block(answer)
        text = block if block is not None else answer
        try:
            value = json.loads(text)
        except ValueError as e:
            return self.verdict(False, f"not JSON: {e}")
        try:
            error = self._best_match(self._validator.iter_errors(value))
        except Exception as e:  # noqa: BLE001 - e.g. a $ref to a schema not at hand
            return self.verdict(False, f"could not be checked: {type(e).__name__}: {e}")
        if error is None:
            return self.verdict(True, "valid JSON matching the schema")
        at = "/".join(str(p) for p in error.absolute_path)
        return self.verdict(False, f"does not match the schema{' at ' + at if at else ''}: "
                            f"{error.message}")


# -- regex --------------------------------------------------------------------------------
FLAGS = {"a": re.ASCII, "i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL,
         "x": re.VERBOSE}


class Regex(Verifier):
    """Passes when ``re.search(pattern, answer)`` finds a match; ``flags``: letters of
    ``aimsx`` (``re.ASCII``, ``IGNORECASE``, ``MULTILINE``, ``DOTALL``, ``VERBOSE``)."""

    name = "regex"

    def __init__(self, pattern: str, flags: str = "") -> None:
        if not isinstance(pattern, str):
            raise ValueError(f"takes a pattern (a string) or {{pattern, flags}}, got "
                             f"{pattern!r:.60}")
        if not isinstance(flags, str) or set(flags) - set(FLAGS):
            raise ValueError(f"'flags' must be letters of {''.join(FLAGS)} (like 'im'), got "
                             f"{flags!r:.60}")
        bits = 0
        for c in flags:
            bits |= FLAGS[c]
        try:
            self.pattern = re.compile(pattern, bits)
        except re.error as e:
            raise ValueError(f"bad pattern {pattern!r:.60}: {e}") from None

    async def __call__(self, answer: str, record: Mapping[str, Any]) -> Verdict:
        m = self.pattern.search(answer)
        if m is None:
            return self.verdict(False, f"no match for {self.pattern.pattern!r:.120}")
        return self.verdict(True, f"matched {m.group(0)!r:.120}")


def regex_from_spec(spec: Any) -> Regex:
    if isinstance(spec, Mapping):
        bad = sorted(set(spec) - {"pattern", "flags"})
        if bad or "pattern" not in spec:
            raise ValueError(f"takes a pattern or {{pattern, flags}}, got {dict(spec)!r:.60}")
        return Regex(spec["pattern"], spec.get("flags") or "")
    return Regex(spec)


# -- grounded -----------------------------------------------------------------------------
_STOPWORDS = """
a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from
further had has have having he her here hers herself him himself his how i if in into is it
its itself just like may me might more most must my myself no nor not now of off on once
only or other our ours ourselves out over own same she should so some such than that the
their theirs them themselves then there these they this those through to too under until up
upon very was we were what when where which while who whom why will with would yes you your
yours yourself yourselves answer according based passage passages context
"""
STOPWORDS = frozenset(_STOPWORDS.split())

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[^\W\d_][\w'-]*")
# capitalised words in a row ("Marie Curie", "New York City"): one entity span
_SPAN = re.compile(r"\b[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*")


def _norm(word: str) -> str:
    """A word as it is compared: lower case, no possessive, no plural ``s``."""
    w = word.lower().removesuffix("'s").strip("'-")
    return w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w


def _number(text: str) -> str:
    return text.replace(",", "")


def terms(answer: str) -> list[tuple[str, tuple[str, ...]]]:
    """The answer's terms as ``(shown, normalised words)``: numbers, capitalised spans
    (one term each; a sentence's first word only when it is no stop word), and the other
    content words.

    >>> [t for t, _ in terms("The Eiffel Tower is 330 metres tall.")]
    ['Eiffel Tower', '330', 'metres', 'tall']
    """
    out: list[tuple[str, tuple[str, ...]]] = []
    seen: set[tuple[str, ...]] = set()
    taken: set[int] = set()  # character positions inside a span or a number

    def add(shown: str, words: tuple[str, ...], start: int, end: int) -> None:
        taken.update(range(start, end))
        if words and words not in seen:
            seen.add(words)
            out.append((shown, words))

    for m in _SPAN.finditer(answer):
        words = [w for w in m.group(0).split()]
        while words and words[0].lower() in STOPWORDS:  # "The Eiffel Tower": drop "The"
            words.pop(0)
        if words:
            add(" ".join(words), tuple(_norm(w) for w in words), m.start(), m.end())
    for m in _NUMBER.finditer(answer):
        add(m.group(0), (_number(m.group(0)),), m.start(), m.end())
    for m in _WORD.finditer(answer):
        w = m.group(0)
        if m.start() not in taken and w.lower() not in STOPWORDS and len(w) > 2:
            add(w, (_norm(w),), m.start(), m.end())
    return out


def passage_texts(value: Any) -> list[str]:
    """The texts of a ``passages`` field: a list of ``retrieve``'s dicts (``title`` and
    ``text``), a list of strings, or one string."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list | tuple):
        raise ValueError(f"grounded: the passages must be a list of {{text: ...}} dicts or of "
                         f"strings, got {type(value).__name__}")
    out = []
    for p in value:
        if isinstance(p, Mapping):
            out.append(" ".join(str(p[k]) for k in ("title", "text") if p.get(k)))
        else:
            out.append(str(p))
    return out


def _vocabulary(texts: list[str]) -> tuple[set[str], str]:
    """(normalised words and numbers, the normalised text as one string of words)."""
    words: list[str] = []
    for t in texts:
        for m in re.finditer(r"\d+(?:[.,]\d+)*|[^\W\d_][\w'-]*", t):
            g = m.group(0)
            words.append(_number(g) if g[0].isdigit() else _norm(g))
    return set(words), " " + " ".join(words) + " "


class Grounded(Verifier):
    """Passes when at least ``min_overlap`` of the answer's terms (numbers, capitalised
    entity spans, content words) appear in the record's retrieved passages; an entity
    span counts only as a whole phrase. An empty answer fails; an answer with no content
    words ("Yes.") passes (it claims nothing). ``max_terms``: an answer of more terms
    fails too, whatever it overlaps (a short answer was asked for; a long one buries it).

    >>> import asyncio
    >>> asyncio.run(Grounded(max_terms=3)("Elizabeth Bennet, the heroine of Pride and "
    ...     "Prejudice by Jane Austen.", {"passages": ["Pride and Prejudice by Jane Austen "
    ...     "follows Elizabeth Bennet, its heroine."]})).reason
    'not a short answer: 5 terms > 3 (Elizabeth Bennet, Pride, Prejudice, ...)'
    """

    name = "grounded"

    def __init__(self, passages: str = "passages", min_overlap: float = 0.6,
                 max_terms: int | None = None) -> None:
        if not isinstance(passages, str) or not passages:
            raise ValueError(f"'passages' must be a field name, got {passages!r:.60}")
        if isinstance(min_overlap, bool) or not isinstance(min_overlap, int | float) \
                or not 0 <= min_overlap <= 1:
            raise ValueError(f"'min_overlap' must be a number from 0 to 1, got "
                             f"{min_overlap!r:.60}")
        if max_terms is not None and (isinstance(max_terms, bool) or not isinstance(
                max_terms, int) or max_terms < 1):
            raise ValueError(f"'max_terms' must be an integer >= 1, got {max_terms!r:.60}")
        self.passages, self.min_overlap = passages, float(min_overlap)
        self.max_terms = max_terms
        self.fields = (passages,)

    async def __call__(self, answer: str, record: Mapping[str, Any]) -> Verdict:
        if not answer.strip():
            return self.verdict(False, "empty answer")
        found = terms(answer)
        if not found:
            return self.verdict(True, "no content words to check")
        if self.max_terms is not None and len(found) > self.max_terms:
            shown = ", ".join(t for t, _ in found[:3])
            return self.verdict(False, f"not a short answer: {len(found)} terms > "
                                f"{self.max_terms} ({shown}, ...)")
        vocab, text = _vocabulary(passage_texts(field_of(record, self.passages, self.name)))
        missing = [shown for shown, words in found
                   if not (words[0] in vocab if len(words) == 1
                           else f" {' '.join(words)} " in text)]
        n, hit = len(found), len(found) - len(missing)
        share = hit / n
        if share >= self.min_overlap:
            return self.verdict(True, f"grounded: {hit}/{n} terms in the passages "
                                f"({share:.2f} >= {self.min_overlap:g})")
        return self.verdict(False, f"not grounded: {hit}/{n} terms in the passages "
                            f"({share:.2f} < {self.min_overlap:g}); missing: "
                            + ", ".join(missing[:8]))


GROUNDED_OPTIONS = ("passages", "min_overlap", "max_terms")


def grounded_from_spec(spec: Any) -> Grounded:
    spec = {} if spec is None else spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"takes a mapping of {', '.join(GROUNDED_OPTIONS)}, got {spec!r:.60}")
    bad = sorted(set(spec) - set(GROUNDED_OPTIONS))
    if bad:
        raise ValueError(f"unknown option '{bad[0]}' (options: {', '.join(GROUNDED_OPTIONS)})")
    return Grounded(**spec)
