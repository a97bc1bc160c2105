"""The exception taxonomy. Each class says who caused the failure; all derive from
``TailraceError``.

- ``PlanError``: the pipeline definition is invalid (raised at build/compile time,
  never at run time). The message names the file:line or stage id and the fix.
- ``InputError``: a run input (file, JSONL line) is unreadable or malformed.
- ``StageTimeout``: an operator exceeded its stage's ``timeout_ms``.
- ``RunInterrupted``: the run was stopped by the caller (Ctrl-C / cancellation).
- ``EngineError``: a model engine is misconfigured, missing its model, or failed a call;
  ``ContextOverflow``, one of them: a prompt does not fit in the model's context.
- ``StoreError``: an index or memory store is missing, corrupt or incompatible.
- ``VerificationFailed``: a ``verify`` stage with ``on_fail: error`` judged an answer wrong.

Errors that belong to one layer live beside it: ``operators.common.FieldError`` (a
record lacks a field), ``control.admission.AdmissionRejected`` (over budget),
``serving.errors.ServiceError`` (an HTTP request failed).
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


class StageTimeout(TailraceError):
    """An operator call took longer than its stage's ``timeout_ms``."""


class RunInterrupted(TailraceError):
    """The caller stopped the run before its input was exhausted.

    ``result`` holds what the run had done (partial stats, errors) when it stopped.
    """

    def __init__(self, message: str, result: object = None):
        super().__init__(message)
        self.result = result


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


class VerificationFailed(TailraceError):
    """A ``verify`` stage with ``on_fail: error`` judged a record's answer wrong.

    ``reason`` is the verdict's reason ("AssertionError at line 12", "timeout after 10 s"),
    ``verifier`` the verifier's name; the message is ``"<verifier>: <reason>"``.
    """

    def __init__(self, reason: str, verifier: str = "verifier"):
        self.reason, self.verifier = reason, verifier
        super().__init__(f"{verifier}: {reason}")
