"""A request trace: one JSON line per request, written when the request ends.

``tailrace run --trace-out FILE`` and ``tailrace serve --trace-out FILE`` write it; a
capacity simulator replays it (arrivals and sizes). One line:

    {"t": 0.01234, "pipeline": "wiki-qa", "prompt_tokens": 57, "max_tokens": 64,
     "output_tokens": 41, "latency_s": 1.234, "outcome": "ok"}

``t``: seconds from the writer's opening (the run's or server's start) to the request's
arrival at the ingress, before admission; ``prompt_tokens``: what the admission gate
predicts for its record (``control.gate.approx_prompt_tokens``); ``max_tokens``: the
output budget it asked for, else its pipeline's answering stage's, else null;
``output_tokens``: what the answering stage reported (null: not reported);
``latency_s``: arrival to end; ``outcome``: ok, error or rejected (by admission).

Recording a request costs a tuple appended to a deque (no lock, no encoding): a writer
thread encodes and writes the lines at least every ``FLUSH_S`` seconds, sooner once
``FLUSH_LINES`` wait, so a killed process loses at most that much; ``close`` writes the
rest. Lines come in the order requests end.

``RunTrace`` follows a batch run's input records (``tr.run(..., trace=writer)``): each
record gets a ``Request`` as it is read, which identifies it at the sink, in its error
record or where a stage dropped it. A served request is recorded by its service
(``PipelineService(trace=writer)``).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from time import perf_counter
from typing import IO, Any

from ..api.records import ErrorRecord
from ..compiler import Plan
from ..control.gate import approx_prompt_tokens
from ..errors import PlanError, TailraceError
from ..request import REQUEST, Request, request_of, strip

__all__ = ["FLUSH_LINES", "FLUSH_S", "RunTrace", "TraceWriter", "answer_budget",
           "asked_tokens", "output_tokens"]

#: Most seconds a recorded line waits before it is written (and flushed).
FLUSH_S = 1.0
#: Lines waiting that make the writer write at once.
FLUSH_LINES = 1000


class TraceWriter:
    """Writes a request trace (the module docstring has the line format).

    ``open(path)`` creates (truncates) the file and starts the writer thread; its time is
    the trace's zero (``t0``). ``record(...)`` from any thread; ``close()`` writes what
    is left, stops the thread and closes the file (once; recording after it does nothing).
    """

    def __init__(self, f: IO[str], path: str) -> None:
        self.path = path
        self.t0 = perf_counter()
        self.lines = 0  # written so far
        self.failure: OSError | None = None  # the write that failed (nothing written since)
        self._f = f
        self._pending: deque[tuple] = deque()
        self._wake = threading.Event()
        self._io = threading.Lock()  # one writer at a time: the thread, ``flush``, ``close``
        self._closed = False
        self._dumps = json.JSONEncoder(ensure_ascii=False).encode
        self._names: dict[str, str] = {}  # pipeline name or outcome -> its JSON string
        self._thread = threading.Thread(target=self._loop, name="tailrace-trace-out",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, path: str) -> TraceWriter:
        """A writer to ``path`` (created or truncated now); a ``TailraceError`` in one line
        when it cannot be written (no such directory, no permission, a directory)."""
        try:
            f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by ``close``
        except OSError as e:
            raise TailraceError(f"{path}: cannot write the trace: {e.strerror or e}; give a "
                                "writable file in an existing directory") from None
        return cls(f, path)

    def record(self, arrived: float, pipeline: str, prompt_tokens: int,
               max_tokens: int | None, output_tokens: int | None, outcome: str,
               ended: float | None = None) -> None:
        """One request ended (``outcome``: ok | error | rejected; the token counts are
        ints). ``arrived``, ``ended``: ``perf_counter()`` readings (``ended`` None: now)."""
        if self._closed:
            return
        if ended is None:
            ended = perf_counter()
        pending = self._pending
        pending.append((arrived, pipeline, prompt_tokens, max_tokens, output_tokens, ended,
                        outcome))
        if len(pending) >= FLUSH_LINES:
            self._wake.set()

    def flush(self) -> None:
        """Write (and flush) every line recorded so far."""
        pending, names, dumps, t0 = self._pending, self._names, self._dumps, self.t0
        with self._io:
            out = []
            while pending:
                arrived, pipeline, ptoks, mtoks, otoks, ended, outcome = pending.popleft()
                name = names.get(pipeline) or names.setdefault(pipeline, dumps(pipeline))
                how = names.get(outcome) or names.setdefault(outcome, dumps(outcome))
                # formatted here, not by a JSON encoder: a third of the time per line
                out.append(f'{{"t": {round(arrived - t0, 6)!r}, "pipeline": {name}, '
                           f'"prompt_tokens": {int(ptoks)}, "max_tokens": '
                           f'{"null" if mtoks is None else int(mtoks)}, "output_tokens": '
                           f'{"null" if otoks is None else int(otoks)}, "latency_s": '
                           f'{round(ended - arrived, 6)!r}, "outcome": {how}}}')
            if not out or self.failure is not None or self._f.closed:
                return
            try:
                self._f.write("\n".join(out) + "\n")
                self._f.flush()
            except OSError as e:  # e.g. the disk is full: said by ``close``
                self.failure = e
                return
            self.lines += len(out)

    def close(self) -> None:
        """Write what is left and close the file; a ``TailraceError`` if a write failed."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join()
        self.flush()
        with self._io:
            try:
                self._f.close()
            except OSError as e:
                self.failure = self.failure or e
        if self.failure is not None:
            raise TailraceError(f"{self.path}: writing the trace failed: "
                                f"{self.failure.strerror or self.failure}; "
                                f"{self.lines} line(s) were written")

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self.flush()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def answer_budget(plan: Plan) -> tuple[int | None, str | None]:
    """The output budget (``max_tokens``) and ``usage:`` field of the plan's answering
    stage: the last operator that declares ``answers`` (a generate, route, ...); (None,
    None) without one."""
    last = None
    for s in plan.stages:
        for o in s.ops:
            if o.op.answers is not None:
                last = o.op.answers, o.params
    if last is None:
        return None, None
    answers, params = last
    return int(answers.max_tokens(params)), answers.usage_field(params)


