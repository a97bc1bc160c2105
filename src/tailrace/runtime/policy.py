"""One call of an operator under its stage's timeout and retries.

A stage worker calls ``call_with_policy`` for each record of a ``per_record`` stage and
for each group of a ``collect`` stage; the ``Execution`` the compiler chose says the
timeout, the retries and what a timeout does (docs/design.md, "Timeouts").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..compiler import ABANDON_CAP, Execution
from ..errors import StageTimeout
from ..observability import StageMeter
from ..operators import OpRuntime
from ..request import REQUEST, Cancel, Request, request_of


def _attempt(r: Any, attempts: list) -> Any:
    """``r`` for one attempt under a timeout: its request (one is made for a record
    that has none) gets a cancel of the attempt's own, set when the attempt is
    abandoned and whenever the request's is; the request's reply is shared."""
    if type(r) is not dict:
        return r
    req = request_of(r)
    mine = (replace(req, cancel=req.cancel.child()) if req is not None
            else Request(cancel=Cancel()))
    attempts.append((mine, req))
    return {**r, REQUEST: mine}


def _restore(result: Any, attempts: list) -> Any:
    """Give outputs of a finished attempt their record's own request back (or none)."""
    own = {id(mine): req for mine, req in attempts}
    for r in result if isinstance(result, list) else ():
        q = request_of(r)
        if q is not None and id(q) in own:
            req = own[id(q)]
            if req is None:
                del r[REQUEST]
            else:
                req.streamed = max(req.streamed, q.streamed)
                r[REQUEST] = req
    return result


def per_record_fn(rt: OpRuntime) -> Callable[[Any], Any]:
    """One record -> its outputs; a batch-only operator's failure for that record is
    raised (so timeouts and retries apply to it), never dropped."""
    if rt.record_fn is not None:
        return rt.record_fn
    batch_fn = rt.batch_fn
    if batch_fn is None:  # identity
        return lambda x: [x]

    def one(x: Any) -> Any:
        errs: list = []
        out = batch_fn([x], errs)
        if errs:
            raise errs[0][1]
        return out

    return one


async def call_with_policy(x: Execution, rt: OpRuntime, meter: StageMeter, arg: Any,
                           run_blocking: Callable | None,
                           fn: Callable[[Any], Any] | None = None) -> Any:
    """Call the operator on ``arg`` honouring the stage's timeout and retries (``x``).

    Returns the result, or raises the last exception with ``attempts`` set on it.
    ``run_blocking(fn, arg)`` runs sync code in a worker thread (None: inline).
    ``fn``: a synchronous call to make instead of the operator's own (a whole batch).
    A timed-out async attempt is cancelled, a blocking one abandoned with its request's
    cancel set; a retry never overlaps it, and a replica with ``ABANDON_CAP`` abandoned
    attempts still running refuses new calls (docs/design.md, "Timeouts").
    """
    timeout = x.timeout_ms / 1000.0 if x.timeout_ms is not None else None
    is_async = rt.is_async and fn is None
    call = fn if fn is not None else per_record_fn(rt)
    attempts = 0
    running: asyncio.Future | None = None  # an abandoned attempt still in its thread
    while True:
        attempts += 1
        try:
            if is_async:
                if timeout is None:
                    return await call(arg)
                # not asyncio.wait_for: on 3.11 it can swallow a cancellation (Ctrl-C)
                # that arrives as the awaited call completes
                async with asyncio.timeout(timeout):
                    return await call(arg)
            if run_blocking is None:
                return call(arg)
            if timeout is None:
                return await run_blocking(call, arg)
            if running is not None and not running.done():
                await asyncio.wait({running}, timeout=timeout)
                if not running.done():
                    raise StageTimeout(
                        f"an earlier attempt is still running {2 * timeout * 1000:g} ms after "
                        "it started; not retried, so two attempts never overlap")
            abandoned = rt.abandoned
            if abandoned >= ABANDON_CAP:
                raise StageTimeout(
                    f"{abandoned} earlier calls of this replica are still running past "
                    f"timeout_ms={x.timeout_ms:g} (the operator ignores cancellation); "
                    "refusing new calls until one returns")
            # a map or branch call gets a cancel of its own per attempt (``arg``: a record
            # or a list of them); a batch window's records are handed over untouched
            tries: list[tuple[Request, Request | None]] = []  # (attempt's, record's own)
            call_arg = arg
            if rt.kind != "collect":
                call_arg = ([_attempt(r, tries) for r in arg] if isinstance(arg, list)
                            else _attempt(arg, tries))
            fut = asyncio.ensure_future(run_blocking(call, call_arg))
            try:
                done, _ = await asyncio.wait({fut}, timeout=timeout)
            except asyncio.CancelledError:  # the run is ending (Ctrl-C): stop the call too
                for mine, _ in tries:
                    mine.cancel.set()
                raise
            if fut in done:
                return _restore(fut.result(), tries)
            for mine, _ in tries:
                mine.cancel.set()
            rt.abandoned = abandoned + 1
            fut.add_done_callback(lambda f, rt=rt: _returned(rt, f))
            running = fut
            raise TimeoutError
        except TimeoutError:
            meter.timeouts += 1
            last: BaseException = StageTimeout(
                f"operator took longer than timeout_ms={x.timeout_ms:g}")
        except StageTimeout as e:  # refused: retrying now would not help
            e.attempts = attempts  # type: ignore[attr-defined]
            raise
        except Exception as e:  # noqa: BLE001 - operator code may raise anything
            last = e
            if getattr(e, "retryable", True) is False:  # an outcome, not a fault: a budget
                e.attempts = attempts  # type: ignore[attr-defined]  # spent, a verdict given
                raise
        if attempts > x.retries:
            last.attempts = attempts  # type: ignore[attr-defined]
            raise last
        meter.retries += 1


def _returned(rt: OpRuntime, fut: asyncio.Future) -> None:
    """An abandoned attempt came back: it no longer counts against the cap."""
    rt.abandoned -= 1
    if not fut.cancelled():
        fut.exception()  # retrieved: its late failure is not "never retrieved"
