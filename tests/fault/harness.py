"""The fault suite's model: scenarios, records with lineage, fault-injecting operators.

A ``Scenario`` is plain data (Hypothesis prints it when an example fails, and a
regression test pastes it back): how many input records, a seed, the stages, and which
faults hit where. ``build`` turns it into a ``tr.Pipeline`` whose operator functions
inject those faults. Every decision — which record fails, how many children a
``flat_map`` emits, which way a ``branch`` sends a record — is a hash of the seed, the
stage and the record's lineage, so an example replays exactly wherever it runs (the
Ray runtime runs the functions in other processes).

Records are dicts: ``lid`` (input index), ``path`` (``(lid,)`` plus one ordinal per
``flat_map`` passed), ``grp`` (a key for ``stateful``) and ``hops``. A ``batch`` stage
emits ``{"items": [records]}``; a ``flat_map`` of a batch emits its members again.
Operators keep every other field (``{**x, ...}``), so the serving runtime's ``_rid``
and friends ride along.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import re
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import tailrace as tr
from tailrace.request import request_of


def h(*parts: Any) -> int:
    """A stable hash (Python's ``hash`` of strings differs between processes)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


class InjectedFault(Exception):
    """The exception the suite's operators raise on purpose."""


# -- records and lineage ------------------------------------------------------------------
def inputs(n: int) -> list[dict]:
    return [{"lid": i, "path": (i,), "grp": i % 3, "hops": 0} for i in range(n)]


def is_batch(x: Any) -> bool:
    return isinstance(x, dict) and "items" in x


def lineages(x: Any) -> list[tuple]:
    """The lineage paths a record carries (a batch: its members'); ValueError if none."""
    if is_batch(x):
        return [p for r in x["items"] for p in lineages(r)]
    if isinstance(x, dict) and "path" in x:
        return [tuple(x["path"])]
    raise ValueError(f"record without lineage: {x!r:.200}")


def key_of(x: Any) -> tuple:
    """What decisions about a record (or a batch-contract call's list) depend on."""
    if isinstance(x, list):
        return ("L",) + tuple(key_of(r) for r in x)
    if is_batch(x):
        return ("B",) + tuple(sorted(lineages(x)))
    return tuple(x["path"])


def fanout(seed: int, path: tuple) -> int:
    """How many children a ``flat_map`` emits for a (non-batch) record."""
    return (0, 1, 1, 2)[h(seed, "fan", path) % 4]


def keeps(seed: int, stage: str, path: tuple) -> bool:
    """A ``filter``'s verdict on a (non-batch) record: about one in four is dropped."""
    return h(seed, "keep", stage, path) % 4 != 0


def verified(seed: int, stage: str, key: tuple) -> bool:
    """A ``verify`` stage's verdict on a record: about one in four fails."""
    return h(seed, "verified", stage, key) % 4 != 0


def on_fail(seed: int, stage: str) -> str:
    """What a ``verify`` stage does with a failing record: ``keep`` it (with its verdict)
    or end it as an error record (``error``), half the stages each."""
    return ("keep", "error")[h(seed, "on_fail", stage) % 2]


# -- budgeted routes (``escalate``) -----------------------------------------------------------
#: the scripted providers: price per 1,000 tokens (prompt and completion alike). Each call
#: is bounded by 1 prompt token + ``ESCALATE_MAX_TOKENS`` (price / 100) and really costs
#: 1 + 4 tokens (price / 200): cheap 0.01 / 0.005, mid 0.04 / 0.02, dear 0.10 / 0.05.
PROVIDERS = {"cheap": 1.0, "mid": 4.0, "dear": 10.0}
ESCALATE_MAX_TOKENS = 9
ESCALATE_USED = (1, 4)  # (prompt, completion) tokens each scripted call reports
#: stage budgets: none; 0.03 (the cheap provider alone: nothing fits after it, mid and
#: dear never); 0.06 (cheap and mid, in either order; dear never); 0.11 (anything, except
#: dear after mid). No sum of costs and a bound lies within 0.005 of one of them, so
#: float noise cannot tip a decision.
BUDGETS = (None, None, 0.03, 0.06, 0.11)


@dataclass(frozen=True)
class Escalation:
    """How an ``escalate`` stage is set up, chosen by a hash of (seed, stage)."""

    engines: tuple[str, ...]  # as listed in ``escalate:``
    order: str  # listed | price
    budget: float | None
    on_fail: str  # keep | error


def escalation(seed: int, stage: str) -> Escalation:
    names = list(PROVIDERS)
    k = 2 + h(seed, "esc-n", stage) % 2
    picked: list[str] = []
    for i in range(k):  # k distinct providers in a hashed order
        rest = [n for n in names if n not in picked]
        picked.append(rest[h(seed, "esc-pick", stage, i) % len(rest)])
    return Escalation(tuple(picked), ("listed", "price")[h(seed, "esc-order", stage) % 2],
                      BUDGETS[h(seed, "esc-budget", stage) % len(BUDGETS)],
                      ("keep", "error")[h(seed, "esc-on_fail", stage) % 2])


def solves(seed: int, stage: str, key: tuple, engine: str) -> bool:
    """Whether ``engine``'s scripted answer to a record passes ``stage``'s verifier."""
    return h(seed, "solves", stage, key, engine) % 2 == 0


def call_bound(engine: str) -> float:
    return PROVIDERS[engine] * (1 + ESCALATE_MAX_TOKENS) / 1000.0


def call_cost(engine: str) -> float:
    return PROVIDERS[engine] * sum(ESCALATE_USED) / 1000.0


def escalated(seed: int, stage: str, key: tuple) -> tuple[str, str | None, list]:
    """What an ``escalate`` stage makes of a record, from the hashes alone:
    ``(outcome, engine, tried)`` with outcome ``solved`` / ``kept`` (an output; ``engine``
    answered it) or ``BudgetExhausted`` / ``VerificationFailed`` (an error record), and
    ``tried`` the ``(engine, passed)`` calls in order. Providers are tried in the plan's
    order (listed, or by worst-case cost), each only if its worst case fits in what is
    left of the budget; the first that passes ends the record."""
    e = escalation(seed, stage)
    plan = list(e.engines) if e.order == "listed" else sorted(e.engines, key=call_bound)
    spent, tried, skipped = 0.0, [], False
    for name in plan:
        if e.budget is not None and spent + call_bound(name) > e.budget:
            skipped = True
            continue
        spent += call_cost(name)
        ok = solves(seed, stage, key, name)
        tried.append((name, ok))
        if ok:
            return "solved", name, tried
    if skipped:
        return "BudgetExhausted", None, tried
    if e.on_fail == "keep":
        return "kept", tried[-1][0], tried
    return "VerificationFailed", None, tried


def parse_key(text: str) -> tuple:
    """A record path formatted into a prompt (``(3, 0)`` or ``[3, 0]``) back as a tuple.
    Not ``ast.literal_eval``: CPython 3.11's AST builder keeps a recursion counter that is
    not thread-safe (gh-106905), and blocking replicas parse from several threads."""
    nums = re.findall(r"-?\d+", text)
    key = tuple(int(n) for n in nums)
    if re.sub(r"[\s()\[\],]", "", text) != "".join(nums):
        raise ValueError(f"not a record path: {text!r:.80}")
    return key


def escalate_fields(stage_index: int) -> tuple[str, str, str]:
    """The (answer, route, cost) fields the ``escalate`` stage of that index writes."""
    return f"answer{stage_index}", f"route{stage_index}", f"cost{stage_index}"


def scripted_answer(text: str) -> tuple[str, str, str, tuple]:
    """(verdict word, engine, stage, key) of a scripted provider's answer."""
    word, engine, stage, key = text.split(" ", 3)
    return word, engine, stage, tuple(json.loads(key))


class ScriptedEngine:
    """A priced generate backend (``fault-scripted``): the prompt is ``"<seed> <stage>
    <path>"``; it answers ``"<pass|fail> <engine> <stage> <key as JSON>"``, ``pass`` when
    ``solves()``. Every text counts as one token; each call reports ``ESCALATE_USED``."""

    context_length = 512
    chat = False

    def __init__(self, path: str, model: str) -> None:
        self.model = model

    def count_tokens(self, text: str) -> int:
        return 1

    def generate(self, requests: list, on_token: Any = None) -> list:
        from tailrace.engines import Generation

        out = []
        for q in requests:
            seed, stage, path = q.prompt.split(" ", 2)
            key = parse_key(path)
            word = "pass" if solves(int(seed), stage, key, self.model) else "fail"
            out.append(Generation(f"{word} {self.model} {stage} {json.dumps(list(key))}",
                                  *ESCALATE_USED, "stop"))
        return out

    def close(self) -> None:
        pass


SCRIPTED = "fault-scripted"


def _register_scripted() -> None:
    """Registers the ``fault-scripted`` backend in this process (a name of its own that
    nothing else uses; Ray's processes never see it, so Ray targets draw no escalate).
    In pytest, conftest.py registers it per test and takes it out after; a run in a
    child process (the interrupt test) registers it here."""
    from tailrace.engines import BACKENDS

    BACKENDS.setdefault(SCRIPTED, (__name__, "ScriptedEngine", ("generate",)))


def provider_specs() -> dict[str, dict]:
    _register_scripted()
    return {n: {"backend": SCRIPTED, "path": __file__, "model": n,
                "price": {"prompt_per_1k": p, "completion_per_1k": p}}
            for n, p in PROVIDERS.items()}


# -- client tool calls (``tools``) ------------------------------------------------------------
TOOLS = "fault-tools"
#: the functions a served request may offer its answering ``tools`` stage
TOOL_FUNCTIONS = tuple(
    {"type": "function", "function": {
        "name": name, "description": f"{name} a record",
        "parameters": {"type": "object", "properties": {"stage": {"type": "string"},
                                                        "path": {"type": "array"}},
                       "required": ["stage", "path"]}}}
    for name in ("lookup", "search"))
#: ``tool_choice`` a request may send: auto (half), required, a function by name, none
TOOL_CHOICES: tuple = ("auto", "auto", "required",
                       {"type": "function", "function": {"name": "search"}}, "none")


def tool_spec(seed: int, lid: int) -> Any:
    """The client tools request ``lid`` offers (checked as a served request's are): one
    or both functions, a choice by hash (naming ``search`` where it is not offered:
    ``required``)."""
    return _checked_tools(1 + h(seed, "tool-fns", lid) % 2,
                          h(seed, "tool-choice", lid) % len(TOOL_CHOICES))


@functools.cache
def _checked_tools(n: int, choice: int) -> Any:
    """The ``ToolSpec`` of the first ``n`` functions and ``TOOL_CHOICES[choice]``, once
    (checking the schemas takes milliseconds)."""
    from tailrace.engines.tool_calls import check_tools

    pick = TOOL_CHOICES[choice]
    if isinstance(pick, dict) and n < 2:
        pick = "required"
    return check_tools(list(TOOL_FUNCTIONS[:n]), pick, None)


def tool_answer(seed: int, stage: str, key: tuple, spec: Any) -> str:
    """The scripted answer of ``tools`` stage ``stage`` to the record ``key`` when its
    request offers it ``spec`` (None: no tools): a call in the call form to an offered
    function, arguments naming the stage and the record (always if the choice requires a
    call, else by a hash), or plain text (no function offered, or the hash says so)."""
    from tailrace.engines.tool_calls import format_call

    fns = spec.offered if spec is not None else ()
    if fns and (spec.must_call or h(seed, "tool-call", stage, key) % 2 == 0):
        name = fns[h(seed, "tool-fn", stage, key) % len(fns)]["name"]
        return format_call(name, json.dumps({"stage": stage, "path": list(key)}))
    return f"text of {stage} on {json.dumps(list(key))}"


def tools_step(sc: Scenario) -> int | None:
    """The step whose stage answers a served request (``Request.answers``, its tools):
    the scenario's first ``tools`` step; None: none (requests offer no tools)."""
    return next((i for i, s in enumerate(sc.steps) if s.op == "tools"), None)


def tools_field(i: int) -> str:
    """The field the ``tools`` stage of step index ``i`` writes its answer to (its id)."""
    return f"tools{i}"


class ToolsBroken(Exception):
    """The scripted tools engine got a request it should never see."""


class ToolScriptedEngine:
    """A chat engine that calls client tools (``fault-tools``, ``tool_calls = True``)
    with a ``tools`` stage's faults. Its one message is a user message, the stage's
    prompt ``"<run> <seed> <stage> <path>"`` (a served request's conversation is one user
    message, which the answering stage replaces with its prompt: ``chat_messages``; any
    other request is an error, ``ToolsBroken``); it answers ``tool_answer()`` for the
    offered tools
    (``GenerationRequest.tools``), streamed in ``PIECES`` pieces to ``on_token``, and
    stops when ``on_token`` returns False (finish ``cancelled``, the text so far).

    Faults by ``Faults.fate`` of (seed, stage, key), as the FN operators meet them: raise
    (the whole engine call fails, as an engine's does: a batch's mates with it), or wait
    3x the stage's timeout (``slow_s``) or ``HANG_MAX_S`` before answering; a wait ends
    early when the test releases it or the request (or the abandoned attempt) is
    cancelled, which it asks ``on_token`` with an empty piece every few ms."""

    context_length = 4096
    chat = True
    tool_calls = True
    PIECES = 3

    def __init__(self, path: str, model: str, faults: Any = (), slow_s: float = 0.0) -> None:
        self.model = model
        self.faults = Faults(*faults)
        self.slow_s = slow_s

    def count_tokens(self, text: str) -> int:
        return 1

    def generate(self, requests: list, on_token: Any = None) -> list:
        return [self._one(i, q, on_token) for i, q in enumerate(requests)]

    def _one(self, i: int, q: Any, on_token: Any) -> Any:
        from tailrace.engines import Generation

        msgs = list(q.messages or ())
        if q.prompt is not None or len(msgs) != 1 or msgs[0].get("role") != "user":
            raise ToolsBroken(f"expected one user message (the prompt), got {q!r:.300}")
        run, seed, stage, path = msgs[0]["content"].split(" ", 3)
        key = parse_key(path)
        probe = PROBES.get(int(run))
        cancels = probe is not None and probe.visit(stage, {"path": key})
        fate = self.faults.fate(int(seed), stage, key)
        n = _attempt(int(run), stage, key) if fate != "ok" else 0
        if fate == "always" or (fate == "first" and n == 1):
            raise InjectedFault(f"{fate} fault at {stage} on {key} (attempt {n})")
        going = True
        if fate == "slow" or (fate == "slow_first" and n == 1):
            going = self._wait(i, on_token, probe, self.slow_s)
        elif fate == "hang":
            going = self._wait(i, on_token, probe, HANG_MAX_S)
        text = tool_answer(int(seed), stage, key, q.tools)
        step = -(-len(text) // self.PIECES)
        said = []
        for k in range(0, len(text), step) if going else ():
            if cancels:  # its caller cancels now: give the cancel a moment to land
                time.sleep(0.002)
            said.append(text[k:k + step])
            if on_token is not None and on_token(i, said[-1]) is False:
                going = False
                break
        return Generation("".join(said), 1, len(said), "stop" if going else "cancelled")

    @staticmethod
    def _wait(i: int, on_token: Any, probe: Probe | None, seconds: float) -> bool:
        """Sleep ``seconds`` or until released (True), or until cancelled (False)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if probe is not None and probe.release.is_set():
                return True
            if on_token is not None and on_token(i, "") is False:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        pass


def tool_engine(step: Step) -> dict:
    """The engine spec of a ``tools`` step: its own faults and slow wait (engines with
    equal specs are shared: they keep no state)."""
    _register_tools()
    t = timeout_s(step)
    return {"backend": TOOLS, "path": __file__, "model": "tools",
            "faults": [getattr(step.faults, k) for k in FAULT_KINDS],
            "slow_s": 3 * t if t is not None else 0.0}


def _register_tools() -> None:
    """Registers ``fault-tools`` in this process, as ``_register_scripted`` does."""
    from tailrace.engines import BACKENDS

    BACKENDS.setdefault(TOOLS, (__name__, "ToolScriptedEngine", ("generate",)))


# -- scenarios ------------------------------------------------------------------------------
FAULT_KINDS = ("always", "first", "slow", "slow_first", "hang")


@dataclass(frozen=True)
class Faults:
    """Percentages of the records (by lineage) that meet each fault at a stage.

    always: raise on every attempt; first: raise on the first attempt only;
    slow / slow_first: take 3x the stage's timeout (every attempt / the first);
    hang: block until the test releases it (or the record's cancel event is set).
    """

    always: int = 0
    first: int = 0
    slow: int = 0
    slow_first: int = 0
    hang: int = 0

    def fate(self, seed: int, stage: str, key: tuple) -> str:
        r = h(seed, stage, key) % 100
        for kind in FAULT_KINDS:
            pct = getattr(self, kind)
            if r < pct:
                return kind
            r -= pct
        return "ok"


@dataclass(frozen=True)
class Step:
    """One stage: ``op`` consumes open stream ``at`` (and ``other`` for a merge).

    op: map | amap (async map) | filter | flat_map | branch | merge | batch (a batch
        stage of ``size`` records, ``wait_ms``) | bmap (a map with a batch contract of
        ``size``, ``wait_ms``) | cmap (a custom operator with ``concurrent_calls``:
        several blocking calls in flight per replica, ``Execution.in_flight``)
        | stateful | select (a batch-only built-in operator) | verify (the ``verify``
        operator with a ``python`` verifier failing about one record in four, ``verified``;
        ``on_fail`` keep or error by stage, ``on_fail()``; async when the stage has a
        timeout, else a plain function; never on a stream of batches) | escalate (a
        budgeted ``route``: ``escalate:`` over two or three priced scripted providers,
        ``ScriptedEngine``, whose answers pass by a hash, ``solves()``; order, budget and
        on_fail by stage, ``escalation()``; the stage's faults hit its ``python``
        verifier, a blocking check inside the blocking batch operator, ``EscalateCheck``;
        what each record must come to: ``escalated()``. Never on a stream of batches,
        and local and service targets only: the scripted backend is registered in this
        process alone, so a Ray actor could not open it) | tools (a ``generate`` stage
        on a chat engine that calls client tools, ``ToolScriptedEngine``, with the
        stage's faults; it writes ``tool_answer()`` to field ``tools<index>``; a served
        request offers the first tools step its tools, ``tool_spec()``. Never on a stream
        of batches; local and service targets only, as escalate).
    contract: the contract keywords, as sorted (key, value) pairs.
    """

    op: str
    at: int = 0
    other: int = -1
    contract: tuple = ()
    faults: Faults = Faults()
    size: int = 2
    wait_ms: float = 0.0


@dataclass(frozen=True)
class Admission:
    """The admission gate of a run: policy and limits (fcfs, slo)."""

    policy: str
    max_in_flight: int = 2
    max_queue: int = 4
    p99_ms: float = 60_000.0
    quick: bool = False  # predict ~2 ms a request (these operators' speed), not ~1.3 s
    overflow: int = 0  # slo: lanes beyond max_in_flight for the top class over a lower one

    def gate(self) -> Any:
        from tailrace.control import AdmissionGate, CostModel

        if self.quick:  # deadlines of a few ms can be met at arrival and expire queued
            cost = CostModel(prefill_tps=1e6, decode_tps=64_000.0, overhead_s=0.001)
            return AdmissionGate(self._policy(cost_model=cost))
        return AdmissionGate(self._policy())

    def _policy(self, **common: Any) -> Any:
        from tailrace.control import PipelineSLO, make_policy

        if self.policy == "simultaneous":
            return make_policy("simultaneous", **common)
        if self.policy == "fcfs":
            return make_policy("fcfs", max_in_flight=self.max_in_flight,
                               max_queue=self.max_queue, **common)
        return make_policy("slo", max_in_flight=self.max_in_flight, max_queue=self.max_queue,
                           slos={PIPELINE: PipelineSLO(p99_ms=self.p99_ms)},
                           overflow=self.overflow, **common)


@dataclass(frozen=True)
class Scenario:
    """One example: ``n`` input records through ``steps``, with these faults.

    interrupt: (step, lid): the operator of that step sends the process SIGINT (Ctrl-C)
               when it first sees a record of that lineage (local runtime, run on the
               main thread of a child process: see ``interrupt.py``).
    cancel:    (step, lid) pairs: the caller of that request cancels it when its record
               reaches that step (serving).
    stop:      serving: stop the service while the requests are in flight.
    max_pending: serving: the service's limit of waiting requests (None: plenty).
    kill:      Ray: the step whose actor is killed once the first output arrived.
    where:     Ray: "" (the runtime's default: a served run's inline stages fed by the
               driver run there, a batch run's on actors), "host" (every stage on an
               actor) or "driver" (every stage that can runs in the driver).
    urgency:   serving: per request (by lid), its own ``(priority, deadline_ms)`` for
               admission (the record's ``_urgency``; None, or a None part: not set).
    """

    n: int
    seed: int
    steps: tuple[Step, ...] = ()
    fuse: bool = True
    admission: Admission | None = None
    interrupt: tuple[int, int] | None = None
    cancel: tuple[tuple[int, int], ...] = ()
    stop: bool = False
    max_pending: int | None = None
    kill: int | None = None
    where: str = ""
    urgency: tuple[tuple[str | int | None, float | None] | None, ...] = ()


PIPELINE = "fault"
FN_OPS = ("map", "amap", "filter", "flat_map", "branch", "bmap", "cmap", "stateful", "verify",
          "escalate", "tools")


class ConcurrentMap(tr.Operator):
    """``cmap``: blocking calls to a server that batches them itself, as ``generate``'s
    to llama.cpp are, so the stage keeps several in flight per replica."""

    concurrent_calls = True

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def process(self, record: Any) -> Any:
        return self.fn(record)


def stage_id(i: int, step: Step) -> str:
    return f"{step.op}{i}"


def timeout_s(step: Step) -> float | None:
    ms = dict(step.contract).get("timeout_ms")
    return None if ms is None else ms / 1000.0


# -- the operators ----------------------------------------------------------------------------
class Ledger:
    """An append-only file of the silent ends the operators decide: a filter's drop, a
    flat_map that emits nothing. Shared by processes (Ray actors) through the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def note(self, kind: str, stage: str, path: tuple) -> None:
        line = (json.dumps([kind, stage, list(path)]) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def entries(self) -> list[tuple[str, str, tuple]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [(k, s, tuple(p)) for k, s, p in map(json.loads, f)]


class Probe:
    """The test's hooks into one in-process run: progress, the release of hung calls,
    cancellations and interrupts. Operators find it by run key (absent on Ray)."""

    def __init__(self, sc: Scenario) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.on_cancel: Any = None  # lid -> None, set by the serving runner
        self._cancel = {(stage_id(i, sc.steps[i]), lid) for i, lid in sc.cancel}
        self._interrupt = (None if sc.interrupt is None else
                           (stage_id(sc.interrupt[0], sc.steps[sc.interrupt[0]]),
                            sc.interrupt[1]))
        self.interrupted = False
        self._lock = threading.Lock()

    def visit(self, stage: str, x: Any) -> bool:
        """Count a call at ``stage`` on ``x``; cancel or interrupt as the scenario says
        there. True: a record's caller was told to cancel now."""
        self.calls += 1
        try:
            paths = lineages(x) if not isinstance(x, list) else \
                [p for r in x for p in lineages(r)]
        except ValueError:
            return False
        told = False
        for p in paths:
            with self._lock:
                cancel = (stage, p[0]) in self._cancel
                self._cancel.discard((stage, p[0]))
                stop = not self.interrupted and self._interrupt == (stage, p[0])
                if stop:
                    self.interrupted = True
            if cancel and self.on_cancel is not None:
                self.on_cancel(p[0])
                told = True
            if stop:  # Ctrl-C, as a terminal sends it (the run is on the main thread)
                os.kill(os.getpid(), signal.SIGINT)
        return told


PROBES: dict[int, Probe] = {}
_ATTEMPTS: dict[tuple, int] = defaultdict(int)
_ATTEMPTS_LOCK = threading.Lock()
HANG_MAX_S = 30.0  # a hung call's own bound; the test releases it long before


def _attempt(run: int, stage: str, key: tuple) -> int:
    with _ATTEMPTS_LOCK:
        _ATTEMPTS[(run, stage, key)] += 1
        return _ATTEMPTS[(run, stage, key)]


def forget_attempts(run: int) -> None:
    with _ATTEMPTS_LOCK:
        for k in [k for k in _ATTEMPTS if k[0] == run]:
            del _ATTEMPTS[k]


def _events(x: Any, probe: Probe | None) -> list[Any]:
    """What may end a blocking wait early: the records' requests' cancels (set by the
    caller, or by the runtime when it abandons a timed-out attempt) and the test's
    release."""
    reqs = [request_of(r) for r in (x if isinstance(x, list) else [x])]
    evs = [q.cancel for q in reqs if q is not None]
    return evs + ([probe.release] if probe is not None else [])


def _block(x: Any, probe: Probe | None, seconds: float) -> None:
    """Sleep ``seconds``, or less if a record's cancel event or the release is set."""
    evs = _events(x, probe)
    end = time.monotonic() + seconds
    while not any(e.is_set() for e in evs):
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.005))


class Fn:
    """A fault-injecting operator function; picklable (Ray ships it to actors)."""

    def __init__(self, op: str, stage: str, sc: Scenario, faults: Faults, ledger: Ledger,
                 run: int, timeout: float | None) -> None:
        self.op, self.stage, self.seed, self.faults = op, stage, sc.seed, faults
        self.ledger, self.run = ledger, run
        self.slow_s = 3 * timeout if timeout is not None else 0.0

    def _fate(self, x: Any) -> tuple[str, int]:
        probe = PROBES.get(self.run)
        if probe is not None:
            probe.visit(self.stage, x)
        k = key_of(x)
        fate = self.faults.fate(self.seed, self.stage, k)
        if fate == "ok":
            return fate, 0
        n = _attempt(self.run, self.stage, k)
        if fate == "always" or (fate == "first" and n == 1):
            raise InjectedFault(f"{fate} fault at {self.stage} on {k} (attempt {n})")
        return fate, n

    def __call__(self, x: Any) -> Any:
        fate, n = self._fate(x)
        if fate == "slow" or (fate == "slow_first" and n == 1):
            _block(x, PROBES.get(self.run), self.slow_s)
        elif fate == "hang":
            _block(x, PROBES.get(self.run), HANG_MAX_S)
        return self.apply(x)

    def apply(self, x: Any) -> Any:
        op = self.op
        if op in ("map", "amap", "cmap"):
            return {**x, "hops": x.get("hops", 0) + 1}
        if op == "bmap":
            return [{**r, "hops": r.get("hops", 0) + 1} for r in x]
        if op == "filter":
            if is_batch(x):
                return True  # batches are never dropped: their fate is in plain sight
            path = tuple(x["path"])
            keep = keeps(self.seed, self.stage, path)
            if not keep:
                self.ledger.note("drop", self.stage, path)
            return keep
        if op == "flat_map":
            if is_batch(x):
                return list(x["items"])
            path = tuple(x["path"])
            k = fanout(self.seed, path)
            if k == 0:
                self.ledger.note("empty", self.stage, path)
            return [{**x, "path": path + (i,)} for i in range(k)]
        if op == "branch":
            return h(self.seed, "branch", self.stage, key_of(x)) % 2 == 0
        raise AssertionError(op)


class AsyncFn(Fn):
    """The async twin (``amap``): slow and hung calls are sleeps the timeout cancels."""

    async def __call__(self, x: Any) -> Any:  # type: ignore[override]
        fate, n = self._fate(x)
        if fate == "slow" or (fate == "slow_first" and n == 1):
            await asyncio.sleep(self.slow_s)
        elif fate == "hang":
            await asyncio.sleep(HANG_MAX_S)
        return self.apply(x)


class VerifyFn(Fn):
    """A ``python`` verifier ``(answer, record) -> (ok, reason)`` with the stage's faults."""

    def __call__(self, answer: str, record: Any) -> Any:  # type: ignore[override]
        fate, n = self._fate(record)
        if fate == "slow" or (fate == "slow_first" and n == 1):
            _block(record, PROBES.get(self.run), self.slow_s)
        elif fate == "hang":
            _block(record, PROBES.get(self.run), HANG_MAX_S)
        return self.verdict(record)

    def verdict(self, record: Any) -> tuple[bool, str]:
        ok = verified(self.seed, self.stage, key_of(record))
        return ok, "verified" if ok else f"rejected {key_of(record)}"


class AsyncVerifyFn(VerifyFn):
    """The async twin: slow and hung checks are sleeps the stage's timeout cancels."""

    async def __call__(self, answer: str, record: Any) -> Any:  # type: ignore[override]
        fate, n = self._fate(record)
        if fate == "slow" or (fate == "slow_first" and n == 1):
            await asyncio.sleep(self.slow_s)
        elif fate == "hang":
            await asyncio.sleep(HANG_MAX_S)
        return self.verdict(record)


class EscalateCheck(Fn):
    """An ``escalate`` stage's ``python`` verifier with the stage's faults (raising, slow,
    hung: a blocking wait inside the route operator's call, which a timeout abandons by
    setting the attempt's cancel). It passes a scripted ``pass`` answer that names this
    stage and the record it checks."""

    def __call__(self, answer: str, record: Any) -> Any:  # type: ignore[override]
        fate, n = self._fate(record)
        if fate == "slow" or (fate == "slow_first" and n == 1):
            _block(record, PROBES.get(self.run), self.slow_s)
        elif fate == "hang":
            _block(record, PROBES.get(self.run), HANG_MAX_S)
        word, engine, stage, key = scripted_answer(answer)
        if stage != self.stage or key != key_of(record):
            return False, f"{engine} answered {stage} {key}, not {self.stage} {key_of(record)}"
        return word == "pass", f"{engine}: {word}"


class StatefulFn(Fn):
    """``fn(state, record) -> (state, emit)``: counts the records of each ``grp``."""

    def __call__(self, state: Any, x: Any) -> Any:  # type: ignore[override]
        fate, n = self._fate(x)
        if fate == "slow" or (fate == "slow_first" and n == 1):
            _block(x, PROBES.get(self.run), self.slow_s)
        elif fate == "hang":
            _block(x, PROBES.get(self.run), HANG_MAX_S)
        count = (state or 0) + 1
        return count, count


def build(sc: Scenario, ledger: Ledger, run: int, *, data: list | None,
          sink: Any) -> tr.Pipeline:
    """The scenario's pipeline; ``data``/``sink`` None leave them to be bound (serving)."""
    engines = provider_specs() if any(s.op == "escalate" for s in sc.steps) else {}
    engines.update({stage_id(i, s): tool_engine(s) for i, s in enumerate(sc.steps)
                    if s.op == "tools"})
    p = tr.Pipeline(PIPELINE, **({"engines": engines} if engines else {}))
    streams = [p.source(data, id="src")]
    for i, step in enumerate(sc.steps):
        sid = stage_id(i, step)
        s = streams[step.at]
        c = dict(step.contract)
        t = timeout_s(step)
        if step.op == "amap":
            out = s.map(AsyncFn("amap", sid, sc, step.faults, ledger, run, t), id=sid, **c)
        elif step.op == "map":
            out = s.map(Fn("map", sid, sc, step.faults, ledger, run, t), id=sid, **c)
        elif step.op == "cmap":
            out = s.apply(ConcurrentMap, fn=Fn("cmap", sid, sc, step.faults, ledger, run, t),
                          id=sid, **c)
        elif step.op == "bmap":
            out = s.map(Fn("bmap", sid, sc, step.faults, ledger, run, t), id=sid,
                        batch={"max_size": step.size, "max_wait_ms": step.wait_ms}, **c)
        elif step.op == "filter":
            out = s.filter(Fn("filter", sid, sc, step.faults, ledger, run, t), id=sid, **c)
        elif step.op == "flat_map":
            out = s.flat_map(Fn("flat_map", sid, sc, step.faults, ledger, run, t), id=sid,
                             **c)
        elif step.op == "stateful":
            out = s.stateful(StatefulFn("stateful", sid, sc, step.faults, ledger, run, t),
                             id=sid, key="grp", output="count", **c)
        elif step.op == "verify":
            check = (AsyncVerifyFn if t is not None else VerifyFn)(
                "verify", sid, sc, step.faults, ledger, run, t)
            out = s.apply("verify", id=sid, verifier={"python": check}, field="lid",
                          on_fail=on_fail(sc.seed, sid), **c)
        elif step.op == "escalate":
            e = escalation(sc.seed, sid)
            answer, route, cost = escalate_fields(i)
            check = EscalateCheck("escalate", sid, sc, step.faults, ledger, run, t)
            out = s.apply("route", id=sid, escalate=list(e.engines), order=e.order,
                          verify={"python": check}, on_fail=e.on_fail,
                          prompt=f"{sc.seed} {sid} " + "{path}",
                          max_tokens=ESCALATE_MAX_TOKENS, output=answer, route=route,
                          cost=cost, **({"budget": e.budget} if e.budget is not None else {}),
                          **c)
        elif step.op == "tools":
            out = s.apply("generate", id=sid, engine=sid, output=tools_field(i),
                          prompt=f"{run} {sc.seed} {sid} " + "{path}", **c)
        elif step.op == "select":
            out = s.apply("select", id=sid, drop=["scratch"], **c)
        elif step.op == "batch":
            out = s.batch(step.size, step.wait_ms, id=sid, output="items", **c)
        elif step.op == "branch":
            yes, no = s.branch(Fn("branch", sid, sc, step.faults, ledger, run, t), id=sid,
                               **c)
            streams[step.at] = yes
            streams.append(no)
            continue
        elif step.op == "merge":
            out = s.merge(streams[step.other], id=sid, **c)
            streams[step.at] = out
            del streams[step.other]
            continue
        else:
            raise AssertionError(step.op)
        streams[step.at] = out
    for j, s in enumerate(streams):
        s.sink(sink, id=f"out{j}")
    return p


def fault_settings(target: str) -> Any:
    """The Hypothesis settings of a fault test: the ``TAILRACE_FAULT_PROFILE`` profile
    (``ci`` by default, registered in ``conftest.py``) for ``target``."""
    from hypothesis import settings

    return settings.get_profile(f"{os.environ.get('TAILRACE_FAULT_PROFILE', 'ci')}-{target}")
