"""What a served request can fail with; each error carries its HTTP status.

``RequestFailed`` carries the pipeline's error record; the others say the service
could not take or answer the request (not running, too many waiting, no answer in time).
"""

from __future__ import annotations

from ..api.records import ErrorRecord
from ..errors import TailraceError

#: Error record types that mean the caller's record was unusable (HTTP 400).
BAD_INPUT_ERRORS = frozenset({"FieldError", "ContextOverflow", "InputError"})
#: Error record types -> (HTTP status, code) of ``RequestFailed``; any other is a 500
_STATUS = {"AdmissionRejected": (429, "admission_rejected"),
           "StageTimeout": (504, "stage_timeout"),
           "GateUnavailable": (503, "gate_unavailable"),  # the cluster's gate actor is gone
           # a budgeted route (docs/routing.md): the budget stopped it, or nothing passed
           "BudgetExhausted": (402, "budget_exhausted"),
           "VerificationFailed": (422, "verification_failed"),
           **{e: (400, e) for e in BAD_INPUT_ERRORS}}


class ServiceError(TailraceError):
    """A request the service could not answer; ``status`` is the matching HTTP status.

    message:     what went wrong, in one line.
    status:      HTTP status (400, 402, 422, 429, 500, 503, 504).
    code:        a short machine-readable reason (OpenAI's ``error.code``).
    retry_after: seconds after which a retry may succeed (429/503), else None.
    """

    def __init__(self, message: str, *, status: int = 500, code: str = "server_error",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after

    def __reduce__(self) -> tuple:
        """Pickled (across Ray actors) as its class, message and attributes, whatever
        the subclass's constructor takes."""
        return _rebuild, (type(self), str(self), dict(self.__dict__))


def _rebuild(cls: type[ServiceError], message: str, attrs: dict) -> ServiceError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(attrs)
    return err


class RequestFailed(ServiceError):
    """The pipeline answered with an error record (``.record``) instead of an output."""

    def __init__(self, record: ErrorRecord, retry_after: float | None = None) -> None:
        status, code = _STATUS.get(record.error, (500, record.error))
        super().__init__(f"stage '{record.stage}': {record.error}: {record.message}",
                         status=status, code=code, retry_after=retry_after)
        self.record = record


class ServiceUnavailable(ServiceError):
    """The service is not running (stopped, failed to start, or never started)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503, code="service_unavailable", retry_after=1.0)


class ServiceOverloaded(ServiceError):
    """Too many requests are waiting in this service; retry later."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=429, code="too_many_pending", retry_after=1.0)


class RecordDropped(ServiceError):
    """A ``filter`` stage dropped the request's record: the pipeline has no answer."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=422, code="record_dropped")


class ServiceTimeout(ServiceError):
    """No output and no error record arrived for the request within ``timeout_s``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=504, code="timeout")


class CallerGone(ServiceError):
    """The caller gave up (cancelled, timed out, disconnected) while its request waited
    for admission: its ticket goes straight back and its record ends as this error
    (stage ``admission``) instead of running for nobody."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=499, code="caller_gone")
