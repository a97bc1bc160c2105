"""Model routing: ``route`` picks the engine of each request by rule, by a cascade, or
by budgeted, verified escalation (``escalate:``, in ``allocate.py``).

Rules, cascade, outputs and costs are in docs/stateful.md (``route``); escalation,
budgets, prices and policies in docs/routing.md. A cascade's
confidence is the mean token log-probability an engine reports in
``Generation.extra["mean_logprob"]`` (or a ``logprobs`` list); an engine that reports
none can only be the last level. Requests routed to the same engine within a
micro-batch share one batched call. As a served request's answering stage it takes the
request's options and conversation like ``generate`` and reports the tokens of every
engine it called (what streams: docs/serving.md, "Which stage answers").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any

from ..engines import GenerationRequest
from ..engines.models import batches_continuously
from ..engines.price import price_of
from ..errors import ContextOverflow, EngineError
from ..registry import Registry
from .allocate import LEDGERS as ALLOCATIONS
from .allocate import Allocator, Ledger
from .common import count_param, link_engine
from .llm import (
    FROZEN,
    MESSAGES,
    PROMPT_PARAMS,
    TEMPERATURE,
    answering,
    answers,
    cancel_of,
    cancelled,
    chat_messages,
    check_prompt_source,
    conversation,
    prompt_reads,
    prompt_text,
    report,
    request_options,
    stream_of,
    template_fields,
    with_urgency,
)
from .policy import Policy
from .registry import Answers, BuildContext, LinkContext, OpDef, OpRuntime, Param, register

_LOGPROBS = "logprobs" in {f.name for f in fields(GenerationRequest)}
_OPTION_KEYS = {"prompt", "system", "stop", "max_tokens"}


def confidence(extra: dict) -> float | None:
    """The mean token log-probability an engine reported in ``Generation.extra``, or None.

    >>> confidence({"mean_logprob": -0.5}), confidence({"logprobs": [-1.0, 0.0]})
    (-0.5, -0.5)
    """
    if extra.get("mean_logprob") is not None:
        return float(extra["mean_logprob"])
    lps = extra.get("logprobs")
    if isinstance(lps, (list, tuple)) and lps:
        return sum(float(x) for x in lps) / len(lps)
    return None


@dataclass(frozen=True)
class RouteStats:
    """Requests and tokens per engine of one route stage (all runs in the process)."""

    label: str  # the stage's label (its ``label`` param, else its output field)
    requests: int  # records answered
    escalated: int  # records a cascade sent past its first engine
    engines: dict[str, dict[str, int]]  # engine -> {requests, prompt_tokens, completion_tokens}


class _Ledger:
    def __init__(self, label: str) -> None:
        self.label, self.lock = label, threading.Lock()
        self.requests = self.escalated = 0
        self.engines: dict[str, dict[str, int]] = {}

    def add(self, costs: list[dict], escalated: int) -> None:
        with self.lock:
            self.requests += len(costs)
            self.escalated += escalated
            for cost in costs:
                for name, c in cost.items():
                    e = self.engines.setdefault(name, {"requests": 0, "prompt_tokens": 0,
                                                       "completion_tokens": 0})
                    e["requests"] += 1
                    e["prompt_tokens"] += c["prompt_tokens"]
                    e["completion_tokens"] += c["completion_tokens"]

    def statistics(self) -> RouteStats:
        with self.lock:
            return RouteStats(self.label, self.requests, self.escalated,
                              {k: dict(v) for k, v in self.engines.items()})


_LEDGERS: Registry[_Ledger] = Registry("route ledgers")


def route_statistics() -> dict[str, RouteStats]:
    """Cost accounting of every route stage run in this process, by label."""
    return {str(k): v.statistics() for k, v in _LEDGERS.items()}


def _matches(when: dict, record: Any, count: Any) -> bool:
    if "field" in when:
        v = record.get(when["field"]) if isinstance(record, dict) else None
        if "equals" in when and v != when["equals"]:
            return False
        if "in" in when and v not in when["in"]:
            return False
        if "exists" in when and (v is not None) != bool(when["exists"]):
            return False
    return "prompt_tokens_over" not in when or count() > when["prompt_tokens_over"]


class _Target:
    """One engine with the stage's request settings (and its per-engine overrides)."""

    def __init__(self, name: str, engine: Any, params: dict) -> None:
        opts = {**params, **(params.get("per_engine") or {}).get(name, {})}
        self.name, self.engine = name, engine
        self.template, self.inp = opts.get("prompt"), opts.get("input")
        self.system, self.stop = opts.get("system"), tuple(opts.get("stop") or ())
        self.max_tokens, self.temperature = opts["max_tokens"], float(opts["temperature"])
        self.out, self.conv_field = params["output"], params.get("messages")
        self.frozen = frozenset(params.get("frozen") or ())
        if self.conv_field not in (None, False) and not getattr(self.engine, "chat", True):
            raise ValueError(f"route: 'messages: {self.conv_field}' needs chat models; engine "
                             f"'{name}' takes a raw prompt (drop 'messages')")

    def text(self, r: Any) -> str:
        return prompt_text(self.template, self.inp, r)

    def request(self, r: Any) -> GenerationRequest:
        text, eng = self.text(r), self.engine
        base = {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "stop": self.stop}
        kw: dict[str, Any] = {**with_urgency(request_options(base, answering(r, self.out),
                                                             self.frozen), r),
                              **({"logprobs": True} if _LOGPROBS else {})}
        limit = eng.context_length - self.max_tokens
        conv = conversation(r, self.conv_field, self.out, getattr(self.engine, "chat", True))
        if conv is not None:
            return GenerationRequest(messages=chat_messages(self.system, conv, text,
                                                            eng.count_tokens, limit), **kw)
        n = eng.count_tokens(text)
        if n > limit:
            raise ContextOverflow(f"engine '{self.name}': prompt has {n} tokens; with "
                                  f"max_tokens={self.max_tokens} it exceeds the model context "
                                  f"of {eng.context_length} tokens")
        if getattr(eng, "chat", True):
            msgs = ({"role": "system", "content": self.system},) if self.system else ()
            return GenerationRequest(messages=msgs + ({"role": "user", "content": text},), **kw)
        return GenerationRequest(prompt=(self.system + "\n\n" if self.system else "") + text, **kw)

    def _call(self, rows: list, reqs: list, live: bool, sent: set[int]) -> list:
        """The engine's generations of ``reqs``; each row's cancel stops its
        sequence, and with ``live`` its tokens go to its request's sink as they come (the
        ``id`` of a row that streamed a piece is added to ``sent``)."""
        streams = [stream_of(row[0], self.out) if live else None for row in rows]
        cancels = [cancel_of(row[0]) for row in rows]
        if not any(callable(s) for s in streams) and all(c is None for c in cancels):
            return self.engine.generate(reqs)

        def on_token(i: int, piece: str) -> bool:
            s, c = streams[i], cancels[i]
            if callable(s):
                sent.add(id(rows[i]))
                s(piece)
            return c is None or not c.is_set()  # False: the engine stops this one

        return self.engine.generate(reqs, on_token)

    def generate(self, rows: list, errors: list, live: bool) -> list:
        """``(row, Generation)`` for each row ``[record, decision, cost]`` that worked;
        ``live``: stream the tokens (see ``_call``)."""
        keep, reqs = [], []
        for row in rows:
            try:
                reqs.append(self.request(row[0]))
                keep.append(row)
            except Exception as e:  # noqa: BLE001 - this record only
                errors.append((row[0], e))
        if not keep:
            return []
        sent: set[int] = set()
        try:
            gens = self._call(keep, reqs, live, sent)
        except EngineError as failure:  # isolate the request that failed
            done = []
            for row, q in zip(keep, reqs, strict=True):
                if id(row) in sent:  # its pieces are out: a second answer cannot follow
                    errors.append((row[0], failure))
                    continue
                try:
                    done.append((row, self._call([row], [q], live, sent)[0]))
                except EngineError as e:
                    errors.append((row[0], e))
            return done
        return list(zip(keep, gens, strict=True))


