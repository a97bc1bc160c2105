"""Binding a compiled pipeline to the OpenAI API: the part of serving that reads a plan
(its operators and their params), so ``openai_wire.py`` knows only the wire format.

The request's text fills the first of the source's declared ``fields:`` (else the first
field the first stage reads); the answer is the answering stage's ``output`` field; the
rules are in docs/serving.md ("Which stage answers"). Token budgets come from what each
operator declares (``OpDef.answers``): nothing here knows an operator by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..compiler import Plan
from ..engines.structured import check_enforceable
from ..errors import EngineError, TailraceError
from ..request import Reply
from .embeddings import embed_spec
from .errors import ServiceError
from .openai_wire import OPTION_FIELDS, WireError, WireRequest


def answering_ops(plan: Plan) -> list:
    """The plan's operators that can answer an OpenAI request (they generate its text:
    their ``OpDef.answers`` says what serving needs of them)."""
    return [o for s in plan.stages for o in s.ops if o.op.answers is not None]


def output_tokens(plan: Plan) -> int:
    """Most tokens the plan's model stages generate for one record, one attempt each
    (``Answers.output_tokens``); tenants' reservations and the admission cost model
    use it."""
    return sum(o.op.answers.output_tokens(o.params) for o in answering_ops(plan))


def admission_setup(policy: str, plans: list[Plan],
                    max_in_flight: int) -> tuple[dict[str, Any], dict[str, int]]:
    """The options of an admission ``policy`` for ``plans`` (their ``slo:``; a limit of
    ``max_in_flight`` for the policies that take one) and each pipeline's predicted
    output tokens (the gate's ``max_tokens``); ``tailrace serve``, ``run`` and
    ``simulate`` build their policies from it. TailraceError for a bad ``slo:``."""
    from ..control import PipelineSLO

    slos: dict[str, Any] = {}
    max_tokens: dict[str, int] = {}
    for plan in plans:
        p = plan.pipeline
        if p.slo:
            try:
                slos[p.name] = PipelineSLO.from_config(p.name, p.slo)
            except ValueError as e:
                raise TailraceError(f"{p.source_file}: {e}") from None
        max_tokens[p.name] = output_tokens(plan) or 64
    options: dict[str, Any] = {"slos": slos} if slos else {}
    if policy != "simultaneous":
        options["max_in_flight"] = max_in_flight
    return options, max_tokens


@dataclass(frozen=True)
class Binding:
    """Which record fields an OpenAI request maps to for one pipeline: the field that
    receives its text (``input_field``) and, of the answering stage (``stage``, whose
    operator is ``kind``; None: none), its output, ``usage``, ``max_tokens`` (route: the
    largest), engine spec (for counting tokens), the options its ``frozen:`` keeps from
    requests, the ``response_format`` types it enforces and whether it spends a request's
    budget (``Answers.budgets``). ``problem``: why the pipeline cannot answer
    chat/completion requests, or None."""

    input_field: str | None
    answer_field: str | None
    usage_field: str | None
    max_tokens: int
    engine: Any
    problem: str | None
    frozen: frozenset[str] = frozenset()
    stage: str | None = None
    kind: str | None = None
    response_formats: frozenset[str] = frozenset()
    budget: str | None = None
    no_tools: str | None = "it has no answering stage"  # why client tools are refused
    converses: bool = True  # a chat's system messages and earlier turns reach its model


def _downstream(ops: list) -> dict[str, set[str]]:
    """Each op id -> the ids of every op after it (through any branch port)."""
    after: dict[str, set[str]] = {o.id: set() for o in ops}
    for o in ops:
        for ref in o.spec.upstream:
            after.setdefault(ref.split(".")[0], set()).add(o.id)
    reach: dict[str, set[str]] = {}

    def walk(i: str) -> set[str]:
        if i not in reach:
            reach[i] = set()
            for d in after.get(i, ()):
                reach[i] |= {d} | walk(d)
        return reach[i]

    for o in ops:
        walk(o.id)
    return reach


def answering_stage(plan: Plan) -> tuple[Any, str | None]:
    """The op that answers OpenAI requests, or ``(None, why not)``: of the answering
    ops that reach the sink, the one no other is downstream of. Two on parallel
    branches, or an earlier one writing the same output field, make it ambiguous."""
    ops = [o for s in plan.stages for o in s.ops]
    reach = _downstream(ops)
    sinks = {o.id for o in ops if o.op.kind == "sink"}
    cands = [o for o in ops if o.op.answers is not None
             and (not sinks or reach[o.id] & sinks)]
    if not cands:
        return None, (f"pipeline '{plan.name}' has no generate, route or tool_call stage to "
                      f"answer with; send records to POST /v1/pipelines/{plan.name}/runs "
                      "instead")
    last = [o for o in cands if not any(c.id in reach[o.id] for c in cands)]
    if len(last) > 1:
        names = ", ".join(f"'{o.id}' ({o.op.name})" for o in last)
        return None, (f"pipeline '{plan.name}': stages {names} are on parallel branches, so "
                      "which one answers is ambiguous; join them into one stage that answers "
                      "(e.g. a generate after the merge)")
    ans = last[0]
    same = [o.id for o in cands if o is not ans and o.params.get("output")
            == ans.params["output"]]
    if same:
        return None, (f"pipeline '{plan.name}': stages '{same[0]}' and '{ans.id}' both write "
                      f"field '{ans.params['output']}', so the request's options would reach "
                      f"both; give the answering stage '{ans.id}' its own output field")
    return ans, None


def bind(plan: Plan) -> Binding:
    """Work out a pipeline's ``Binding`` from its compiled plan."""
    ops = [o for s in plan.stages for o in s.ops]
    source = next(o for o in ops if o.op.kind == "source")
    if source.params.get("fields"):
        field = source.params["fields"][0]
    else:
        first = next((o for o in ops if source.id in o.spec.upstream), None)
        reads = first.op.fields(first.params)[0] if first is not None else None
        field = reads[0] if reads else None
    gen, problem = answering_stage(plan)
    if field is None:
        problem = (f"pipeline '{plan.name}' has no text input field: declare it, like "
                   "source: {fields: [question]}")
    if gen is None:
        return Binding(field, None, None, 0, None, problem)
    p, ans = gen.params, gen.op.answers
    return Binding(field, p["output"], ans.usage_field(p), ans.max_tokens(p), ans.engine(p),
                   problem, frozenset(p.get("frozen") or ()), gen.id, gen.op.name,
                   ans.enforces(p), ans.budgets(p), ans.tools(p), ans.converses(p))


def check_conversation(b: Binding, req: WireRequest, name: str) -> None:
    """400 when the request offers client tools, or carries tool calls and results, that
    the answering stage cannot take (``Binding.no_tools``), or carries system messages or
    earlier turns that its YAML keeps from the model (``messages: false``): never cut
    silently."""
    msgs = req.messages or ()
    tooled = next((i for i, m in enumerate(msgs) if m["role"] == "tool" or m.get("tool_calls")),
                  None)
    if b.no_tools is not None and (req.tools is not None or tooled is not None):
        what = "'tools'" if req.tools is not None else f"messages[{tooled}] (a tool call or result)"
        raise WireError(f"{what}: pipeline '{name}' cannot answer client tools: its answering "
                        f"stage '{b.stage}' ({b.kind}): {b.no_tools}", code="unsupported_tools")
    if not b.converses and len(msgs) > 1:
        raise WireError(f"pipeline '{name}' answers the last user message alone (its answering "
                        f"stage '{b.stage}' says 'messages: false'), so this request's system "
                        "messages and earlier turns would not reach the model; send only the "
                        f"last user message, or remove 'messages: false' from stage '{b.stage}'",
                        code="conversation_not_accepted")


def request_options(b: Binding, req: WireRequest, name: str) -> dict[str, Any]:
    """A request's sampling options for the answering stage (``Request.options``); 400
    naming an option the pipeline froze, or a ``response_format`` (or schema) its
    engine cannot enforce. ``name``: the pipeline's, for the message."""
    for k in req.options:
        if k in b.frozen:
            asked = "max_tokens/max_completion_tokens" if k == "max_tokens" else k
            raise WireError(f"'{asked}' is fixed by pipeline '{name}' (its answering stage "
                            f"'{b.stage}' lists it under frozen:); leave it out of the request",
                            code="frozen_parameter")
    fmt = req.options.get("response_format")
    if fmt is not None and fmt["type"] not in b.response_formats:
        raise WireError(f"'response_format' ({fmt['type']}) cannot be enforced by pipeline "
                        f"'{name}': its answering stage '{b.stage}' ({b.kind}) has no JSON "
                        "constraint (generate stages on llama_cpp and openai engines do)",
                        code="unsupported_response_format")
    if fmt is not None:
        try:
            check_enforceable(b.engine, fmt)
        except EngineError as e:  # e.g. a schema llama.cpp cannot turn into a grammar
            raise WireError(str(e), code="unsupported_schema") from None
    return dict(req.options)


def _count(engine: Any, text: str) -> int:
    from ..engines import open_engine
    from ..engines.tokens import approx_tokens

    try:
        eng = open_engine(engine)
        return max(0, eng.count_tokens(text) - eng.count_tokens(""))
    except Exception:  # noqa: BLE001 - no tokenizer at hand: the shared estimate
        return approx_tokens(text) if text else 0


def usage_of(b: Binding, record: dict, reply: Reply, text: str,
             answer: str) -> dict[str, Any]:
    """Prompt/completion/total tokens of one answer: what the answering stage reported
    (``reply``), else its ``usage:`` field in ``record``, else the engine's tokenizer
    counts of ``text`` (the input) and ``answer``; with ``cost`` when it was priced."""
    u = reply.usage
    if not isinstance(u, dict):
        u = record.get(b.usage_field) if b.usage_field else None
    if isinstance(u, dict) and isinstance(u.get("prompt_tokens"), int) \
            and isinstance(u.get("completion_tokens"), int):
        p, c = u["prompt_tokens"], u["completion_tokens"]
    else:
        p, c = _count(b.engine, text), _count(b.engine, answer)
    usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    cached = u.get("cached_tokens") if isinstance(u, dict) else None
    if isinstance(cached, int) and cached > 0:  # OpenAI's field for prompt-cache hits
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    by = u.get("by_model") if isinstance(u, dict) else None
    if isinstance(by, dict):  # a collaborative engine: completion tokens per model
        usage["completion_tokens_details"] = {"by_model": dict(by)}
    if reply.cost is not None:  # priced engines: what the answer cost (docs/routing.md)
        usage["cost"] = reply.cost
    return usage


def finish_reason(b: Binding, usage: dict[str, Any], reply: Reply) -> str:
    """The finish reason the answering stage reported (``Reply.finish``); without one,
    ``"length"`` when the answer used all of ``max_tokens``, else ``"stop"``."""
    if isinstance(reply.finish, str):
        return reply.finish
    return "length" if b.max_tokens and usage["completion_tokens"] >= b.max_tokens \
        else "stop"


def answer_of(b: Binding, out: dict) -> str:
    """The answer text in an output record; a ``ServiceError`` when a later stage
    dropped or replaced it."""
    answer = out.get(b.answer_field) if b.answer_field else None
    if not isinstance(answer, str):
        raise ServiceError(f"the output record has no text field '{b.answer_field}' (a later "
                           "stage dropped or replaced it)", code="no_answer")
    return answer


def piece_budget(plan: Plan) -> int:
    """Most text pieces one request may stream: twice what the answering stages stream
    per attempt (``Answers.stream_pieces``) times ``1 + retries`` attempts, since an
    engine sends a piece per token (the slack covers servers that split a token)."""
    tokens = sum(o.op.answers.stream_pieces(o.params) * (1 + o.contract.retries)
                 for o in answering_ops(plan))
    return 2 * tokens + 16


def accepts(plan: Plan, b: Binding) -> dict[str, Any]:
    """The ``metadata`` ``GET /v1/models`` lists for a pipeline (docs/serving.md,
    under "Embeddings")."""
    endpoints = ["chat.completions", "completions", "responses"] if b.problem is None else []
    if embed_spec(plan) is not None:
        endpoints.append("embeddings")
    endpoints.append("pipelines.runs")
    out: dict[str, Any] = {"endpoints": endpoints, "input_field": b.input_field}
    if b.problem is not None:
        out["not_chat"] = b.problem  # why chat.completions and completions are refused
    elif b.stage is not None:
        out["answering_stage"] = {"id": b.stage, "kind": b.kind}
    gens = {o.id: int(o.params["max_tokens"]) for s in plan.stages for o in s.ops
            if o.op.name == "generate" and o.params.get("max_tokens")}
    if b.answer_field is not None and b.max_tokens:
        out["max_tokens"] = b.max_tokens
    if b.problem is None:
        out["options"] = [k for k in OPTION_FIELDS if k not in b.frozen]
        out["frozen"] = sorted(b.frozen)
        out["tools"] = b.no_tools is None
        out["conversation"] = b.converses
    if gens:
        out["generate_max_tokens"] = gens
    return out
