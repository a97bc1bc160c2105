"""The fault suite's account: invariant 1 by lineage, explained errors, output fields,
queue bounds and drop counts, from what a run produced (``Observed``)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import tailrace.errors as tr_errors
from tailrace.request import REQUEST, Cancel, Request

from .harness import (
    Scenario,
    call_cost,
    escalated,
    escalation,
    fanout,
    key_of,
    lineages,
    on_fail,
    scripted_answer,
    stage_id,
    tool_answer,
    tool_spec,
    tools_field,
    tools_step,
    verified,
)

#: error types a stage with ``timeout_ms`` may end a record with (tailrace's own errors:
#: StageTimeout, or whatever the runtime says when too many calls are abandoned)
TAILRACE_ERRORS = frozenset(n for n, v in vars(tr_errors).items()
                            if isinstance(v, type) and issubclass(v, Exception))


@dataclass
class Observed:
    """What a run produced, as the suite saw it."""

    entered: set[int]  # lids of the records that entered the run
    outputs: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # ErrorRecords
    ledger: list = field(default_factory=list)  # (kind, stage, path)
    complete: bool = True  # False for interrupted runs: records may not have ended
    cancelled: set[int] = field(default_factory=set)  # lids whose caller gave up (serving)
    transient: frozenset = frozenset()  # non-user fields the caller's records may hold
    tools: bool = False  # serving: requests offer the first tools step tools (tool_spec)


FIELDS = frozenset({"lid", "path", "grp", "hops", "count", "items", "verdict"})
#: what the ``escalate`` stage of step index N writes: answerN (the scripted answer),
#: routeN (the decision: engine, tried, spent, budget, verdict, ...) and costN (per engine)
ESCALATE_FIELD = re.compile(r"(answer|route|cost)(\d+)")
#: what the ``tools`` stage of step index N writes: toolsN (its answer, ``tool_answer()``)
TOOLS_FIELD = re.compile(r"tools(\d+)")


def _foreign(x: Any, transient: frozenset) -> list[str]:
    """Fields of an output (or of a batch's members) that neither the input nor any
    operator put there (e.g. a runtime's bookkeeping leaking out)."""
    if not isinstance(x, dict):
        return []
    out = sorted(k for k in x if k not in FIELDS and k not in transient
                 and not ESCALATE_FIELD.fullmatch(k) and not TOOLS_FIELD.fullmatch(k))
    req = x.get(REQUEST)
    if REQUEST in x and (REQUEST not in transient or not isinstance(req, Request)
                         or type(req.cancel.parent) is Cancel):  # e.g. a timed attempt's
        out.append(f"{REQUEST}={req!r:.80} (not the caller's request)")
    for r in x.get("items", ()):
        out += _foreign(r, transient)
    return out


def account(sc: Scenario, obs: Observed) -> list[str]:
    """Invariant 1 by lineage, and whether each error record is explained by a fault."""
    problems: list[str] = []
    ends: dict[tuple, list[str]] = defaultdict(list)
    failed_at: set[tuple[str, tuple]] = set()
    for r in obs.outputs:
        try:
            for p in lineages(r):
                ends[p].append("output")
        except ValueError as e:
            problems.append(f"an output has no lineage: {e}")
        foreign = _foreign(r, obs.transient)
        if foreign:
            problems.append(f"an output carries fields nobody wrote: {foreign} in {r!r:.300}")
        problems += answer_problems(sc, r, obs.cancelled)
        problems += tools_problems(sc, r, obs)
    for e in obs.errors:
        try:
            paths = lineages(e.input)
        except ValueError:
            problems.append(f"an error record has no lineage: {e}")
            continue
        for p in paths:
            ends[p].append(f"error at {e.stage} ({e.error})")
            failed_at.add((e.stage, p))
    silent: dict[tuple[str, tuple], str] = {}
    for kind, stage, path in obs.ledger:  # an abandoned call's verdict does not count
        if (stage, path) not in failed_at:
            silent[(stage, path)] = kind
    for (stage, path), kind in silent.items():
        ends[path].append(f"{kind} at {stage}")
    for p, how in sorted(ends.items()):
        if len(how) > 1:
            problems.append(f"record {p} ended {len(how)} times: {how}")
    ended = set(ends)
    fanned = {p[:i] for p in ended for i in range(1, len(p))}
    for p in sorted(ended & fanned):
        problems.append(f"record {p} both ended ({ends[p]}) and had children")
    seen: set[tuple] = set()
    missing: list[tuple] = []
    stack = [(lid,) for lid in sorted(obs.entered)]
    while stack:
        p = stack.pop()
        seen.add(p)
        if p in ended:
            continue
        if p in fanned:
            stack.extend(p + (i,) for i in range(fanout(sc.seed, p)))
        else:
            missing.append(p)
    if missing and obs.complete:
        problems.append(f"{len(missing)} record(s) never ended (lost): {sorted(missing)[:10]}")
    phantom = sorted((ended | fanned) - seen)
    if phantom:
        problems.append(f"records that never entered came out: {phantom[:10]}")
    problems += explain_errors(sc, obs)
    return problems


def explain_errors(sc: Scenario, obs: Observed) -> list[str]:
    """Each error record must come from an injected fault, a declared timeout, admission,
    or (serving) a caller that gave up while its request waited for admission."""
    steps = {stage_id(i, s): s for i, s in enumerate(sc.steps)}
    problems = []
    for e in obs.errors:
        if e.stage == "admission" and sc.admission is not None:
            gone = e.error == "CallerGone" and _safe_lineages(e.input)[:1] and \
                _safe_lineages(e.input)[0][0] in obs.cancelled
            if e.error != "AdmissionRejected" and not gone:
                problems.append(f"admission failed with {e.error}: {e.message}")
            continue
        step = steps.get(e.stage)
        if step is None:
            problems.append(f"error at a stage that injects nothing ({e.stage}): "
                            f"{e.error}: {e.message}")
            continue
        c = dict(step.contract)
        retries, timeout = c.get("retries", 0), c.get("timeout_ms")
        if e.error == "InjectedFault":
            if step.op == "escalate" and step.faults.fate(sc.seed, e.stage, key_of(e.input)) \
                    not in ("always", "first"):
                # its verifier raises for the record it checks only: a batch-mate's fault
                # must not end this one (nor undo an answer already given)
                problems.append(f"unexplained error at {e.stage}: {key_of(e.input)} meets no "
                                f"raising fault there, yet ended with {e.message}")
            elif e.message.startswith("first ") and retries and timeout is None:
                problems.append(f"{e.stage} has retries={retries} but a first-attempt-only "
                                f"fault ended the record: {e.message}")
            elif e.message.startswith("always") and e.attempts != 1 + retries:
                problems.append(f"{e.stage} has retries={retries} but the record was tried "
                                f"{e.attempts} time(s)")
        elif e.error == "VerificationFailed" and step.op == "verify":
            if on_fail(sc.seed, e.stage) != "error":
                problems.append(f"unexplained error at {e.stage}: on_fail keep, yet a failed "
                                f"verdict ended the record: {e.message}")
            elif verified(sc.seed, e.stage, key_of(e.input)):
                problems.append(f"unexplained error at {e.stage}: its verifier passed the "
                                f"record: {e.message}")
        elif step.op == "escalate" and e.error in ("BudgetExhausted", "VerificationFailed"):
            problems += _escalate_error(sc, e, obs.cancelled)
        elif timeout is not None and e.error in TAILRACE_ERRORS:
            pass  # StageTimeout (or a runtime's clear error about abandoned calls)
        else:
            problems.append(f"unexplained error at {e.stage} "
                            f"({step.op}, {dict(step.contract)}): {e.error}: {e.message}")
    return problems


def _tried(route: Any) -> list:
    return [(c.get("engine"), c.get("passed")) for c in (route or {}).get("tried", ())]


def _cut_short(sc: Scenario, stage: str, key: tuple, cancelled: set[int],
               seen: list) -> tuple | None:
    """A cancelled request is not escalated: if the record's caller gave up, the
    ``(outcome, engine, tried)`` it may end with instead of ``escalated()``'s, given the
    calls ``seen``: any failed first ones (the cancel lands while one is verified), then
    on_fail decides, as when no provider is left. None: not so."""
    _, _, tried = escalated(sc.seed, stage, key)
    k = len(seen)
    if key[0] not in cancelled or not 0 < k <= len(tried) or seen != tried[:k] or \
            any(ok for _, ok in seen):
        return None
    if escalation(sc.seed, stage).on_fail == "keep":
        return "kept", seen[-1][0], seen
    return "VerificationFailed", None, seen


def _escalate_error(sc: Scenario, e: Any, cancelled: set[int]) -> list[str]:
    """A ``BudgetExhausted`` or ``VerificationFailed`` error record of an ``escalate``
    stage: only when ``escalated()`` says the record ends so (a budget that stops the next
    provider after the ones that failed; ``on_fail: error`` and every provider failed),
    with the calls it says in its detail; a cancelled request may end cut short."""
    key = key_of(e.input)
    outcome, _, tried = escalated(sc.seed, e.stage, key)
    short = _cut_short(sc, e.stage, key, cancelled, _tried((e.detail or {}).get("route")))
    if short is not None and short[0] == e.error:
        return []
    setup = escalation(sc.seed, e.stage)
    if outcome != e.error:
        return [f"unexplained error at {e.stage} ({setup}): {key} should have ended "
                f"{outcome} after {tried}, got {e.error}: {e.message}"]
    route = (e.detail or {}).get("route")
    if route is None or _tried(route) != tried:
        return [f"unexplained error at {e.stage} ({setup}): {e.error} for {key} should "
                f"show the calls {tried}, its detail says {e.detail}"]
    return []


def answer_problems(sc: Scenario, r: Any, cancelled: set[int] = frozenset()) -> list[str]:
    """The answer of every ``escalate`` stage an output (or a batch's member) passed:
    the provider, the calls and the verdict ``escalated()`` says, for the record the
    answer names; an output of a record that should have ended there is a wrong answer.
    A cancelled request's may be cut short (``_cut_short``)."""
    if not isinstance(r, dict):
        return []
    problems: list[str] = []
    for m in r.get("items", ()):
        problems += answer_problems(sc, m, cancelled)
    for k in sorted(r):
        m = ESCALATE_FIELD.fullmatch(k)
        if m is None or m.group(1) != "route":
            continue
        i = int(m.group(2))
        sid = stage_id(i, sc.steps[i]) if i < len(sc.steps) else f"escalate{i}"
        route, answer, cost = r[k], r.get(f"answer{i}"), r.get(f"cost{i}")
        try:
            word, engine, stage, key = scripted_answer(answer)
        except (AttributeError, ValueError) as e:
            problems.append(f"request {r.get('lid')}: {sid} wrote an answer that no scripted "
                            f"provider gives: {answer!r:.100} ({e})")
            continue
        outcome, want, tried = escalated(sc.seed, sid, key)
        short = _cut_short(sc, sid, key, cancelled, _tried(route))
        if short is not None and short[0] == "kept":
            outcome, want, tried = short
        where = f"{sid} ({escalation(sc.seed, sid)}) on {key}"
        if stage != sid or tuple(r["path"][:len(key)]) != key:
            problems.append(f"request {r.get('lid')}: {sid} answered with the answer of "
                            f"{stage} {key}: {answer!r}")
        elif outcome not in ("solved", "kept"):
            problems.append(f"request {r.get('lid')}: {where} should have ended {outcome} "
                            f"after {tried}; it went on with {engine}'s answer {answer!r}")
        elif (engine, route.get("engine"), _tried(route)) != (want, want, tried) or \
                route.get("verdict", {}).get("ok") is not (outcome == "solved") or \
                word != ("pass" if outcome == "solved" else "fail"):
            problems.append(f"request {r.get('lid')}: {where} should be {outcome} by {want} "
                            f"after {tried}; got {answer!r}, decision {route}")
        elif abs(route.get("spent", -1) - sum(call_cost(n) for n, _ in tried)) > 1e-9 or \
                not isinstance(cost, dict) or set(cost) != {n for n, _ in tried}:
            problems.append(f"request {r.get('lid')}: {where}: spent {route.get('spent')} "
                            f"and costs {cost} for the calls {tried}")
    return problems


def tools_problems(sc: Scenario, r: Any, obs: Observed) -> list[str]:
    """The answer of every ``tools`` stage an output (or a batch's member) passed: exactly
    ``tool_answer()`` for the record it answered (the output's lineage or a prefix of
    it: a flat_map after the stage) and the tools its request offered that stage (served:
    the first tools step, ``tool_spec()``; else none, so text). A cancelled request's
    answer may stop short: any beginning of it."""
    if not isinstance(r, dict):
        return []
    problems: list[str] = []
    for m in r.get("items", ()):
        problems += tools_problems(sc, m, obs)
    path = tuple(r.get("path", ()))
    for k in sorted(r):
        m = TOOLS_FIELD.fullmatch(k)
        if m is None or not path:
            continue
        i = int(m.group(1))
        sid = f"tools{i}"
        spec = tool_spec(sc.seed, path[0]) if obs.tools and i == tools_step(sc) else None
        answer = r[k]
        wants = [tool_answer(sc.seed, sid, path[:j], spec) for j in range(1, len(path) + 1)]
        if answer in wants:
            continue
        if path[0] in obs.cancelled and isinstance(answer, str) and \
                any(w.startswith(answer) for w in wants):
            continue  # its caller gave up while it was answered
        problems.append(f"request {r.get('lid')}: {sid}, offered {offered(spec)}, "
                        f"answered {answer!r:.200}; its script says one of {wants}")
    return problems


def reply_problems(sc: Scenario, answer: dict, request: Any) -> list[str]:
    """A served request's reply (``Request.reply``) once answered, not cancelled: if it
    offered tools and its answer passed the answering (first) tools step as the record
    it was sent as (not fanned out: a sibling reports to the same reply), the finish is
    ``tool_calls`` exactly when that answer is a call, else ``stop``."""
    from tailrace.engines.tool_calls import split_calls

    i = tools_step(sc)
    if i is None or request is None or request.tools is None:
        return []
    text, path = answer.get(tools_field(i)), tuple(answer.get("path", ()))
    if not path or text != tool_answer(sc.seed, tools_field(i), path[:1], request.tools):
        return []  # another branch, fanned out before the stage, or a wrong answer
    want = "tool_calls" if split_calls(text)[1] else "stop"
    if request.reply.finish != want:
        return [f"request {path[0]}: answered {text!r} by {tools_field(i)} (offered "
                f"{offered(request.tools)}), yet its reply's finish is "
                f"{request.reply.finish!r}, not {want!r}"]
    return []


def offered(spec: Any) -> str:
    """A request's tools, in a few words."""
    if spec is None:
        return "no tools"
    return f"tools {[f['name'] for f in spec.functions]}, choice {spec.choice}"


def queue_problems(stats: Any) -> list[str]:
    """Invariant 3: no stage's channel ever held more than its bound."""
    return [f"stage {s.stage} held {s.max_queue_depth} records, bound {s.queue_bound}"
            for s in getattr(stats, "stages", ()) if s.queue_bound
            and s.max_queue_depth > s.queue_bound]


def drop_problems(sc: Scenario, obs: Observed, stats: Any) -> list[str]:
    """The stats' per-stage drop counts agree with the filters' own verdicts."""
    failed_at = {(e.stage, p) for e in obs.errors for p in _safe_lineages(e.input)}
    drops: dict[str, set] = defaultdict(set)
    for kind, stage, path in obs.ledger:
        if kind == "drop" and (stage, path) not in failed_at:
            drops[stage].add(path)
    problems = []
    for i, step in enumerate(sc.steps):
        sid = stage_id(i, step)
        if step.op != "filter":
            continue
        try:
            st = stats[sid]
        except KeyError:
            continue
        counted = getattr(st, "dropped", None)
        if counted is not None and counted != len(drops[sid]):
            problems.append(f"stats say filter {sid} dropped {counted} records; it dropped "
                            f"{len(drops[sid])}")
    return problems


def _safe_lineages(x: Any) -> list[tuple]:
    try:
        return lineages(x)
    except ValueError:
        return []