def _ceiling(params: dict) -> int:
    """The most tokens one engine's answer may have: the largest ``max_tokens`` of the
    stage and its ``per_engine`` settings."""
    return max([int(params.get("max_tokens") or 0)] + [
        int(o["max_tokens"]) for o in (params.get("per_engine") or {}).values()
        if isinstance(o, dict) and o.get("max_tokens")])


def _counting_engine(params: dict) -> Any:
    """The engine whose tokenizer counts an answer: the default, or the cascade's (or
    escalation's) last."""
    name = params.get("default") or (params.get("cascade") or params.get("escalate")
                                     or [""])[-1]
    return (params.get("_engines") or {}).get(name)


def _build_route(params: dict, ctx: BuildContext) -> OpRuntime:
    specs = params["_engines"]
    targets = {n: _Target(n, ctx.open_engine(s), params) for n, s in specs.items()}
    rules: list[dict] = params.get("rules") or []
    default: str = params.get("default") or ""
    cascade: list[str] = params.get("cascade") or []
    thresholds = params["threshold"]
    if not isinstance(thresholds, list):
        thresholds = [thresholds] * max(0, len(cascade) - 1)
    out, cost_f, route_f = params["output"], params["cost"], params["route"]
    label = params.get("label") or out
    ledger = _LEDGERS.get(label, lambda: _Ledger(label))
    run_ledger = _Ledger(label)  # this run's (this replica's) share, for the run's stats

    def spend(row: list, name: str, g: Any) -> None:
        c = row[2].setdefault(name, {"prompt_tokens": 0, "completion_tokens": 0})
        c["prompt_tokens"] += g.prompt_tokens
        c["completion_tokens"] += g.completion_tokens

    def by_rules(batch: list, errors: list) -> list:
        groups: dict[str, list] = {}
        for r in batch:
            count = lambda r=r: targets[default].engine.count_tokens(targets[default].text(r))
            try:
                name = next((x["engine"] for x in rules if _matches(x["when"], r, count)), default)
            except Exception as e:  # noqa: BLE001 - e.g. the prompt cannot be rendered
                errors.append((r, e))
                continue
            groups.setdefault(name, []).append([r, {"engine": name}, {}])
        done = []
        for name, rows in groups.items():
            for row, g in targets[name].generate(rows, errors, live=True):
                spend(row, name, g)
                done.append((row, g))
        return done

    def by_cascade(batch: list, errors: list) -> list:
        """Only the last level streams as it generates (its answer is final); an answer
        an earlier level keeps goes to the request's sink whole, once its confidence is known.
        A cancelled request is not escalated."""
        rows = [[r, {"engine": None, "confidence": [], "escalated": False}, {}] for r in batch]
        done = []
        for level, name in enumerate(cascade):
            last = level == len(cascade) - 1
            nxt = []
            for row, g in targets[name].generate(rows, errors, live=last):
                spend(row, name, g)
                row[1]["engine"], row[1]["escalated"] = name, level > 0
                conf = confidence(g.extra)
                row[1]["confidence"].append(None if conf is None else round(conf, 4))
                if last or cancelled(row[0]) or (conf is not None
                                                  and conf >= thresholds[level]):
                    done.append((row, g))
                    s = None if last else stream_of(row[0], out)
                    if s is not None and g.text:
                        s(g.text)
                elif conf is None:
                    errors.append((row[0], EngineError(
                        f"cascade level {level + 1}: engine '{name}' reports no token "
                        "log-probabilities (Generation.extra['mean_logprob']), so its "
                        "confidence is unknown; use an engine that reports them, or rules")))
                else:
                    nxt.append(row)
            rows = nxt
        return done

    decide = by_cascade if cascade else by_rules
    if params.get("escalate"):
        decide = _allocator(params, targets, label, ctx).run

    def result(row: list, g: Any) -> dict:
        r = {**row[0], out: g.text, route_f: row[1], cost_f: row[2]}
        if answers(r, out):  # it answers a served request
            spent = [c["cost"] for c in row[2].values() if "cost" in c]
            report(r, out, g.finish_reason, {k: sum(c[k] for c in row[2].values())
                                             for k in ("prompt_tokens", "completion_tokens")},
                   sum(spent) if spent else None)
        return r

    def batch_fn(batch: list, errors: list) -> list:
        done = decide(batch, errors)
        costs = [row[2] for row, _ in done]
        escalated = sum(row[1].get("escalated", False) for row, _ in done)
        ledger.add(costs, escalated)
        run_ledger.add(costs, escalated)
        return [result(row, g) for row, g in done]

    def counters() -> dict[str, float]:
        st = run_ledger.statistics()
        out: dict[str, float] = {"requests": st.requests, "escalated": st.escalated}
        for name, e in st.engines.items():
            out[f"{name}.requests"] = e["requests"]
            out[f"{name}.tokens"] = e["prompt_tokens"] + e["completion_tokens"]
        if allocated is not None:  # escalate: the ledger
            acc = allocated.statistics()
            out.update({k: acc[k] for k in ("requests", "solved", "exhausted", "unsolved",
                                            "revenue", "spend", "margin")})
            for name, e in acc["engines"].items():
                out[f"{name}.spend"] = e["spend"]
        return out

    allocated = getattr(decide, "__self__", None)
    allocated = allocated.ledgers[1] if isinstance(allocated, Allocator) else None
    return OpRuntime("map", batch_fn=batch_fn, counters=counters)


