"""JSONL input and output for ``tailrace run``: nothing read is lost.

A line that is not valid JSON (or not an object) becomes an error record in the
output, is reported as ``FILE:LINE: reason`` and makes the run exit with status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any

from ..api.records import ErrorRecord
from ..errors import InputError
from ..serving.openai_wire import jsonable


class JsonlReader:
    """Iterate dict records from a JSONL file (``-`` for stdin); bad lines are reported
    to ``on_bad(ErrorRecord)`` and kept in ``problems`` as ``FILE:LINE: reason``."""

    def __init__(self, path: str, on_bad: Callable[[ErrorRecord], None]) -> None:
        self.on_bad = on_bad
        self.problems: list[str] = []
        self.name = "<stdin>" if path == "-" else path
        if path != "-":
            try:
                self._f: IO[str] = open(path, encoding="utf-8")  # noqa: SIM115
            except FileNotFoundError:
                raise InputError(f"{path}: no such input file") from None
            except OSError as e:
                raise InputError(f"{path}: cannot read input: {e.strerror}") from None
        else:
            self._f = sys.stdin

    def __iter__(self) -> Iterator[dict[str, Any]]:
        loads = json.loads
        try:
            for lineno, line in enumerate(self._f, 1):
                if not line.strip():
                    continue
                try:
                    rec = loads(line)
                except json.JSONDecodeError as e:
                    self._bad(lineno, line, f"invalid JSON: {e.msg} (column {e.pos + 1})")
                    continue
                if not isinstance(rec, dict):
                    self._bad(lineno, line, f"expected a JSON object, got {_json_type(rec)}")
                    continue
                yield rec
        except UnicodeDecodeError as e:
            self._bad(0, "", f"not UTF-8 text: {e.reason}")
        finally:
            if self._f is not sys.stdin:
                self._f.close()

    def _bad(self, lineno: int, line: str, reason: str) -> None:
        where = f"{self.name}:{lineno}" if lineno else self.name
        self.problems.append(f"{where}: {reason}")
        self.on_bad(ErrorRecord("input", {"line": lineno, "text": line.rstrip("\n")[:1000]},
                                "InputError", f"{where}: {reason}"))


def _json_type(v: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


class JsonlWriter:
    """Write records (and error records) as JSON lines to a file or stdout."""

    def __init__(self, path: str | None) -> None:
        if path and path != "-":
            try:
                self._f: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115
            except OSError as e:
                raise InputError(f"{path}: cannot write output: {e.strerror}") from None
        else:
            self._f = sys.stdout
        self._dumps = json.JSONEncoder(ensure_ascii=False, default=jsonable).encode

    def write(self, record: Any) -> None:
        if isinstance(record, dict) and any(k.startswith("_") for k in record):
            record = {k: v for k, v in record.items() if not k.startswith("_")}  # transient
        self._f.write(self._dumps(record) + "\n")

    def write_error(self, err: ErrorRecord) -> None:
        self.write(err.to_dict())

    def close(self) -> None:
        self._f.flush()
        if self._f is not sys.stdout:
            self._f.close()