def asked_tokens(req: Request | None, default: int | None) -> int | None:
    """The output budget a request asked for (its ``max_tokens`` option), else
    ``default``."""
    opts = req.options if req is not None else None
    asked = opts.get("max_tokens") if opts else None
    return asked if type(asked) is int else default


def output_tokens(req: Request | None, record: Any, usage_field: str | None) -> int | None:
    """Tokens generated for a request: its reply's usage, else the output record's
    ``usage_field``; None: neither says."""
    usage = req.reply.usage if req is not None else None
    if not isinstance(usage, dict) and usage_field is not None and isinstance(record, dict):
        usage = record.get(usage_field)
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if type(n) is int else None


def bare(record: Any) -> Any:
    """``record`` without the requests the trace gave the input records, also those of
    the records ``batch`` stages grouped into it (a list, or a list in a field, at any
    depth: a batch of batches)."""
    if type(record) is list:
        return [bare(x) for x in record]
    record = strip(record)
    if type(record) is dict and any(type(v) is list for v in record.values()):
        return {k: bare(v) if type(v) is list else v for k, v in record.items()}
    return record


class RunTrace:
    """Follows the input records of one batch run to their ends for ``writer``.

    ``bind(inputs, outputs, on_error)`` wraps the run's input (each record, a dict, gets
    a ``Request`` as it is read: arrival), its outputs (written without the request) and
    its error callback; ``drop`` is the run's ``on_drop`` (a record a filter dropped
    ended without an error: ok); ``finish(interrupted)`` writes the records that did not
    end (error if the run was interrupted, else ok: they ended where no request was
    kept, e.g. a stage that replaced them; the end of the run is their end).
    """

    def __init__(self, writer: TraceWriter, plan: Plan) -> None:
        own = [o.id for s in plan.stages for o in s.ops
               if (o.op.kind == "source" and o.params.get("data") is not None)
               or (o.op.kind == "sink" and o.params.get("target") is not None)]
        if own:
            raise PlanError("trace= follows the records of input= to the sinks bound at run "
                            "time (output=); this stage has its own data or target: declare "
                            "it without (tr.run(p, input=..., output=...))", stage=own[0])
        self.writer = writer
        self.pipeline = plan.name
        self.max_tokens, self.usage_field = answer_budget(plan)
        # request id -> (arrival, prompt tokens, request) of each record read, not ended
        self.open: dict[int, tuple[float, int, Request]] = {}

    def bind(self, inputs: dict[str, Any], outputs: dict[str, Any],
             on_error: Callable[[ErrorRecord], None]
             ) -> tuple[dict[str, Any], dict[str, Any], Callable[[ErrorRecord], None]]:
        """The run's inputs, outputs and error callback, followed."""
        if not inputs:
            raise PlanError("trace= follows the records of input=; this run has none")
        return ({k: self.follow(v) for k, v in inputs.items()},
                {k: self.output(v) for k, v in outputs.items()}, self.error(on_error))

    def _arrived(self, x: Any) -> dict:
        if type(x) is not dict:
            raise TypeError(f"trace= follows records that are dicts (JSON objects); got "
                            f"{type(x).__name__}: wrap it, e.g. {{'value': x}}")
        req = x.get(REQUEST)
        if req is None:
            req = Request()
            x = {**x, REQUEST: req}
        self.open[req.rid] = (perf_counter(), approx_prompt_tokens(x), req)
        return x

    def follow(self, data: Any) -> Any:
        """``data`` (an iterable or async iterable of dicts) with each record's arrival."""
        if hasattr(data, "__aiter__"):
            return self._follow_async(data)
        return self._follow(data)

    def _follow(self, data: Any) -> Iterator[dict]:
        arrived = self._arrived
        for x in data:
            yield arrived(x)

    async def _follow_async(self, data: Any) -> AsyncIterator[dict]:
        arrived = self._arrived
        async for x in data:
            yield arrived(x)

    def _ended(self, record: Any, outcome: str) -> None:
        req = request_of(record)
        entry = self.open.pop(req.rid, None) if req is not None else None
        if entry is None:  # not ours, or ended already (a copy of a fanned-out record)
            return
        arrived, ptoks, req = entry
        self.writer.record(arrived, self.pipeline, ptoks, asked_tokens(req, self.max_tokens),
                           output_tokens(req, record, self.usage_field)
                           if outcome == "ok" else None, outcome)

    def output(self, target: Any) -> Callable[[Any], None]:
        """A sink target (list or callable) that ends each record it is given."""
        put = target.append if isinstance(target, list) else target
        ended = self._ended

        def out(record: Any) -> None:
            put(bare(record))
            ended(record, "ok")

        return out

    def error(self, on_error: Callable[[ErrorRecord], None]) -> Callable[[ErrorRecord], None]:
        """``on_error`` that also ends the error record's input."""
        ended = self._ended

        def failed(err: ErrorRecord) -> None:
            on_error(err)
            ended(err.input, "rejected" if err.stage == "admission"
                  and err.error == "AdmissionRejected" else "error")

        return failed

    def drop(self, stage: str, records: list) -> None:
        """The run's ``on_drop``: records that ended without an output or error."""
        for r in records:
            self._ended(r, "ok")

    def finish(self, interrupted: bool) -> None:
        """Write the records that did not end (see the class docstring)."""
        now = perf_counter()
        outcome = "error" if interrupted else "ok"
        for rid in list(self.open):
            # one at a time: an interrupted run's threads may still end records
            entry = self.open.pop(rid, None)
            if entry is not None:
                arrived, ptoks, req = entry
                self.writer.record(arrived, self.pipeline, ptoks,
                                   asked_tokens(req, self.max_tokens), None, outcome, now)
