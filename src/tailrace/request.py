"""One request, typed: what a served request carries besides its record's user fields.

A record holds user data only. A request (an HTTP call, a ``PipelineService.submit``, a
record admitted at a run's source) also carries control: who is waiting for the answer,
how to stop its work, where its tokens go, the options it asked for, the priority it
asked and the one admission granted, its session and conversation. That is a
``Request``, made once at ingress; a record points at it with its one reserved key
(``REQUEST``), every operator reads it with ``request_of(record)``, and the stage that
answers fills its typed ``Reply`` (finish reason, usage, cost). Nothing else rides in a
record: stripping the one key gives the user's fields back (``strip``).

Across processes (Ray actors), a pickled request carries only whether it was cancelled
and whether it streams; the receiving side gives it live parts of its own
(``Request.bind``). ``streamed`` counts the pieces handed to the sink so far, wherever
they were produced (a replayed or resumed generation skips that many).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

#: The one reserved record key: the record's ``Request``.
REQUEST = "_request"

_ids = count(1)


class Cancel:
    """A request's stop signal: any thread may ``set()`` it, stages read ``is_set()``;
    nothing waits on it (a flag, not a lock and a condition, per request).

    parent: another signal (a ``Cancel``, or anything with ``is_set()``, e.g. a caller's
            ``threading.Event``) that also counts as set: an attempt under a timeout gets
            a child of its request's signal, set when the attempt is abandoned.
    """

    __slots__ = ("_set", "parent", "__weakref__")

    def __init__(self, parent: Any = None) -> None:
        self._set = False
        self.parent = parent

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        if self._set:
            return True
        p = self.parent
        return p is not None and bool(p.is_set())

    def child(self) -> Cancel:
        """A signal set by this one or by its own ``set()``."""
        return Cancel(self)

    def __reduce__(self) -> tuple:  # across processes: a fresh flag with the same state
        return _cancel_of, (self.is_set(),)


def _cancel_of(is_set: bool) -> Cancel:
    c = Cancel()
    c._set = is_set
    return c


@dataclass(slots=True)
class Reply:
    """What the answering stage reports about its answer (OpenAI requests read it).

    finish: the finish reason (``stop``, ``length``, ``tool_calls``...), None: unknown.
    usage:  token counts over every engine call it made: ``prompt_tokens``,
            ``completion_tokens`` and, when the engine reused a cached prefix,
            ``cached_tokens``; None: not reported.
    cost:   what the answer cost in the providers' units, None: not priced.
    """

    finish: str | None = None
    usage: dict[str, int] | None = None
    cost: float | None = None


@dataclass(slots=True, eq=False)
class Request:
    """One request's control data (see the module docstring).

    rid:      its id (equal ids are the same request); the service that takes it gives
              it one of its own (answers are routed back by it).
    cancel:   its stop signal (one ``Cancel``; set when the caller gives up).
    sink:     ``sink(piece)`` for each text piece the answering stage generates, or None.
    options:  the request's own generation options (temperature, max_tokens, ...) for
              the answering stage, or None.
    answers:  the output field of the stage that answers it (its options are for that
              stage, only it streams and reports the reply); None: any stage streams.
    asked:    the urgency it asked for: ``{"priority": CLASS, "deadline_ms": MS}``.
    granted:  ``(class, deadline)`` admission granted it, for the engines (deadline in
              wall-clock seconds), or None.
    ticket:   its admission ticket while it holds one (the runtime gives it back).
    session:  the session its engine calls stick to (prefix reuse), or None.
    messages: the conversation it carries (OpenAI chat), or None.
    tools:    the client tools it offers the answering stage (``ToolSpec``), or None.
    tenant:   the tenant it was sent by, or None.
    budget:   the most its answer may cost (``X-Tailrace-Budget``), or None: the
              answering stage's own budget, if any (docs/routing.md).
    trace:    its request span's context (tracing on), or None.
    reply:    what the answering stage reports (``Reply``).
    streamed: pieces handed to ``sink`` so far.
    """

    rid: int = field(default_factory=lambda: next(_ids))
    cancel: Cancel = field(default_factory=Cancel)
    sink: Callable[[str], Any] | None = None
    options: dict[str, Any] | None = None
    answers: str | None = None
    asked: dict[str, Any] | None = None
    granted: tuple[int, float] | None = None
    ticket: Any = None
    session: str | None = None
    messages: list | tuple | None = None
    tools: Any = None
    tenant: str | None = None
    budget: float | None = None
    trace: Any = None
    reply: Reply = field(default_factory=Reply)
    streamed: int = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and other.rid == self.rid

    def __hash__(self) -> int:
        return hash(self.rid)

    def tools_for(self, out: str) -> Any:
        """The request's client tools if the stage writing ``out`` answers it, else None."""
        return self.tools if self.answers == out else None

    def options_for(self, out: str) -> dict[str, Any] | None:
        """The request's options if the stage writing ``out`` answers it, else None."""
        return self.options if self.answers == out else None

    def sink_for(self, out: str) -> Callable[[str], Any] | None:
        """Where the stage writing ``out`` streams its tokens: the request's sink if that
        stage answers it (any stage, for a request that names none), else None."""
        return self.sink if self.answers is None or self.answers == out else None

    def report(self, out: str, finish: str | None, usage: dict[str, int],
               cost: float | None = None) -> None:
        """The stage writing ``out`` reports its answer and its cost (kept only from the
        answering stage of a request that names one)."""
        if self.answers == out:  # ``out`` is a field name, never None
            self.reply.finish = finish  # in place: an attempt's copy shares the reply
            self.reply.usage = usage
            self.reply.cost = cost

    def fork(self) -> Request:
        """A request of its own (new id, empty reply) that shares this one's cancel and
        asks the same: one of several records a client request sends together."""
        return Request(cancel=self.cancel, sink=self.sink, options=self.options,
                       answers=self.answers, asked=self.asked, session=self.session,
                       messages=self.messages, tools=self.tools, tenant=self.tenant,
                       budget=self.budget, trace=self.trace)

    def bind(self, cancel: Cancel, sink: Callable[[str], Any] | None) -> None:
        """Give a request that crossed a process its live parts (the receiving side's)."""
        self.cancel = cancel
        self.sink = sink

    def __getstate__(self) -> tuple:
        # the live parts stay home: a cancel's state and whether it streams travel
        return (self.rid, self.cancel.is_set(), self.sink is not None, self.options,
                self.answers, self.asked, self.granted, self.session, self.messages,
                self.tools, self.tenant, self.budget, self.trace, self.reply, self.streamed)

    def __setstate__(self, state: tuple) -> None:
        (self.rid, cancelled, streams, self.options, self.answers, self.asked,
         self.granted, self.session, self.messages, self.tools, self.tenant, self.budget,
         self.trace, self.reply, self.streamed) = state
        self.cancel = _cancel_of(cancelled)
        self.sink = _remote_sink if streams else None
        self.ticket = None


def _remote_sink(piece: str) -> None:
    """The sink of a request unpickled in another process until the receiver binds its
    own: a piece sent here would go nowhere, so it is a bug to call it."""
    raise RuntimeError("a request's token sink was used before its receiver bound one "
                       "(Request.bind)")


def request_of(record: Any) -> Request | None:
    """The ``Request`` a record belongs to, or None (a record of a batch run)."""
    return record.get(REQUEST) if type(record) is dict else None


def field_list(record: Any) -> str:
    """The record's user field names, comma-separated, for a "which fields it has"
    message (``"no fields"``; ``"not a mapping"``)."""
    if not isinstance(record, dict):
        return "not a mapping"
    return ", ".join(str(k) for k in record if k != REQUEST) or "no fields"


def strip(record: Any) -> Any:
    """``record`` with its user fields only (a copy if it had a request)."""
    if type(record) is dict and REQUEST in record:
        return {k: v for k, v in record.items() if k != REQUEST}
    return record