def _allocator(params: dict, targets: dict[str, _Target], label: str,
               ctx: BuildContext) -> Allocator:
    """The ``escalate:`` strategy of one replica (``allocate.Allocator``)."""
    from ..verify import make_verifier

    budget = params.get("budget")
    policy = Policy.load(params["policy"]) if params.get("policy") else None
    names = list(params["escalate"])
    embedder = ctx.open_engine(params["_embedder"]) if params.get("_embedder") else None
    return Allocator(
        targets, names, {n: price_of(params["_engines"][n]) for n in names},
        make_verifier(params["verify"], "route: verify"), order=params["order"],
        budget=None if budget in (None, "required") else float(budget),
        required=budget == "required", budget_field=params.get("budget_field"),
        revenue=params.get("revenue"), policy=policy, learn=bool(params["learn"]),
        on_fail=params["on_fail"], out=params["output"],
        ledger=ALLOCATIONS.get(label, lambda: Ledger(label)), run_ledger=Ledger(label),
        policy_file=params.get("policy"), embedder=embedder)


def _prepare_route(params: dict, ctx: LinkContext) -> dict:
    check_prompt_source(params, "route")
    rules, cascade, escalate = params.get("rules"), params.get("cascade"), params.get("escalate")
    if sum(x is not None for x in (rules, cascade, escalate)) != 1:
        raise ValueError("route needs exactly one of 'rules' (with 'default'), 'cascade' "
                         "(engines from small to large) or 'escalate' (with 'verify')")
    _check_escalation(params)
    if escalate is not None:
        names = list(escalate)
    elif rules is not None:
        if not params.get("default"):
            raise ValueError("'rules' needs 'default': the engine when no rule matches")
        names = [params["default"]]
        for i, rule in enumerate(rules):
            if not isinstance(rule, dict) or set(rule) != {"when", "engine"} or \
                    not isinstance(rule["when"], dict):
                raise ValueError(f"rules[{i}] must be {{when: {{...}}, engine: NAME}}, got "
                                 f"{rule!r}")
            when = rule["when"]
            bad = set(when) - {"field", "equals", "in", "exists", "prompt_tokens_over"}
            if bad or not when or (set(when) & {"equals", "in", "exists"}) and "field" not in when:
                raise ValueError(f"rules[{i}].when: use field + equals/in/exists, or "
                                 f"prompt_tokens_over: N (got {when!r})")
            if "in" in when and not isinstance(when["in"], list):
                raise ValueError(f"rules[{i}].when.in must be a list of values")
            names.append(rule["engine"])
    else:
        if not isinstance(cascade, list) or len(cascade) < 2 or \
                not all(isinstance(n, str) for n in cascade):
            raise ValueError("'cascade' must list at least two engine names, small to large")
        names = list(cascade)
        t = params["threshold"]
        if isinstance(t, list) and len(t) != len(cascade) - 1:
            raise ValueError(f"'threshold' needs one value per escalation ({len(cascade) - 1}),"
                             f" got {len(t)}")
    per = params.get("per_engine") or {}
    for name, opts in per.items():
        if name not in names or not isinstance(opts, dict) or set(opts) - _OPTION_KEYS:
            raise ValueError(f"per_engine.{name}: must name a routed engine ({', '.join(names)})"
                             f" and set only {', '.join(sorted(_OPTION_KEYS))}")
        if "prompt" in opts:
            template_fields(opts["prompt"])
    params["_engines"] = {name: link_engine({"engine": name}, ctx, "generate")["_engine"]
                          for name in dict.fromkeys(names)}
    if escalate is not None:
        unpriced = [n for n in names if price_of(params["_engines"][n]) is None]
        if unpriced and (params.get("budget") is not None or params["order"] != "listed"):
            raise ValueError(f"engine '{unpriced[0]}' has no price, so a budget or order: "
                             f"{params['order']} cannot count its calls; give it price: "
                             "{prompt_per_1k: N, completion_per_1k: N}")
        if params.get("policy"):
            pol = Policy.load(params["policy"])
            missing = [n for n in names if n not in pol.engines]
            if missing:
                raise ValueError(f"policy {params['policy']} knows {', '.join(pol.engines)}; "
                                 f"it has no model of {', '.join(missing)} (fit it on a trace "
                                 "that tried them)")
            emb = params.get("embedder")
            if (emb is None) != (pol.embedder is None):
                raise ValueError(f"policy {params['policy']} was fit with embedder "
                                 f"'{pol.embedder}': name an engine of that model in "
                                 "'embedder'" if pol.embedder else
                                 f"policy {params['policy']} was fit without embeddings; "
                                 "drop 'embedder'")
            if emb is not None:
                params["_embedder"] = link_engine({"engine": emb}, ctx, "embed")["_engine"]
                if params["_embedder"].get("model") != pol.embedder:
                    raise ValueError(f"embedder '{emb}' is model "
                                     f"'{params['_embedder'].get('model')}', but policy "
                                     f"{params['policy']} was fit on '{pol.embedder}'")
        elif params.get("embedder") is not None:
            raise ValueError("'embedder' feeds a policy's features: use it with order: "
                             "policy")
    return params


