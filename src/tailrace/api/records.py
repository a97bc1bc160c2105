"""Records that describe failures; every input yields an output or one of these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ErrorRecord:
    """A record that a stage could not process.

    stage:    the id of the stage that failed.
    input:    the record the stage received (unchanged).
    error:    the exception's type name (``ValueError``, ``StageTimeout``, ...).
    message:  the exception's message.
    attempts: how many times the operator was tried (1 + retries used).
    """

    stage: str
    input: Any
    error: str
    message: str
    attempts: int = 1

    @classmethod
    def from_exception(cls, stage: str, record: Any, exc: BaseException,
                       attempts: int = 1) -> ErrorRecord:
        return cls(stage, record, type(exc).__name__, str(exc), attempts)

    def to_dict(self) -> dict[str, Any]:
        """The JSONL form: ``{"error": {...}, "input": record}``."""
        record = self.input
        if isinstance(record, dict) and any(k.startswith("_") for k in record):
            record = {k: v for k, v in record.items() if not k.startswith("_")}  # transient
        return {"error": {"stage": self.stage, "type": self.error, "message": self.message,
                          "attempts": self.attempts}, "input": record}
