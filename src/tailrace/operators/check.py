"""``verify``: judge each record's answer with a verifier and write the verdict.

>>> from tailrace.api.yaml_loader import loads_pipeline
>>> p = loads_pipeline('''{version: 1, pipeline: ex, source: {fields: [answer]}, stages: [
...     {id: check, op: verify, verifier: {regex: '^[0-9]+$'}}]}''')
>>> result = tr.run(p, input=[{"answer": "42"}, {"answer": "forty-two"}])
>>> [r["verdict"]["ok"] for r in result.outputs]
[True, False]

The verifier is one of ``tailrace.verify``'s kinds (``unit_tests``, ``json_schema``,
``regex``, ``grounded``, ``python``), checked when the pipeline compiles. The call is a
coroutine on the stage's event loop (a ``unit_tests`` sandbox run is a subprocess the loop
waits for), so one replica checks one record at a time; ``replicas: N`` checks N at once.

verifier: ``{kind: options}`` (docs/pipeline-yaml.md, ``verify``).
field:    the text to check (default ``answer``, what ``generate`` writes).
out:      the field for the verdict ``{ok, reason, verifier}`` (default ``verdict``).
on_fail:  ``keep`` (the record goes on with its verdict) or ``error`` (it ends as an
          error record: ``VerificationFailed`` with the message ``"<verifier>: <reason>"``
          and the verdict as its ``detail``, ``{out: verdict}``).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from ..errors import PlanError, VerificationFailed
from ..verify import Verifier, make_verifier
from .common import get_field
from .registry import BuildContext, LinkContext, OpDef, OpRuntime, Param, register

ON_FAIL = ("keep", "error")


def as_text(value: Any) -> str:
    """The text a verifier checks: a string as it is, JSON for a mapping or a list (a
    structured answer), ``""`` for None, else ``str``.

    >>> as_text({"a": 1}), as_text(None), as_text(3)
    ('{"a": 1}', '', '3')
    """
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return str(value)


def _fields(params: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    reads: tuple[str, ...] = (params["field"],)
    with contextlib.suppress(PlanError):  # ``prepare`` reports it, naming the stage
        reads += make_verifier(params["verifier"]).fields
    return tuple(dict.fromkeys(reads)), (params["out"],)


def _prepare(params: dict, ctx: LinkContext) -> dict:
    make_verifier(params["verifier"], "verifier")  # a PlanError names the stage
    return params


def _build(params: dict, ctx: BuildContext) -> OpRuntime:
    verifier = make_verifier(params["verifier"])
    field, out, error = params["field"], params["out"], params["on_fail"] == "error"
    reads = tuple(f for f in verifier.fields if f != field)
    counts = {"verified": 0, "passed": 0, "failed": 0}

    async def check(r: Any) -> list:
        answer = as_text(get_field(r, field))
        for f in reads:
            get_field(r, f)  # a missing field fails the record with the field's name
        v = await verifier(answer, r)
        counts["verified"] += 1
        counts["passed" if v.ok else "failed"] += 1
        if not v.ok and error:
            exc = VerificationFailed(f"{v.verifier}: {v.reason}")
            exc.detail = {out: v.to_dict()}  # type: ignore[attr-defined]  # the error record's
            raise exc
        return [{**r, out: v.to_dict()}]

    return OpRuntime("map", record_fn=check, is_async=True, counters=lambda: dict(counts))


register(OpDef(
    "verify", "map", _build,
    (Param("verifier", (dict, Verifier), required=True,
           doc="a mapping with one verifier kind, like {regex: '^[0-9]+$'}",
           want="a mapping with one of unit_tests, json_schema, regex, grounded, python"),
     Param("field", (str,), default="answer", want="a field name (the text to check)"),
     Param("out", (str,), default="verdict", want="a field name (for the verdict)"),
     Param("on_fail", (str,), default="keep", want="keep or error",
           check=lambda v: v in ON_FAIL)),
    fusable=False, fields=_fields, prepare=_prepare,
    doc="check each answer with a verifier (unit tests, JSON Schema, regex, grounding, "
        "a function)"))