_ESCALATE_ONLY = ("verify", "budget", "budget_field", "revenue", "policy")


def _check_escalation(params: dict) -> None:
    """ValueError for an ``escalate:`` setting that is wrong, or set without it."""
    escalate = params.get("escalate")
    if escalate is None:
        stray = [k for k in _ESCALATE_ONLY if params.get(k) is not None]
        if stray or params["order"] != "listed" or params["learn"]:
            raise ValueError(f"{', '.join(stray) or 'order/learn'} only apply to 'escalate' "
                             "(budgeted, verified allocation)")
        return
    if not isinstance(escalate, list) or not escalate or \
            not all(isinstance(n, str) for n in escalate) or len(set(escalate)) < len(escalate):
        raise ValueError("'escalate' must list engine names (each once), e.g. [small, large]")
    if params.get("verify") is None:
        raise ValueError("'escalate' needs 'verify': the check an answer must pass, e.g. "
                         "verify: {unit_tests: {}} (docs/pipeline-yaml.md, verify)")
    from ..verify import make_verifier

    try:
        make_verifier(params["verify"], "route: verify")
    except Exception as e:  # noqa: BLE001 - reported as this stage's error
        raise ValueError(str(e)) from None
    b = params.get("budget")
    if b is not None and b != "required" and (type(b) not in (int, float) or not b > 0):
        raise ValueError(f"'budget' must be a positive number or 'required' (each request "
                         f"brings one), got {b!r}")
    r = params.get("revenue")
    if r is not None and (type(r) not in (int, float) or r < 0):
        raise ValueError(f"'revenue' must be a number >= 0 (what a solved request pays), "
                         f"got {r!r}")
    if params["order"] == "policy" and not params.get("policy"):
        raise ValueError("order: policy needs 'policy': a file from tailrace route fit")
    if params.get("policy") and params["order"] != "policy":
        raise ValueError("'policy' is used with order: policy")
    if params["learn"] and params["order"] != "policy":
        raise ValueError("learn: true updates a policy: set order: policy")


