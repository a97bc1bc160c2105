"""``ServingHub``: the served pipelines of one process, their shared admission gate,
API key and request limits (what ``create_app`` serves)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ..errors import PlanError
from .service import PipelineService


class ServingHub:
    """The services of one process, their shared admission gate and the API key.

    services:       the services (or a mapping name -> service); names must be unique.
    gate:           the shared ``AdmissionGate`` (None: admit everything).
    api_key:        bearer token required on ``/v1/*``, ``/metrics`` and ``/dashboard``
                    (None: no authentication); ``/healthz`` and ``/readyz`` stay open.
    max_body_bytes: largest request body accepted (HTTP 413 above it).
    metrics_public: serve ``/metrics`` without the key (for Prometheus scrapers that
                    cannot send one); nothing else opens.
    tenants:        API keys mapped to tenants (``serving.tenants.TenantKeys``): with it,
                    ``/v1/*`` needs one of them (or ``api_key``); a tenant key sets the
                    ``serve.tenant`` field and is held to its tenant's limits.
    responses:      where and how long ``/v1/responses`` keeps responses
                    (``serving.responses_store.Retention``; None: its defaults, SQLite at
                    ``$TAILRACE_HOME/memory.sqlite`` for 30 days).
    """

    def __init__(self, services: Iterable[PipelineService] | dict[str, PipelineService], *,
                 gate: Any = None, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, metrics_public: bool = False,
                 tenants: Any = None, responses: Any = None) -> None:
        items = list(services.values()) if isinstance(services, dict) else list(services)
        self.services: dict[str, PipelineService] = {}
        for s in items:
            if s.name in self.services:
                raise PlanError(f"two pipelines are named '{s.name}'; each served pipeline "
                                "needs its own 'pipeline:' name")
            self.services[s.name] = s
        if type(max_body_bytes) is not int or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got "
                             f"{max_body_bytes!r}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string or None")
        self.gate = gate
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics_public = bool(metrics_public)
        self.tenants = tenants
        self.responses = responses

    @property
    def ready(self) -> bool:
        """True when every service is ready."""
        return all(s.ready for s in self.services.values())

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> ServingHub:
        """Start every service not started yet (engines load in the background), each on
        a thread of its own, or on ``loop``: the running loop this is called from
        (``PipelineService.start``)."""
        for s in self.services.values():
            if not s.started:
                s.start(loop)
        return self

    async def aclose(self, timeout: float = 30.0) -> None:
        """``stop`` from inside a running loop: drain every service (at most ``timeout``
        seconds each), then close the gate."""
        for s in self.services.values():
            await s.aclose(timeout)
        if self.gate is not None and hasattr(self.gate, "close"):
            self.gate.close()

    def stop(self, timeout: float = 30.0) -> None:
        """Drain (at most ``timeout`` seconds each) and stop every service, then close
        the gate."""
        for s in self.services.values():
            s.stop(timeout)
        if self.gate is not None and hasattr(self.gate, "close"):
            self.gate.close()

    def pools(self) -> dict[str, Any]:
        """The ``statistics()`` of this process's engine pools (and engines keeping any)."""
        from ..engines import statistics

        return statistics()
