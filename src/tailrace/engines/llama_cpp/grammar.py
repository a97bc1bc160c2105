"""Grammars for structured output on llama.cpp: a ``response_format`` as a GBNF grammar,
compiled once per schema, cloned for each sequence that generates under it, and asked
about each token that sequence samples.

A grammar sampler carries its parse state, so each sequence gets its own clone, freed
when it ends. ``GrammarMask`` checks a sampled token against the grammar alone first
(microseconds); only a rejected token costs a pass over the whole vocabulary and a new
draw among the allowed tokens (the same distribution as sampling the masked logits).
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ...errors import StructuredOutputError
from ..base import GenerationRequest
from ..structured import check_response_format, schema_of
from ..tool_calls import CALL_CLOSE, CALL_OPEN, call_schema, tool_prompt

#: compiled grammars (one per distinct JSON schema) an engine keeps for reuse
GRAMMAR_CACHE = 32
_NEG_INF = -math.inf


def grammar_text(fmt: dict[str, Any]) -> str:
    """The GBNF grammar of a checked ``response_format`` (``json_object`` or
    ``json_schema``); StructuredOutputError naming the schema when llama-cpp-python cannot
    turn it into one."""
    schema = schema_of(fmt)
    if schema is None:
        from llama_cpp.llama_grammar import JSON_GBNF

        return str(JSON_GBNF)
    return _schema_grammar(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=GRAMMAR_CACHE)
def _schema_grammar(schema: str) -> str:
    """The GBNF grammar of a JSON Schema's text (cached: the wire checks each request's)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        text = json_schema_to_gbnf(schema)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise StructuredOutputError(f"response_format.json_schema.schema: llama.cpp cannot "
                                    f"build a grammar from it ({type(e).__name__}: {e})"
                                    ) from None
    # JSON strings may not hold raw control characters (the converter's char rule allows them)
    return text.replace('char ::= [^"\\\\] |', 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |')


def tool_request(req: GenerationRequest) -> GenerationRequest:
    """A request offering tools as llama.cpp runs it: the tools and earlier calls as text
    in its messages (``tool_calls.tool_prompt``) and, when it may call, its answer held to
    ``tool_grammar``."""
    spec = req.tools
    if req.messages is None:
        raise StructuredOutputError("tools need chat messages, not a raw prompt")
    msgs = tool_prompt(req.messages, spec)
    if not spec.offered:  # tool_choice none: text only
        return replace(req, messages=msgs, tools=None)
    if req.response_format is not None:
        raise StructuredOutputError("a request offering tools cannot also set "
                                    "response_format on llama.cpp; send one of them")
    return replace(req, messages=msgs, tools=None, response_format={
        "type": "grammar", "grammar": tool_grammar(spec.must_call, spec.parallel,
                                                   json.dumps(call_schema(spec)))})


@functools.lru_cache(maxsize=GRAMMAR_CACHE)
def tool_grammar(must_call: bool, parallel: bool, schema: str) -> str:
    """The GBNF of an answer that is one call (``parallel``: one or more) to the functions
    of ``schema`` (``call_schema``'s text) in the call form, or (not ``must_call``) text
    that does not start with ``<``, ``{`` or a space."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        call = json_schema_to_gbnf(schema, prop_order=["name", "arguments"])
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise StructuredOutputError(f"tools: llama.cpp cannot build a grammar from the "
                                    f"functions' parameters ({type(e).__name__}: {e})") from None
    call = call.replace('char ::= [^"\\] |', 'char ::= [^"\\\x7F\x00-\x1F] |')
    call = re.sub(r"^root ::=", "tr-call ::=", call, count=1, flags=re.M)
    one = f'"{CALL_OPEN}" "\\n"? tr-call "\\n"? "{CALL_CLOSE}"'  # Qwen's form has newlines
    calls = f"tr-one ::= {one}\ntr-calls ::= tr-one" + (" tr-one*" if parallel else "")
    # free text may not open like a call: '<', '{' or space (a bare JSON call is a call's
    # start the model must write in the form)
    free = " | tr-free\ntr-free ::= [^<{ \\t\\n\\x00] [^\\x00]*"
    root = "root ::= tr-calls" + ("" if must_call else free)
    return f"{root}\n{calls}\n{call}"


class Grammars:
    """The compiled grammar samplers of one model's vocabulary, by schema (the
    ``GRAMMAR_CACHE`` most recently used); not thread-safe (the engine's lock guards it)."""

    def __init__(self, lib: Any, vocab: Any):
        """lib: the ``llama_cpp`` module. vocab: the model's ``llama_vocab`` pointer."""
        self._lib = lib
        self._vocab = vocab
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # schema text -> sampler

    def __len__(self) -> int:
        return len(self._compiled)

    def samplers(self, requests: Sequence[GenerationRequest]) -> list[Any]:
        """A fresh grammar sampler for each constrained request (None for free ones), the
        caller's to free with ``llama_sampler_free``; StructuredOutputError naming the
        field for a constraint that is malformed or cannot become a grammar."""
        lib = self._lib
        out: list[Any] = []
        try:
            for r in requests:
                fmt = r.response_format
                if fmt is None or fmt.get("type") == "text":
                    out.append(None)
                    continue
                js = fmt.get("json_schema")
                key = "gbnf:" + fmt["grammar"] if fmt.get("type") == "grammar" else \
                    "" if fmt.get("type") == "json_object" else json.dumps(
                    js.get("schema") if isinstance(js, dict) else None, sort_keys=True,
                    default=repr)
                proto = self._compiled.get(key)
                if proto is None:
                    proto = self._compile(key, fmt)
                else:
                    self._compiled.move_to_end(key)
                out.append(lib.llama_sampler_clone(proto))
        except BaseException:
            for g in out:
                if g is not None:
                    lib.llama_sampler_free(g)
            raise
        return out

    def _compile(self, key: str, fmt: dict[str, Any]) -> Any:
        """Check a constraint not seen before (cached ones passed), compile and cache it."""
        lib = self._lib
        if fmt.get("type") == "grammar":  # a request's tools (``tool_request``)
            text = fmt["grammar"]
        else:
            try:
                checked = check_response_format(fmt)
            except ValueError as e:
                raise StructuredOutputError(str(e)) from None
            assert checked is not None  # ``samplers`` never asks for {"type": "text"}
            text = grammar_text(checked)
        proto = lib.llama_sampler_init_grammar(self._vocab, text.encode(), b"root")
        if not proto:
            raise StructuredOutputError("response_format.json_schema.schema: llama.cpp could "
                                        "not compile the grammar built from it")
        self._compiled[key] = proto
        while len(self._compiled) > GRAMMAR_CACHE:
            lib.llama_sampler_free(self._compiled.popitem(last=False)[1])
        return proto

    def close(self) -> None:
        """Free every compiled grammar (clones handed out are freed by their holders)."""
        for g in self._compiled.values():
            self._lib.llama_sampler_free(g)
        self._compiled.clear()


class GrammarMask:
    """The ``llama_token_data_array`` buffers a grammar sampler masks in place (``logit``
    set to -inf for tokens it rejects), for one vocabulary; used by the decode loop only."""

    def __init__(self, lib: Any, n_vocab: int):
        """lib: the ``llama_cpp`` module. n_vocab: tokens in the vocabulary."""
        import numpy as np

        dtype = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
        if dtype.itemsize != ctypes.sizeof(lib.llama_token_data):
            raise RuntimeError("llama_token_data changed layout; this llama-cpp-python is "
                               "not the version tailrace supports (0.3.36)")
        self._apply, self.accept = lib.llama_sampler_apply, lib.llama_sampler_accept
        self._n = n_vocab
        self._one = np.zeros(1, dtype=dtype)
        self._full = full = np.zeros(n_vocab, dtype=dtype)
        full["id"] = np.arange(n_vocab, dtype=np.int32)
        ptr = lib.llama_token_data_p
        self._one_arr = lib.llama_token_data_array(self._one.ctypes.data_as(ptr), 1, -1, False)
        self._full_arr = lib.llama_token_data_array(full.ctypes.data_as(ptr), n_vocab, -1,
                                                    False)
        self._one_ref, self._full_ref = ctypes.byref(self._one_arr), ctypes.byref(self._full_arr)
        self._full_data = self._full_arr.data

    def constrain(self, grammar: Any, logits: Any, t: int,
                  redraw: Callable[[Any], int]) -> int:
        """``t`` if ``grammar`` allows it, else ``redraw`` of the masked ``logits`` (-1: the
        grammar allows no token, which a well-formed grammar never does)."""
        one, arr = self._one, self._one_arr
        one[0] = (t, 0.0, 0.0)
        arr.size, arr.selected, arr.sorted = 1, -1, False
        self._apply(grammar, self._one_ref)
        if one["logit"][0] != _NEG_INF:
            return t
        full, arr = self._full, self._full_arr
        full["logit"] = logits
        arr.data, arr.size, arr.selected, arr.sorted = self._full_data, self._n, -1, False
        self._apply(grammar, self._full_ref)
        masked = full["logit"]
        if masked.max() == _NEG_INF:
            return -1
        return redraw(masked)