register(OpDef(
    "route", "map", _build_route,
    (Param("rules", (list,), want="a list of {when: {...}, engine: NAME}"),
     Param("default", (str,), want="the engine when no rule matches"),
     Param("cascade", (list,), want="engine names from small to large"),
     Param("threshold", (int, float, list), default=-1.0,
           want="a mean token log-probability (or one per escalation)"),
     Param("per_engine", (dict,), want="engine -> {prompt, system, stop, max_tokens}"),
     Param("escalate", (list,), want="engine names to try, each answer verified"),
     Param("verify", (dict,), want="a verifier, e.g. {unit_tests: {}} (see verify)"),
     Param("order", (str,), default="listed", want="listed, price or policy",
           check=lambda v: v in ("listed", "price", "policy")),
     Param("budget", (int, float, str), want="a positive number, or 'required'"),
     Param("budget_field", (str,), want="a field holding a record's budget"),
     Param("revenue", (int, float), want="what a solved request pays (default: its budget)"),
     Param("policy", (str,), want="a policy file (tailrace route fit)"),
     Param("embedder", (str,), want="an embedding engine whose vectors the policy reads"),
     Param("learn", (bool,), default=False, want="true or false"),
     Param("on_fail", (str,), default="error", want="error or keep",
           check=lambda v: v in ("error", "keep")),
     *PROMPT_PARAMS,
     Param("system", (str,), want="a system message (chat models)"),
     MESSAGES,
     Param("output", (str,), default="answer", want="a field name"),
     Param("route", (str,), default="route", want="a field for the routing decision"),
     Param("cost", (str,), default="cost", want="a field for tokens per engine"),
     Param("label", (str,), want="the name of this stage's cost totals"),
     count_param("max_tokens", 64),
     TEMPERATURE,
     Param("stop", (list,), want="a list of stop strings"),
     FROZEN,
     count_param("max_batch", 8)),
    batchable=True, blocking=True, fusable=False,
    engine_batches=lambda p: all(batches_continuously(e, "generate")
                                 for e in p["_engines"].values()),
    fields=lambda p: (prompt_reads(p), (p["output"], p["route"], p["cost"])),
    prepare=_prepare_route,
    doc="choose an engine per request by rule, cascade or budgeted verified escalation",
    answers=Answers(output_tokens=lambda p: _ceiling(p) * max(
                        1, len(p.get("cascade") or p.get("escalate") or ())),
                    max_tokens=_ceiling, engine=_counting_engine,
                    # a cascade level's kept answer goes whole: one piece more
                    pieces=lambda p: 1 + _ceiling(p),
                    budgets=lambda p: None if not p.get("escalate") else
                    "required" if p.get("budget") == "required" else "optional",
                    tools=lambda p: "a route stage does not pass client tools to its "
                    "engines (answer with a generate stage)")))
