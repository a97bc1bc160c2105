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
    detail:   what the failing operator adds (the exception's ``detail`` dict, e.g. a
              budgeted route's calls and spend), or None.
    """

    stage: str
    input: Any
    error: str
    message: str
    attempts: int = 1
    detail: dict[str, Any] | None = None

    @classmethod
    def from_exception(cls, stage: str, record: Any, exc: BaseException,
                       attempts: int = 1) -> ErrorRecord:
        detail = getattr(exc, "detail", None)
        return cls(stage, record, type(exc).__name__, str(exc), attempts,
                   detail if isinstance(detail, dict) else None)

    def to_dict(self) -> dict[str, Any]:
        """The JSONL form: ``{"error": {...}, "input": record}``."""
        record = self.input
        if isinstance(record, dict) and any(k.startswith("_") for k in record):
            record = {k: v for k, v in record.items() if not k.startswith("_")}  # transient
        error = {"stage": self.stage, "type": self.error, "message": self.message,
                 "attempts": self.attempts}
        if self.detail is not None:
            error["detail"] = self.detail
        return {"error": error, "input": record}
