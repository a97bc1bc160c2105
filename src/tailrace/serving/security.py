"""What the HTTP server guards: who may read what, and what error text may say.

``KeyCheck`` is the hub's API key as the routes check it (a browser opens the dashboard
once with ``?key=KEY`` and then holds a cookie with an HMAC of the key, never the key);
``Redactor`` takes secrets and upstream addresses out of text sent to clients, while the
full text stays in the pipeline's error record. docs/serving.md ("API key and what
errors reveal") says which routes need the key and what is redacted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from .openai_wire import WireError

#: The dashboard's cookie (path ``/dashboard``): an HMAC of the API key.
COOKIE = "tailrace_dashboard"

_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)  # env names
_SECRET_FIELD = re.compile(r"(^|_)(api_?key|key|token|secret|password|passwd|credentials?)$",
                           re.IGNORECASE)  # engine spec fields
# scheme://... up to a space, quote or bracket; trailing punctuation (": ", ". ") stays text
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>()\[\]{},;]*[^\s'\"<>()\[\]{},;.:!?]")
_MIN_SECRET = 6  # shorter values are too common in text to replace ("1", "true")


class KeyCheck:
    """The hub's API key as the routes check it (see the module docstring).

    key:            the API key (None: every route is open).
    metrics_public: ``/metrics`` needs no key even when one is set.
    operator_only:  there is no key but callers hold tenant keys (``--keys-file``): the
                    operator's pages (``/metrics``, ``/dashboard``) stay closed, since a
                    tenant key must not open them, and ``bearer`` passes no request (the
                    caller checks the tenant keys first).
    """

    def __init__(self, key: str | None, *, metrics_public: bool = False,
                 operator_only: bool = False) -> None:
        self._key = key.encode() if key else None
        self.metrics_public = metrics_public
        self.operator_only = operator_only and self._key is None
        self.cookie = (hmac.new(self._key, b"tailrace-dashboard", hashlib.sha256).hexdigest()
                       if self._key else None)

    def _matches(self, token: str) -> bool:
        assert self._key is not None
        return hmac.compare_digest(token.strip().encode(), self._key)

    def bearer(self, headers: Mapping[str, str], *, dashboard: bool = False) -> WireError | None:
        """Why a request with these headers may not pass (401), or None; ``dashboard``:
        the request is for the dashboard (its refusal says how to open it)."""
        if self._key is None and not self.operator_only:
            return None
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            how = ("open /dashboard?key=KEY once (a cookie keeps it) or send the header "
                   "'Authorization: Bearer KEY'" if dashboard
                   else "send the header 'Authorization: Bearer KEY'")
            return WireError(f"missing API key: {how}", status=401, code="missing_api_key")
        if self._key is None or not self._matches(token):
            return WireError("invalid API key", status=401, code="invalid_api_key")
        return None

    def _closed(self, page: str) -> WireError:
        return WireError(f"{page} needs the operator's key, and tenant keys (--keys-file) "
                         "do not open it: start tailrace serve with --api-key-env VAR too",
                         status=401, code="operator_key_required")

    def metrics(self, headers: Mapping[str, str]) -> WireError | None:
        """Why a ``/metrics`` scrape may not pass, or None."""
        if self.metrics_public:
            return None
        return self._closed("/metrics") if self.operator_only else self.bearer(headers)

    def dashboard(self, headers: Mapping[str, str], cookies: Mapping[str, str],
                  query_key: str | None) -> tuple[WireError | None, bool]:
        """(why a dashboard request may not pass or None, whether to set the cookie);
        ``query_key``: its ``?key=`` value, if any."""
        if self.operator_only:
            return self._closed("/dashboard"), False
        if self._key is None:
            return None, False
        if query_key is not None:
            if self._matches(query_key):
                return None, True
            return WireError("invalid API key", status=401, code="invalid_api_key"), False
        got = cookies.get(COOKIE)
        assert self.cookie is not None
        if got is not None and hmac.compare_digest(got.encode(), self.cookie.encode()):
            return None, False
        return self.bearer(headers, dashboard=True), False


class Redactor:
    """Replaces secrets with ``<redacted>`` and URLs / endpoint addresses with ``<url>``.

    secrets: exact values to hide (shorter than 6 characters: ignored).
    hosts:   ``host:port`` (or host) strings of upstream endpoints.
    """

    def __init__(self, secrets: Iterable[str] = (), hosts: Iterable[str] = ()) -> None:
        # longest first, so a value that contains another is replaced whole
        self._secrets = sorted({s for s in secrets if len(s) >= _MIN_SECRET}, key=len,
                               reverse=True)
        self._hosts = sorted({h for h in hosts if h}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            if s in text:
                text = text.replace(s, "<redacted>")
        text = _URL.sub("<url>", text)
        for h in self._hosts:
            if h in text:
                text = text.replace(h, "<url>")
        return text


def _walk(spec: Any, secrets: set[str], hosts: set[str], env: Mapping[str, str]) -> None:
    if isinstance(spec, Mapping):
        for k, v in spec.items():
            name = str(k)
            if isinstance(v, str) and name.endswith("_env") and env.get(v):
                secrets.add(env[v])
            elif isinstance(v, str) and _SECRET_FIELD.search(name):
                secrets.add(v)
            else:
                _walk(v, secrets, hosts, env)
    elif isinstance(spec, (list, tuple)):
        for v in spec:
            _walk(v, secrets, hosts, env)
    elif isinstance(spec, str) and "://" in spec:
        parts = urlsplit(spec)
        hosts.add(spec)
        if parts.netloc:
            hosts.add(parts.netloc.rpartition("@")[2])


def hub_redactor(hub: Any, env: Mapping[str, str] | None = None) -> Redactor:
    """The ``Redactor`` for a hub: its API key, secret environment values, and the
    secrets and endpoints of its pipelines' engine specs (``env``: default
    ``os.environ``)."""
    env = os.environ if env is None else env
    secrets = {v for k, v in env.items() if _SECRET_NAME.search(k) and v}
    if hub.api_key:
        secrets.add(hub.api_key)
    hosts: set[str] = set()
    for service in hub.services.values():
        _walk(service.plan.pipeline.engines, secrets, hosts, env)
    return Redactor(secrets, hosts)
