"""One engine call as its caller waits on it, and what of its text the caller already has.

``Call``: whoever runs the requests (the llama.cpp decode loop, a pool's loop) fills in
results or fails it and streams through ``emit``; the caller blocks in ``wait``.
``Streamed``: which of a request's text its caller was given, over every attempt (a pool
retry, a rerun one by one, a Ray replay each produce the text from the start again).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, TypeVar

from .base import TokenCallback

_EMPTY = object()
_S = TypeVar("_S", bound=Sequence[Any])


class Call:
    """One caller's ``generate``/``embed``: its results fill in as its requests finish.

    Thread-safe as used: one thread (a decode loop, a pool loop) fills it in while the
    caller waits; ``fail`` may come from either (first failure wins).
    """

    __slots__ = ("results", "remaining", "error", "done", "on_token")

    def __init__(self, n: int, on_token: TokenCallback | None = None):
        """n: requests in the call. on_token: the caller's ``on_token(index, piece)``."""
        self.results: list[Any] = [_EMPTY] * n
        self.remaining = n
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.on_token = on_token
        if n == 0:
            self.done.set()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def complete(self, index: int, output: Any) -> None:
        """Request ``index`` finished with ``output`` (ignored once the call ended, or for
        a request already answered)."""
        if self.done.is_set() or self.results[index] is not _EMPTY:
            return
        self.results[index] = output
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()

    def fail(self, exc: BaseException) -> bool:
        """Fail the call (first failure wins); False if it had already ended."""
        if self.done.is_set():
            return False
        self.error = exc
        self.done.set()
        return True

    def emit(self, index: int, text: str) -> bool:
        """Give request ``index``'s next ``text`` to the caller's callback. False: stop
        generating that request (the call already ended, the callback returned ``False``,
        or it raised, which fails the call)."""
        if self.done.is_set():
            return False
        cb = self.on_token
        if cb is None:
            return True
        try:
            return cb(index, text) is not False
        except Exception as e:  # the caller's callback failed: only its call fails
            self.fail(e)
            return False

    def wait(self) -> list[Any]:
        """Block until the call ends: its results in request order, or its error raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.results


class Streamed:
    """What of one request's streamed output its caller already has, over every attempt.

    ``fresh`` takes the current attempt's text piece by piece (characters); ``restart``
    marks the start of another attempt. ``fresh_at`` is the same for output whose
    position is known (e.g. the n-th piece of a record's stream).
    """

    __slots__ = ("given", "seen")

    def __init__(self) -> None:
        self.given = 0  # output positions handed to the caller, over all attempts
        self.seen = 0  # output positions the current attempt has produced

    def restart(self) -> None:
        """Another attempt begins: it produces its output from the start again."""
        self.seen = 0

    def fresh(self, text: str) -> str:
        """The part of the current attempt's next ``text`` the caller has not had ('' if
        none); it counts as given."""
        start = self.seen
        self.seen = start + len(text)
        return self.fresh_at(start, text)

    def fresh_at(self, start: int, output: _S) -> _S:
        """The part of ``output`` (an attempt's output from position ``start`` on) that
        the caller has not had (empty if none); it counts as given."""
        end = start + len(output)
        if end <= self.given:
            return output[:0]  # type: ignore[return-value]
        new = output[max(self.given - start, 0):]
        self.given = end
        return new  # type: ignore[return-value]
