"""A request's session id: which conversation it belongs to, for engine pools that route a
session's requests to the replica that served it before (``dispatch: prefix_affinity``).
A routing hint only (``Request.session``): nothing is kept per session but the pool's
memory of its replica. docs/serving.md has the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .openai_wire import WireError

SESSION_HEADER = "X-Tailrace-Session"
MAX_SESSION_CHARS = 256


def session_of(body: Mapping[str, Any] | None, headers: Mapping[str, str]) -> str | None:
    """The request's session id (the header, else the body's ``user``), or None (neither,
    or empty); 400 naming the field for a value that is not a string of at most 256
    characters.

    >>> session_of({"user": "u-7"}, {})
    'u-7'
    >>> session_of({"user": "u-7"}, {"X-Tailrace-Session": "s-1"})
    's-1'
    """
    raw, where = headers.get(SESSION_HEADER), f"header {SESSION_HEADER}"
    if raw is None and body is not None:
        raw, where = body.get("user"), "'user'"
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str) or len(raw) > MAX_SESSION_CHARS:
        shown = raw if not isinstance(raw, str) else repr(raw[:40])
        raise WireError(f"{where} must be a string of at most {MAX_SESSION_CHARS} "
                        f"characters (a session id), got {shown}", code="invalid_session")
    return raw
