"""Who is asking: what a pipeline's ``serve.fields`` takes from one request
(``request_fields``), and API keys mapped to tenants with per-tenant limits
(``TenantKeys``, from ``tailrace serve --keys-file``): token buckets of requests (burst:
one second's worth, at least 1) and of tokens (burst: one minute's worth), compared in
constant time, every key each time. docs/serving.md, "Who is asking".
"""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..api import ServeSpec
from ..errors import TailraceError
from .openai_wire import WireError


def request_fields(serve: ServeSpec | None, body: Mapping[str, Any],
                   headers: Mapping[str, str]) -> dict[str, Any]:
    """The record fields ``serve.fields`` takes from one request; 400 for a source of
    the wrong type (``user`` or a ``metadata`` value that is not a string). ``body``:
    the OpenAI request's JSON object, or the /runs record."""
    if serve is None or not serve.fields:
        return {}
    out: dict[str, Any] = {}
    for field, src in serve.fields:
        if src.startswith("header:"):
            value = headers.get(src[7:].strip().lower())
        elif src == "user":
            value = body.get("user")
        else:
            meta = body.get("metadata")
            if meta is not None and not isinstance(meta, dict):
                raise WireError("'metadata' must be an object of string values",
                                code="invalid_metadata")
            value = meta.get(src[9:]) if meta else None
        if value is None:
            continue
        if not isinstance(value, str):
            raise WireError(f"'{src}' must be a string (the pipeline maps it to the record "
                            f"field '{field}'), got {type(value).__name__}",
                            code="invalid_parameter")
        out[field] = value
    return out


class _Bucket:
    """A token bucket: ``rate`` per second, holding at most ``burst``."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.clock = clock
        self.at = clock()

    def take(self, n: float) -> float | None:
        """Take ``n`` (capped at the burst); None if taken, else seconds until it can be."""
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        n = min(n, self.burst)
        if self.level >= n:
            self.level -= n
            return None
        return (n - self.level) / self.rate

    def give_back(self, n: float) -> None:
        self.level = min(self.burst, self.level + min(n, self.burst))


@dataclass(frozen=True)
class Tenant:
    """One keys-file entry: the tenant's name and its limits (None: unlimited)."""

    name: str
    requests_per_s: float | None = None
    tokens_per_min: float | None = None


class TenantKeys:
    """API keys mapped to tenants, with per-tenant limits (see the module docstring).

    keys:  API key -> ``Tenant``.
    clock: monotonic seconds (tests inject one).
    """

    def __init__(self, keys: Mapping[str, Tenant],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._keys = [(k.encode(), t) for k, t in keys.items()]
        self._lock = threading.Lock()
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        for t in keys.values():
            if t.requests_per_s is not None and t.name not in self._requests:
                self._requests[t.name] = _Bucket(t.requests_per_s,
                                                 max(1.0, t.requests_per_s), clock)
            if t.tokens_per_min is not None and t.name not in self._tokens:
                self._tokens[t.name] = _Bucket(t.tokens_per_min / 60.0, t.tokens_per_min,
                                               clock)

    def __len__(self) -> int:
        return len(self._keys)

    def __reduce__(self) -> Any:
        """Pickled (to a Ray Serve ingress replica) as its keys, with full buckets."""
        return TenantKeys, ({k.decode(): t for k, t in self._keys},)

    @property
    def limited(self) -> bool:
        """Whether any tenant has a request or token limit."""
        return bool(self._requests or self._tokens)

    def tenant_of(self, token: str) -> Tenant | None:
        """The tenant whose key is ``token``, or None (every key is compared)."""
        given = token.strip().encode()
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(given, key):
                found = tenant
        return found

    def admit(self, tenant: Tenant, tokens: int) -> None:
        """Charge one request of ``tokens`` approximate tokens to ``tenant``; 429 with
        ``Retry-After`` when a limit is reached (nothing is charged then)."""
        with self._lock:
            req = self._requests.get(tenant.name)
            wait = req.take(1) if req is not None else None
            if wait is not None:
                raise WireError(f"tenant '{tenant.name}' is over its limit of "
                                f"{tenant.requests_per_s:g} requests/s; retry after "
                                f"{wait:.2f} s", status=429, code="rate_limit_exceeded",
                                retry_after=wait)
            tok = self._tokens.get(tenant.name)
            wait = tok.take(tokens) if tok is not None else None
            if wait is not None:
                if req is not None:
                    req.give_back(1)
                raise WireError(f"tenant '{tenant.name}' is over its limit of "
                                f"{tenant.tokens_per_min:g} tokens/min (this request "
                                f"reserves {tokens}); retry after {math.ceil(wait)} s",
                                status=429, code="rate_limit_exceeded", retry_after=wait)


def _number(entry: Mapping[str, Any], name: str, where: str) -> float | None:
    v = entry.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
            or not math.isfinite(v):
        raise TailraceError(f"{where}: '{name}' must be a positive number, got {v!r}")
    return float(v)


def load_keys(path: str) -> TenantKeys:
    """Read a keys file (JSON or YAML): ``{KEY: {tenant: NAME, requests_per_s: N,
    tokens_per_min: N}}`` (limits optional). TailraceError naming the file and the entry
    (by its tenant or position, never the key) when it is malformed."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TailraceError(f"--keys-file {path}: cannot read it: "
                            f"{e.strerror or e}") from None
    try:
        doc = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TailraceError(f"--keys-file {path}: not valid JSON/YAML: {first}") from None
    if not isinstance(doc, dict) or not doc:
        raise TailraceError(f"--keys-file {path}: expected a mapping of API key -> "
                            "{tenant: NAME, requests_per_s: N, tokens_per_min: N}")
    keys: dict[str, Tenant] = {}
    for i, (key, entry) in enumerate(doc.items(), 1):
        where = f"--keys-file {path}: entry {i}"
        if not isinstance(key, str) or len(key.strip()) < 8 or key != key.strip():
            raise TailraceError(f"{where}: the key must be a string of at least 8 "
                                "characters without surrounding spaces")
        if not isinstance(entry, dict):
            raise TailraceError(f"{where}: expected {{tenant: NAME, requests_per_s: N, "
                                f"tokens_per_min: N}}, got {type(entry).__name__}")
        name = entry.get("tenant")
        if not isinstance(name, str) or not name:
            raise TailraceError(f"{where}: 'tenant' must be a non-empty string")
        where = f"--keys-file {path}: entry {i} (tenant '{name}')"
        unknown = sorted(str(k) for k in entry if k not in
                         ("tenant", "requests_per_s", "tokens_per_min"))
        if unknown:
            raise TailraceError(f"{where}: unknown field '{unknown[0]}' (allowed: tenant, "
                                "requests_per_s, tokens_per_min)")
        keys[key] = Tenant(name, _number(entry, "requests_per_s", where),
                           _number(entry, "tokens_per_min", where))
    return TenantKeys(keys)
