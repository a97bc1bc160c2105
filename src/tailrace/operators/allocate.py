"""Budgeted, verified allocation: the ``route`` strategy ``escalate:`` (docs/routing.md).

Each record gets a plan, an order of providers (as listed, by price, or a learned
policy's), and a budget (its request's, a field's or the stage's). Before each call the
allocator bounds what the call can cost (the prompt's tokens plus ``max_tokens``, at
the provider's price); a provider that does not fit in what is left is skipped. Each
answer is verified; the first that passes ends the record, a failure escalates to the
next provider (unless its request was cancelled: a caller who gave up, or an attempt
a timeout abandoned, pays for no further call). A record that runs out of providers ends
as an error record:
``BudgetExhausted`` when the budget stopped it (or the policy declined), else (with
``on_fail: error``) ``VerificationFailed``; ``on_fail: keep`` keeps the last answer with
its failing verdict. Records at the same step share one batched call per provider, and
their verifications run concurrently.

The ``Ledger`` counts, per stage label and per tenant, requests, solved, exhausted,
revenue, spend and margin (revenue is what a solved record pays: its budget, or the
stage's fixed ``revenue``); ``/metrics`` and the run summary show it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from ..engines.price import Price
from ..errors import BudgetExhausted, VerificationFailed
from ..registry import Registry
from ..request import request_of
from ..verify.base import field_of
from .llm import MESSAGE_OVERHEAD, cancelled, stream_of
from .policy import Policy, next_plan, with_history

_ZERO = Price(0.0, 0.0)




def _run(coro: Any) -> Any:
    """Run ``coro`` to completion from a blocking operator: here, or on a thread of its own
    when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: list = []

    def main() -> None:
        try:
            out.append((True, asyncio.run(coro)))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            out.append((False, e))

    t = threading.Thread(target=main)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


@dataclass
class Account:
    """What one stage (or one tenant of it) took in and spent."""

    requests: int = 0
    solved: int = 0
    exhausted: int = 0  # ended by the budget, or declined
    unsolved: int = 0  # every provider tried, none passed
    revenue: float = 0.0
    spend: float = 0.0

    @property
    def margin(self) -> float:
        return self.revenue - self.spend

    def as_dict(self) -> dict[str, float]:
        return {"requests": self.requests, "solved": self.solved, "exhausted": self.exhausted,
                "unsolved": self.unsolved, "revenue": self.revenue, "spend": self.spend,
                "margin": self.margin}


class Ledger:
    """Accounts of one budgeted route stage: in total, per tenant, and spend per engine."""

    def __init__(self, label: str) -> None:
        self.label, self.lock = label, threading.Lock()
        self.total = Account()
        self.tenants: dict[str, Account] = {}
        self.engines: dict[str, dict[str, float]] = {}

    def settle(self, tenant: str | None, outcome: str, revenue: float, spend: float,
               calls: list[dict[str, Any]]) -> None:
        with self.lock:
            for acc in (self.total, self.tenants.setdefault(tenant, Account())
                        if tenant is not None else None):
                if acc is None:
                    continue
                acc.requests += 1
                setattr(acc, outcome, getattr(acc, outcome) + 1)
                acc.revenue += revenue
                acc.spend += spend
            for c in calls:
                e = self.engines.setdefault(c["engine"], {"calls": 0, "passed": 0, "spend": 0.0})
                e["calls"] += 1
                e["passed"] += bool(c["passed"])
                e["spend"] += c["cost"]

    def statistics(self) -> dict[str, Any]:
        with self.lock:
            return {"label": self.label, **self.total.as_dict(),
                    "tenants": {t: a.as_dict() for t, a in self.tenants.items()},
                    "engines": {e: dict(v) for e, v in self.engines.items()}}


LEDGERS: Registry[Ledger] = Registry("allocation ledgers")


def ledgers() -> dict[str, dict[str, Any]]:
    """Every budgeted route stage's ledger in this process, by label."""
    return {str(k): v.statistics() for k, v in LEDGERS.items()}


