"""A request's own priority class and deadline for admission, within its pipeline's bounds.

The body fields ``priority`` and ``deadline_ms`` (OpenAI requests) or the headers
``X-Tailrace-Priority`` and ``X-Tailrace-Deadline-Ms`` (any request) ask for them, within
what the pipeline's ``serve:`` allows (docs/serving.md, "Priority and deadline");
``urgency`` returns what the request carries to the admission gate (``Request.asked``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..api import ServeSpec
from ..api.pipeline import PRIORITY_CLASSES
from ..control.slo import rank_of
from .openai_wire import WireError

PRIORITY_HEADER = "X-Tailrace-Priority"
DEADLINE_HEADER = "X-Tailrace-Deadline-Ms"
BUDGET_HEADER = "X-Tailrace-Budget"
_CLASSES = "'interactive', 'standard', 'batch' or an integer class (higher is more urgent)"


def _priority(value: Any, where: str, header: bool) -> str | int:
    if header:
        text = value.strip()
        if text in PRIORITY_CLASSES:
            return text
        try:
            return int(text)
        except ValueError:
            pass
    elif (isinstance(value, str) and value in PRIORITY_CLASSES) or (
            isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise WireError(f"{where} must be {_CLASSES}, got {value!r}", code="invalid_parameter")


def _deadline(value: Any, where: str, header: bool) -> float:
    v = value
    if header:
        try:
            v = float(value.strip())
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or v <= 0:
        raise WireError(f"{where} must be a positive number of milliseconds from the "
                        f"request's arrival, got {value!r}", code="invalid_parameter")
    return float(v)


def _one(body: Mapping[str, Any] | None, headers: Mapping[str, str], field: str,
         header: str, parse: Any, same: Any) -> Any:
    """The value of ``field`` from the body and/or ``header``; 400 when they disagree."""
    raw = body.get(field) if body is not None else None
    got = parse(raw, f"'{field}'", False) if raw is not None else None
    hraw = headers.get(header)
    if hraw is not None:
        hv = parse(hraw, f"header {header}", True)
        if got is not None and not same(got, hv):
            raise WireError(f"'{field}' ({raw!r}) and header {header} ({hraw!r}) disagree; "
                            "send one of them", code="conflicting_parameter")
        got = hv if got is None else got
    return got


def _amount(value: Any, where: str, header: bool) -> float:
    v = value
    if header:
        try:
            v = float(value.strip())
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or v <= 0:
        raise WireError(f"{where} must be a positive number (what the answer may cost, in "
                        f"the engines' price unit), got {value!r}", code="invalid_budget")
    return float(v)


def budget(spends: str | None, name: str, body: Mapping[str, Any] | None,
           headers: Mapping[str, str]) -> float | None:
    """The request's budget (body ``budget`` or header ``X-Tailrace-Budget``), or None;
    400 for a bad or conflicting one, one the pipeline cannot spend (``spends``: its
    answering stage's ``Answers.budgets``) or none where the pipeline requires one."""
    got = _one(body, headers, "budget", BUDGET_HEADER, _amount, lambda a, b: a == b)
    if got is not None and spends is None:
        raise WireError(f"pipeline '{name}' does not spend budgets (no route with escalate: "
                        "answers it); drop 'budget' / X-Tailrace-Budget", code="budget_unused")
    if got is None and spends == "required":
        raise WireError(f"pipeline '{name}' needs a budget per request: send 'budget' or "
                        f"header {BUDGET_HEADER}, a positive number", code="budget_required")
    return got


def urgency(serve: ServeSpec | None, name: str, body: Mapping[str, Any] | None,
            headers: Mapping[str, str]) -> dict[str, Any] | None:
    """The request's ``{"priority": CLASS, "deadline_ms": MS}`` (the keys it set), or None
    when it set neither; 400 naming the field for a bad, conflicting or disallowed value.
    ``body``: the OpenAI request's JSON object, or None (``/runs``: headers only)."""
    priority = _one(body, headers, "priority", PRIORITY_HEADER, _priority,
                    lambda a, b: rank_of(a) == rank_of(b))
    deadline = _one(body, headers, "deadline_ms", DEADLINE_HEADER, _deadline,
                    lambda a, b: a == b)
    out: dict[str, Any] = {}
    if priority is not None:
        allowed = serve.priorities if serve is not None else None
        if allowed is None:
            raise WireError(f"pipeline '{name}' does not let a request choose its priority; "
                            "allow classes in its YAML, e.g. serve: {priorities: [batch, "
                            "standard]}", code="priority_not_allowed")
        if rank_of(priority) not in {rank_of(c) for c in allowed}:
            raise WireError(f"'priority' {priority!r} is not allowed by pipeline '{name}'; "
                            f"allowed: {', '.join(str(c) for c in allowed)}",
                            code="priority_not_allowed")
        out["priority"] = priority
    if deadline is not None:
        bounds = serve.deadline_ms if serve is not None else None
        if bounds is None:
            raise WireError(f"pipeline '{name}' does not let a request set its deadline; "
                            "allow a range in its YAML, e.g. serve: {deadline_ms: {min: "
                            "200, max: 30000}}", code="deadline_not_allowed")
        lo, hi = bounds
        if (lo is not None and deadline < lo) or (hi is not None and deadline > hi):
            span = " and ".join(part for part in (
                f"at least {lo:g}" if lo is not None else "",
                f"at most {hi:g}" if hi is not None else "") if part)
            raise WireError(f"'deadline_ms' must be {span} for pipeline '{name}', got "
                            f"{deadline:g}", code="deadline_not_allowed")
        out["deadline_ms"] = deadline
    return out or None


def bounds(serve: ServeSpec | None) -> dict[str, Any]:
    """What ``GET /v1/models`` shows of a pipeline's bounds: ``priorities`` (the classes a
    request may choose) and ``deadline_ms`` (``{"min", "max"}``), where it declares them."""
    out: dict[str, Any] = {}
    if serve is not None and serve.priorities is not None:
        out["priorities"] = list(serve.priorities)
    if serve is not None and serve.deadline_ms is not None:
        lo, hi = serve.deadline_ms
        out["deadline_ms"] = {"min": lo, "max": hi}
    return out
