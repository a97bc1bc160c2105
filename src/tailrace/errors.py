"""The exception taxonomy. Each class says who caused the failure; all derive from
``TailraceError``.

- ``PlanError``: the pipeline definition is invalid (raised at build/compile time,
  never at run time). The message names the file:line or stage id and the fix.
- ``InputError``: a run input (file, JSONL line) is unreadable or malformed.
- ``FieldError``: a record lacks a field a stage (or its verifier) reads, or is not a dict.
- ``StageTimeout``: an operator exceeded its stage's ``timeout_ms``.
- ``RunInterrupted``: the run was stopped by the caller (Ctrl-C / cancellation).
- ``VerificationFailed``: an answer failed its verifier (``verify``, budgeted ``route``).
- ``BudgetExhausted``: a budgeted ``route`` could not buy a verified answer within the
  record's budget (or declined to try); it says what was spent on which providers.
- ``EngineError``: a model engine is misconfigured, missing its model, or failed a call;
  ``ContextOverflow``, one of them: a prompt does not fit in the model's context.
- ``StoreError``: an index or memory store is missing, corrupt or incompatible.

Errors that belong to one layer live beside it: ``control.admission.AdmissionRejected``
(over budget), ``serving.errors.ServiceError`` (an HTTP request failed).
"""

from __future__ import annotations


class TailraceError(Exception):
    """Base class of every error tailrace raises on purpose."""


class PlanError(TailraceError):
    """The pipeline cannot be compiled: invalid structure, operator or parameter.

    ``where`` is the location (``file.yaml:12`` or ``script.py:34``), ``stage`` the
    stage id when the problem belongs to one stage.
    """

    def __init__(self, message: str, *, where: str | None = None, stage: str | None = None):
        self.where = where
        self.stage = stage
        self.reason = message
        prefix = (f"{where}: " if where else "") + (f"stage '{stage}': " if stage else "")
        super().__init__(prefix + message)


class InputError(TailraceError):
    """A run input is unreadable or malformed (missing file, bad JSONL line)."""


class FieldError(TailraceError):
    """A record lacks a field a stage (or its verifier) reads, or is not a dict."""


class StageTimeout(TailraceError):
    """An operator call took longer than its stage's ``timeout_ms``."""


class RunInterrupted(TailraceError):
    """The caller stopped the run before its input was exhausted.

    ``result`` holds what the run had done (partial stats, errors) when it stopped.
    """

    def __init__(self, message: str, result: object = None):
        super().__init__(message)
        self.result = result


class BudgetExhausted(TailraceError):
    """A budgeted ``route`` stopped before a verified answer: the next provider would
    cost more than the budget has left, or no provider was expected to pay (declined).
    ``spent`` is what the record's calls cost. Not retried (the budget is spent)."""

    retryable = False

    def __init__(self, message: str, spent: float = 0.0):
        super().__init__(message)
        self.spent = spent


class VerificationFailed(TailraceError):
    """An answer failed its verifier (``verify`` with ``on_fail: error``), or no
    provider's answer of a budgeted ``route`` passed; the message gives the reasons.
    A verdict is an outcome, not a fault: a stage's ``retries`` do not repeat it."""

    retryable = False


class EngineError(TailraceError):
    """A model engine is misconfigured, missing its model package, or failed a call."""


class ContextOverflow(EngineError):
    """A prompt (plus ``max_tokens``) does not fit in the model's context window."""


class StructuredOutputError(EngineError):
    """A ``response_format`` the engine cannot turn into a constraint (a JSON schema it
    cannot compile), or a generated answer that does not satisfy it (not JSON, cut by
    ``max_tokens``, or not valid against its JSON schema)."""


class StoreError(TailraceError):
    """A store (vector or live index, memory store, corpus) is missing, corrupt, or
    incompatible with what uses it (e.g. the query embedder)."""