class _Job:
    """One record's allocation in progress."""

    __slots__ = ("record", "plan", "budget", "spent", "calls", "last", "skipped", "x", "cut")

    def __init__(self, record: Any, plan: list[str], budget: float | None, x: Any) -> None:
        self.record, self.plan, self.budget, self.x = record, plan, budget, x
        self.spent = 0.0
        self.calls: list[dict[str, Any]] = []
        self.last: tuple[Any, Any] | None = None  # (Generation, Verdict) of the last call
        self.skipped: list[str] = []  # providers the budget left out
        self.cut = False  # its caller gave up: not escalated, whatever the budget left


class Allocator:
    """Runs the ``escalate:`` strategy of one route stage replica (see the module doc).

    targets: engine name -> ``route._Target``; prices: engine name -> Price (None: free).
    order: ``listed`` | ``price`` | ``policy``; budget: the stage's (None: unbounded, or
    per request); budget_field: a record field holding a record's budget; revenue: a
    fixed price per solved record, or None (a solved record pays its budget); learn:
    update ``policy`` from each verdict, and save it to ``policy_file`` after each batch.
    """

    def __init__(self, targets: dict[str, Any], escalate: list[str],
                 prices: dict[str, Price | None], verifier: Any, *, order: str,
                 budget: float | None, required: bool, budget_field: str | None,
                 revenue: float | None, policy: Policy | None, learn: bool,
                 on_fail: str, out: str, ledger: Ledger, run_ledger: Ledger,
                 policy_file: str | None = None, embedder: Any = None) -> None:
        self.targets, self.escalate = targets, escalate
        self.prices = {n: prices.get(n) or _ZERO for n in escalate}
        self.verifier, self.order, self.policy, self.learn = verifier, order, policy, learn
        self.budget, self.required, self.budget_field = budget, required, budget_field
        self.revenue, self.on_fail, self.out = revenue, on_fail, out
        self.ledgers = (ledger, run_ledger)
        self.policy_file, self.embedder = policy_file, embedder

    # -- planning ------------------------------------------------------------------------
    def prompt_tokens(self, name: str, record: Any) -> int:
        """The prompt tokens a call of ``name`` sends (chat template overhead included)."""
        t = self.targets[name]
        q = t.request(record)
        if q.messages is not None:
            return sum(t.engine.count_tokens(m["content"]) + MESSAGE_OVERHEAD
                       for m in q.messages)
        return t.engine.count_tokens(q.prompt or "")

    def bound(self, name: str, record: Any) -> float:
        return self.prices[name].bound(self.prompt_tokens(name, record),
                                       self.targets[name].max_tokens)

    def budget_of(self, record: Any) -> float | None:
        req = request_of(record)
        if req is not None and req.budget is not None:
            return req.budget
        if self.budget_field is not None and isinstance(record, dict) \
                and record.get(self.budget_field) is not None:
            v = record[self.budget_field]
            if type(v) not in (int, float) or not v > 0:
                raise ValueError(f"field '{self.budget_field}' must hold a positive budget, "
                                 f"got {v!r}")
            return float(v)
        if self.required:
            raise BudgetExhausted("this stage needs a budget per request (header "
                                  "X-Tailrace-Budget, body 'budget'"
                                  + (f" or field '{self.budget_field}'" if self.budget_field
                                     else "") + ") and this record has none")
        return self.budget

    def plan(self, record: Any, budget: float | None, vec: Any = None
             ) -> tuple[list[str], Any]:
        """``record``'s first plan, and (order: policy) its features (``vec``: its prompt's
        embedding, for a policy with an embedder) and the providers' expected costs,
        which ``replan`` uses again after each failure."""
        if self.order == "listed":
            return list(self.escalate), None
        if self.order == "price":
            return sorted(self.escalate, key=lambda n: self.bound(n, record)), None
        assert self.policy is not None
        x = self.policy.features(self.targets[self.escalate[0]].text(record), vec)
        c = {n: self.prices[n].cost(self.prompt_tokens(n, record),
                                    int(self.policy.completion_tokens.get(n) or 0)
                                    or self.targets[n].max_tokens) for n in self.escalate}
        return self.replan((x, c), [], [], budget), (x, c)

    def replan(self, xc: tuple, calls: list, skipped: list, left: float | None) -> list[str]:
        """The policy's best order of the providers not yet tried (nor skipped), given
        the failed ``calls`` so far (``policy.next_plan``)."""
        assert self.policy is not None
        x, c = xc
        revenue = self.revenue if self.revenue is not None else left
        return next_plan(self.policy, x, {n: v for n, v in c.items() if n not in skipped},
                         calls, revenue, left)

    # -- running -------------------------------------------------------------------------
    def run(self, batch: list, errors: list) -> list:
        """``(row, Generation)`` per record that ends with an answer, rows as
        ``[record, decision, cost]`` like the other route strategies; the rest go to
        ``errors``."""
        jobs = []
        vecs = self._embeddings(batch, errors)
        for r, vec in zip(batch, vecs, strict=True):
            if vec is False:
                continue
            try:
                for f in self.verifier.fields:  # unverifiable: refused before any spend
                    field_of(r, f, self.verifier.name)
                budget = self.budget_of(r)
                plan, x = self.plan(r, budget, vec)
            except Exception as e:  # noqa: BLE001 - this record only
                self._settle(r, "exhausted" if isinstance(e, BudgetExhausted) else "unsolved",
                             0.0, 0.0, [])
                errors.append((r, e))
                continue
            jobs.append(_Job(r, plan, budget, x))
        active: list[_Job] = jobs
        done: list = []
        learnt = self.seen()
        while active:
            groups: dict[str, list[_Job]] = {}
            for j in active:
                name = self._next(j)
                if name is None:
                    self._end(j, errors, done)
                else:
                    groups.setdefault(name, []).append(j)
            active = []
            for name, group in groups.items():
                active += self._step(name, group, errors, done)
        if self.learn and self.policy is not None and self.policy_file and \
                self.seen() != learnt:
            self.policy.save(self.policy_file)  # what it learnt survives the run
        return done

    def seen(self) -> int:
        return sum(self.policy.seen.values()) if self.policy is not None else 0

    def _embeddings(self, batch: list, errors: list) -> list:
        """Each record's prompt embedding (None: the policy reads none; False: the record
        failed, its error appended), in one embedder call for the batch."""
        if self.embedder is None:
            return [None] * len(batch)
        texts: list[str] = []
        out: list[Any] = []
        for r in batch:
            try:
                texts.append(self.targets[self.escalate[0]].text(r))
                out.append(None)
            except Exception as e:  # noqa: BLE001 - this record only
                errors.append((r, e))
                out.append(False)
        vecs = iter(self.embedder.embed(texts)) if texts else iter(())
        return [v if v is False else next(vecs) for v in out]

    def _next(self, j: _Job) -> str | None:
        """The next provider of ``j``'s plan whose worst case fits its budget left."""
        while j.plan:
            name = j.plan.pop(0)
            if j.budget is None or j.spent + self.bound(name, j.record) <= j.budget + 1e-12:
                return name
            j.skipped.append(name)
        return None

    def _step(self, name: str, group: list[_Job], errors: list, done: list) -> list[_Job]:
        rows = [[j.record, None, None] for j in group]
        by_row = {id(row): j for row, j in zip(rows, group, strict=True)}
        failed_before = len(errors)
        gens = self.targets[name].generate(rows, errors, live=False)
        for rec, _ in errors[failed_before:]:  # an engine error ends the record
            j = next((j for j in group if j.record is rec), None)
            if j is not None:
                self._settle(j.record, "unsolved", 0.0, j.spent, j.calls)
        if not gens:
            return []
        verdicts = _run(self._verify([(row[0], g) for row, g in gens]))
        price, again = self.prices[name], []
        for (row, g), v in zip(gens, verdicts, strict=True):
            j = by_row[id(row)]
            cost = price.cost(g.prompt_tokens, g.completion_tokens)
            j.spent += cost
            if isinstance(v, Exception):  # its check crashed: this record only, like an
                j.calls.append({"engine": name, "passed": False,  # engine error
                                "reason": f"verifier raised {type(v).__name__}",
                                "prompt_tokens": g.prompt_tokens,
                                "completion_tokens": g.completion_tokens, "cost": cost})
                self._settle(j.record, "unsolved", 0.0, j.spent, j.calls)
                errors.append((j.record, v))
                continue
            call = {"engine": name, "passed": v.ok, "reason": v.reason,
                    "prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
                    "cost": cost}
            conf = g.extra.get("mean_logprob")
            if conf is not None:
                call["confidence"] = round(float(conf), 4)
            j.calls.append(call)
            j.last = (g, v)
            if self.learn and self.policy is not None and j.x is not None:
                self.policy.update(name, with_history(j.x[0], j.calls[:-1]), v.ok,
                                   g.completion_tokens)
            if v.ok:
                self._finish(j, "solved", done)
                continue
            if cancelled(j.record):  # its caller gave up (or its attempt was abandoned):
                j.plan, j.cut = [], True  # not escalated, it ends as it stands
            elif self.order == "policy":  # plan again, knowing how this one failed
                left = None if j.budget is None else j.budget - j.spent
                j.plan = self.replan(j.x, j.calls, j.skipped, left)
            again.append(j)
        return again

    async def _verify(self, pairs: list) -> list:
        """A verdict per pair, or the exception its check raised (a crash ends that
        record only; the others' verdicts stand)."""
        got = await asyncio.gather(*(self.verifier(g.text, r) for r, g in pairs),
                                   return_exceptions=True)
        for v in got:
            if isinstance(v, BaseException) and not isinstance(v, Exception):
                raise v  # a cancellation or an interrupt is the run's, not a record's
        return list(got)

    def _decision(self, j: _Job, engine: str | None) -> dict[str, Any]:
        return {"engine": engine, "tried": j.calls, "spent": j.spent, "budget": j.budget,
                "escalated": len(j.calls) > 1,
                **({"skipped": j.skipped} if j.skipped else {})}

    def _finish(self, j: _Job, outcome: str, done: list) -> None:
        g, v = j.last  # type: ignore[misc]
        engine = j.calls[-1]["engine"]
        revenue = 0.0
        if outcome == "solved":
            revenue = self.revenue if self.revenue is not None else (j.budget or 0.0)
        self._settle(j.record, outcome, revenue, j.spent, j.calls)
        costs: dict[str, dict[str, float]] = {}
        for c in j.calls:
            e = costs.setdefault(c["engine"], {"prompt_tokens": 0, "completion_tokens": 0,
                                               "cost": 0.0})
            for k in ("prompt_tokens", "completion_tokens", "cost"):
                e[k] += c[k]
        decision = {**self._decision(j, engine), "verdict": {"ok": v.ok, "reason": v.reason}}
        s = stream_of(j.record, self.out)
        if s is not None and g.text:  # a verified (or kept) answer goes out whole
            s(g.text)
        done.append(([j.record, decision, costs], g))

    def _fail(self, j: _Job, errors: list, exc: Exception) -> None:
        exc.detail = {"route": self._decision(j, None)}  # type: ignore[attr-defined]
        errors.append((j.record, exc))

    def _end(self, j: _Job, errors: list, done: list) -> None:
        """``j`` has no provider left: it ends by its budget, or unsolved."""
        tried = ", ".join(f"{c['engine']} ({c['reason']})" for c in j.calls) or "nothing"
        if j.skipped and j.budget is not None and not j.cut:  # (a cancel, not the
            # budget, stopped a cut one: it ends unsolved)
            self._settle(j.record, "exhausted", 0.0, j.spent, j.calls)
            self._fail(j, errors, BudgetExhausted(
                f"budget exhausted: spent {j.spent:.6g} of {j.budget:.6g} on {tried}; the "
                f"next provider ({', '.join(j.skipped)}) could cost more than the "
                f"{j.budget - j.spent:.6g} left", j.spent))
        elif not j.calls:
            self._settle(j.record, "exhausted", 0.0, 0.0, [])
            within = f" within the budget of {j.budget:.6g}" if j.budget is not None else ""
            self._fail(j, errors, BudgetExhausted(
                f"declined: the policy expects no provider to pay{within} (nothing spent)"))
        elif self.on_fail == "keep":
            self._finish(j, "unsolved", done)
        else:
            self._settle(j.record, "unsolved", 0.0, j.spent, j.calls)
            rest = [n for n in self.escalate if n not in {c["engine"] for c in j.calls}]
            why = (f"; the policy expects no other provider ({', '.join(rest)}) to pay"
                   if rest and self.order == "policy" else "")
            self._fail(j, errors, VerificationFailed(
                f"no provider's answer passed: {tried}; spent {j.spent:.6g}{why}"))

    def _settle(self, record: Any, outcome: str, revenue: float, spent: float,
                calls: list) -> None:
        req = request_of(record)
        tenant = req.tenant if req is not None else None
        for led in self.ledgers:
            led.settle(tenant, outcome, revenue, spent, calls)
