"""Following a JSONL file like ``tail -f``: a reader, a source, and a feeder thread.

``JsonlTail`` reads the complete JSON lines appended since its last read;
``follow_jsonl`` turns a file into a pipeline source that never ends until told to;
a ``Feeder`` is the thread behind ``semantic_state``'s ``follow:`` that tails a file into
a live index, one feeder per (index, file) in the process.

>>> import tempfile
>>> path = tempfile.mkdtemp() + "/news.jsonl"
>>> tail = JsonlTail(path)
>>> with open(path, "w") as f:
...     _ = f.write('{"id": 1}\\n{"id": 2}\\n{"id":')
>>> tail.read(10)
[({'id': 1}, 10), ({'id': 2}, 20)]
>>> tail.read(10)  # the last line waits for its newline
[]
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..registry import Registry

_LOG = logging.getLogger(__name__)

Ingest = Callable[[list, list, dict], object]


class JsonlTail:
    """The complete JSON lines appended to a file since the last read (``tail -f``).

    A partial last line waits for its newline; a file that shrank below the offset was
    replaced and is read again from its start; a line that is not a JSON object is
    skipped, counted in ``bad_lines`` and described in ``last_problem``.
    """

    def __init__(self, path: str, offset: int = 0) -> None:
        """Start reading ``path`` (it may not exist yet) at byte ``offset`` (a saved cursor)."""
        self.path = path
        self.offset = offset
        self.bad_lines = 0
        self.last_problem = ""

    def read(self, max_lines: int) -> list[tuple[dict, int]]:
        """Up to ``max_lines`` new records, each with the file offset just after it."""
        try:
            size = os.path.getsize(self.path)
        except FileNotFoundError:
            return []
        if size < self.offset:
            _LOG.warning("%s shrank below offset %d: reading it again from the start",
                         self.path, self.offset)
            self.offset = 0
        if size == self.offset:
            return []
        out: list[tuple[dict, int]] = []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while len(out) < max_lines:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break  # nothing more, or a line still being written
                start, self.offset = self.offset, self.offset + len(line)
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    rec = e
                if not isinstance(rec, dict):
                    self.bad_lines += 1
                    self.last_problem = f"{self.path}: line at byte {start} is not a JSON object"
                    _LOG.warning("%s; skipped", self.last_problem)
                    continue
                out.append((rec, self.offset))
        return out


class follow_jsonl:  # noqa: N801 - used like a generator function
    """The records of a JSONL file, then those appended to it, until ``stop`` is set.

    Iterable (blocking) and async-iterable: a pipeline source gets each record as soon
    as it is read, e.g. ``p.source(follow_jsonl("news.jsonl", stop=ev))``.
    """

    def __init__(self, path: str, *, poll_s: float = 0.05,
                 stop: threading.Event | None = None, offset: int = 0) -> None:
        """Follow ``path`` (it may not exist yet) from byte ``offset``, looking at its end
        every ``poll_s`` seconds, until the event ``stop`` is set (None: forever)."""
        self.tail = JsonlTail(path, offset)
        self.poll_s = poll_s
        self.stop = stop or threading.Event()

    def __iter__(self) -> Iterator[dict]:
        while not self.stop.is_set():
            got = self.tail.read(256)
            yield from (rec for rec, _ in got)
            if not got:
                self.stop.wait(self.poll_s)

    async def __aiter__(self) -> AsyncIterator[dict]:
        while not self.stop.is_set():
            got = self.tail.read(256)
            for rec, _ in got:
                yield rec
            if not got:
                await asyncio.sleep(self.poll_s)


@dataclass(frozen=True)
class FeederStats:
    """What a follow feeder has done: lines ingested, bad lines, polls, batch times."""

    path: str
    offset: int
    lines: int
    bad_lines: int
    errors: int
    polls: int
    max_batch_ms: float
    failure: str | None


class Feeder:
    """A thread that tails a JSONL file into a live index until the index closes."""

    def __init__(self, index: Any, ingest: Ingest, path: str, poll_s: float,
                 max_batch: int) -> None:
        """Start following ``path`` from the offset saved in the live index's ``cursor``
        (if the same file), every ``poll_s`` seconds, at most ``max_batch`` lines a change;
        ``ingest(records, errors, cursor)`` (``Ingester.ingest``) applies records to the
        index, saving ``cursor`` with the change."""
        self.path = os.path.abspath(path)
        self.key = "follow:" + self.path
        self.tail = JsonlTail(self.path, int(index.cursor.get(self.key, 0)))
        self.ingest, self.poll_s, self.max_batch = ingest, poll_s, max_batch
        self.caught_up = threading.Event()
        self.polls = self.lines = self.errors = 0
        self.max_batch_s = 0.0
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"tailrace-follow-{os.path.basename(path)}")
        index.on_close(self.stop)
        self._thread.start()

    def _loop(self) -> None:
        errors: list = []
        try:
            while not self._stop.is_set():
                got = self.tail.read(self.max_batch)
                if got:
                    t0 = time.perf_counter()
                    cursor = {self.key: got[-1][1]}
                    self.ingest([r for r, _ in got], errors, cursor)
                    self.max_batch_s = max(self.max_batch_s, time.perf_counter() - t0)
                    self.lines += len(got)
                    for r, e in errors:
                        _LOG.warning("%s: document %r skipped: %s", self.path, r, e)
                    self.errors += len(errors)
                    errors.clear()
                self.polls += 1
                if len(got) < self.max_batch:
                    self.caught_up.set()
                    self._stop.wait(self.poll_s)
        except BaseException as e:  # noqa: BLE001 - reported to the stage's records
            self.failure = e
            _LOG.error("feeder for %s failed: %s", self.path, e)
        finally:
            self.caught_up.set()

    @property
    def running(self) -> bool:
        """True until the feeder was stopped or failed."""
        return not self._stop.is_set() and self.failure is None

    def stop(self) -> None:
        """Stop following and wait for the batch in progress."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def statistics(self) -> FeederStats:
        """A snapshot of the feeder's counters."""
        return FeederStats(self.path, self.tail.offset, self.lines, self.tail.bad_lines,
                           self.errors, self.polls, self.max_batch_s * 1000,
                           None if self.failure is None else str(self.failure))


_FEEDERS: Registry[Feeder] = Registry("feeders", close=Feeder.stop)


def feeder_for(index: Any, path: str) -> Feeder | None:
    """The running feeder of the live index ``index`` that follows ``path``, if any."""
    return _FEEDERS.peek((id(index), os.path.abspath(path)))


def start_feeder(index: Any, ingest: Ingest, path: str, poll_s: float, max_batch: int) -> Feeder:
    """The feeder of ``index`` following ``path``: the running one, else a new one
    (arguments as for ``Feeder``); it leaves the registry when the index closes."""
    key = (id(index), os.path.abspath(path))

    def make() -> Feeder:
        feeder = Feeder(index, ingest, path, poll_s, max_batch)
        index.on_close(lambda: _FEEDERS.pop(key))
        return feeder

    return _FEEDERS.get(key, make, reuse=lambda f: f.running)
