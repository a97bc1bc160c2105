"""Verifiers: does an answer pass? ``await verifier(answer, record) -> Verdict``.

``make_verifier(spec, where)`` builds one from a pipeline's YAML mapping with exactly one
key, the kind: ``unit_tests`` (a record's tests against generated code, in the sandbox),
``json_schema``, ``regex``, ``grounded`` (in the retrieved passages) or ``python`` (any
function). The ``verify`` operator and the budgeted ``route`` strategy both use it; the
kinds and their options are in docs/pipeline-yaml.md (``verify``), the sandbox's limits
and what it does not protect against in docs/design.md ("The verify sandbox").

>>> import asyncio
>>> v = make_verifier({"regex": {"pattern": "^yes", "flags": "i"}}, "verifier")
>>> asyncio.run(v("Yes, it is.", {}))
Verdict(ok=True, reason="matched 'Yes'", verifier='regex')
>>> make_verifier({"regexp": "x"}, "stage 'check': verifier")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
tailrace.errors.PlanError: stage 'check': verifier: unknown verifier 'regexp'; did you ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..api.pipeline import did_you_mean
from ..errors import PlanError
from .base import Verdict, Verifier, one_line
from .function import PythonCheck
from .sandbox import Limits, SandboxResult, run_program
from .text import Grounded, JsonSchema, Regex, grounded_from_spec, regex_from_spec
from .unit_tests import UnitTests
from .unit_tests import from_spec as unit_tests_from_spec

#: kind -> (build from the YAML value, what the value looks like)
KINDS: dict[str, tuple[Callable[[Any], Verifier], str]] = {
    "unit_tests": (unit_tests_from_spec,
                   "{tests: test, entry_point: entry_point, prompt: prompt, timeout_s: 10, "
                   "memory_mb: 512}"),
    "json_schema": (JsonSchema, "a JSON Schema mapping"),
    "regex": (regex_from_spec, "a pattern, or {pattern, flags}"),
    "grounded": (grounded_from_spec, "{passages: passages, min_overlap: 0.6}"),
    "python": (PythonCheck, "'module:function' or a callable (answer, record) -> bool"),
}


def make_verifier(spec: Any, where: str = "verifier") -> Verifier:
    """The verifier a spec describes: a mapping with exactly one key of ``KINDS`` (or a
    ``Verifier``, returned as it is). Raises a one-line ``PlanError`` whose message starts
    with ``where`` (the spec's place, e.g. ``"stage 'check': verifier"``) and says what is
    accepted."""
    if isinstance(spec, Verifier):
        return spec
    accepted = ", ".join(KINDS)
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise PlanError(one_line(f"must be a mapping with exactly one of {accepted} (like "
                                 f"{{regex: '^[0-9]+$'}}), got {spec!r:.80}"), where=where)
    ((kind, value),) = spec.items()
    if kind not in KINDS:
        raise PlanError(f"unknown verifier '{kind}'{did_you_mean(kind, KINDS)} (accepted: "
                        f"{accepted})", where=where)
    build, shape = KINDS[kind]
    try:
        return build(value)
    except ValueError as e:
        raise PlanError(one_line(f"{kind}: {e} ({kind} takes {shape})", 300),
                        where=where) from None


__all__ = ["KINDS", "Grounded", "JsonSchema", "Limits", "PythonCheck", "Regex", "SandboxResult",
           "UnitTests", "Verdict", "Verifier", "make_verifier", "run_program"]
