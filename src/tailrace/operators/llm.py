"""Generation operators: ``prompt`` (fill a template) and ``generate`` (call an LLM).

``generate`` calls its engine once per micro-batch (at most ``max_batch`` records, or
the stage's ``batch`` contract), so concurrent requests share one batched decode.
Tokens stream as they are produced to a record's ``_stream`` callable when it has
one, and a record whose ``_cancel`` (a ``threading.Event``) is set stops generating at
the next token, freeing its engine sequence (fields starting with ``_`` are transient
and never written to output files).
"""

from __future__ import annotations

import string
from typing import Any

from ..engines import GenerationRequest, open_engine
from ..errors import ContextOverflow
from .common import (
    ENGINE_HINT,
    FieldError,
    count_param,
    each_record,
    link_engine,
    non_negative,
)
from .core import per_record
from .registry import OpDef, OpRuntime, Param, register


def template_fields(template: str) -> tuple[str, ...]:
    """The ``{field}`` names a template uses, in order, without repeats."""
    names: list[str] = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None:
            base = name.split(".")[0].split("[")[0]
            if not base:
                raise ValueError(f"template {template!r} has a positional '{{}}'; "
                                 "name the field, like {question}")
            if base not in names:
                names.append(base)
    return tuple(names)


def render(template: str, record: Any) -> str:
    try:
        return template.format_map(record)
    except KeyError as e:
        have = ", ".join(map(str, record)) if isinstance(record, dict) else ""
        raise FieldError(f"template needs field {e} (record has: {have or 'no fields'})") from None
    except (TypeError, AttributeError):
        raise FieldError(f"template needs a JSON object, got {type(record).__name__}") from None


def _check_template(params: dict, ctx: Any) -> dict:
    template_fields(params["template"])
    return params


# what generate, route and tool_call share: the prompt is a template or a field's text
PROMPT_PARAMS = (Param("prompt", (str,), want="a template with {field} placeholders"),
                 Param("input", (str,), want="a field holding the prompt text"))
TEMPERATURE = Param("temperature", (int, float), default=0.0, want="a number >= 0",
                    check=non_negative)


def check_prompt_source(params: dict, op: str) -> None:
    """ValueError unless exactly one of 'prompt' and 'input' is set; checks the template."""
    if (params.get("prompt") is None) == (params.get("input") is None):
        raise ValueError(f"{op} needs exactly one of 'prompt' (a template with {{fields}}) "
                         "or 'input' (a field holding the prompt text)")
    if params.get("prompt") is not None:
        template_fields(params["prompt"])


def prompt_reads(params: dict) -> tuple[str, ...]:
    """The fields the prompt is made of."""
    return template_fields(params["prompt"]) if params.get("prompt") else (params["input"],)


def prompt_text(template: str | None, inp: str | None, record: Any) -> str:
    """The prompt of ``record``: ``template`` filled in, else the text of field ``inp``."""
    if template is not None:
        return render(template, record)
    value = record.get(inp) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise FieldError(f"field '{inp}' must hold the prompt text")
    return value


def _build_prompt(params: dict, contract: Any) -> OpRuntime:
    template, out = params["template"], params["output"]
    f = lambda r: {**r, out: render(template, r)}  # noqa: E731
    return OpRuntime("map", batch_fn=per_record(f), record_fn=lambda x: [f(x)])


register(OpDef(
    "prompt", "map", _build_prompt,
    (Param("template", (str,), required=True, want="a text with {field} placeholders"),
     Param("output", (str,), default="prompt", want="a field name")),
    fields=lambda p: (template_fields(p["template"]), (p["output"],)),
    prepare=_check_template, doc="fill a template with record fields"))


def _prepare_generate(params: dict, ctx: Any) -> dict:
    check_prompt_source(params, "generate")
    return link_engine(params, ctx, "generate")


def _build_generate(params: dict, contract: Any) -> OpRuntime:
    engine = open_engine(params["_engine"])
    chat = getattr(engine, "chat", True)
    template, inp, out = params.get("prompt"), params.get("input"), params["output"]
    system = params.get("system")
    usage = params.get("usage")
    stop = tuple(params.get("stop") or ())
    max_tokens, temperature = params["max_tokens"], float(params["temperature"])
    limit = engine.context_length - max_tokens

    def request(record: Any) -> GenerationRequest:
        text = prompt_text(template, inp, record)
        n = engine.count_tokens(text)
        if n > limit:
            raise ContextOverflow(
                f"prompt has {n} tokens; with max_tokens={max_tokens} it exceeds the model "
                f"context of {engine.context_length} tokens; shorten it (e.g. a refine "
                "stage's max_tokens) or lower max_tokens")
        if chat:
            msgs = ({"role": "system", "content": system},) if system else ()
            return GenerationRequest(messages=msgs + ({"role": "user", "content": text},),
                                     max_tokens=max_tokens, temperature=temperature,
                                     stop=stop)
        return GenerationRequest(prompt=text, max_tokens=max_tokens, temperature=temperature,
                                 stop=stop)

    def call(records: list, reqs: list) -> list:
        streams = [r.get("_stream") if isinstance(r, dict) else None for r in records]
        cancels = [r.get("_cancel") if isinstance(r, dict) else None for r in records]
        on_token = None
        if any(callable(s) for s in streams) or any(c is not None for c in cancels):
            def on_token(i: int, piece: str) -> bool:
                s = streams[i]
                if callable(s):
                    s(piece)
                c = cancels[i]
                return c is None or not c.is_set()  # False: the engine stops this one
        gens = engine.generate(reqs, on_token)
        if usage is None:
            return [{**r, out: g.text} for r, g in zip(records, gens, strict=True)]
        return [{**r, out: g.text, usage: {"prompt_tokens": g.prompt_tokens,
                                           "completion_tokens": g.completion_tokens}}
                for r, g in zip(records, gens, strict=True)]

    def batch_fn(batch: list, errors: list) -> list:
        keep, reqs = each_record(batch, errors, request)
        if not keep:
            return []
        try:
            return call(keep, reqs)
        except ContextOverflow:  # the chat template tipped one over: isolate it
            result = []
            for r, q in zip(keep, reqs, strict=True):
                try:
                    result += call([r], [q])
                except ContextOverflow as e:
                    errors.append((r, e))
            return result

    # no record_fn: the runtime calls batch_fn([x]) per record and raises its error
    return OpRuntime("map", batch_fn=batch_fn, max_batch=params["max_batch"])


register(OpDef(
    "generate", "map", _build_generate,
    (Param("engine", (str,), required=True, want=ENGINE_HINT),
     *PROMPT_PARAMS,
     Param("output", (str,), default="answer", want="a field name"),
     Param("system", (str,), want="a system message (chat models)"),
     count_param("max_tokens", 64),
     TEMPERATURE,
     Param("stop", (list,), want="a list of stop strings"),
     count_param("max_batch", 8),
     Param("usage", (str,), want="a field for {prompt_tokens, completion_tokens}")),
    batchable=True, blocking=True,
    fields=lambda p: (prompt_reads(p), (p["output"],) + ((p["usage"],) if p.get("usage") else ())),
    prepare=_prepare_generate, doc="generate text with an LLM engine"))
