"""What the HTTP app knows of its hub, worked out once when the app is made.

``AppState.of(hub)`` reads every served plan one time (its OpenAI binding, embed
engine, ``serve:`` spec, token reservation, stream bound) so a request handler only
looks names up; the handlers (``handlers.py``) take the state as their first argument
and keep nothing else between requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from .binding import Binding, accepts, bind, output_tokens, piece_budget
from .embeddings import embed_spec, engine_specs
from .hub import ServingHub
from .openai_wire import WireError
from .responses_store import ResponseLog
from .security import KeyCheck, Redactor, hub_redactor
from .service import PipelineService
from .tenants import Tenant
from .urgency import bounds


@dataclass(frozen=True, slots=True)
class AppState:
    """One app's view of its hub (read-only after ``of``), the mappings by pipeline name:
    ``meta`` is what ``GET /v1/models`` says it accepts, ``embed_specs`` its embed stage's
    engine spec (or None), ``reserve`` the output tokens one record may spend (tenants'
    reservations), ``pieces`` the most text pieces a stream may wait with; ``engines``
    are the embedding engines served by their own name, ``limit`` the largest body in
    bytes, ``started`` the Unix seconds the app was made (the models' ``created``),
    ``responses`` the stored responses of ``/v1/responses`` (the hub's ``responses``)."""

    hub: ServingHub
    bindings: dict[str, Binding]
    meta: dict[str, dict[str, Any]]
    embed_specs: dict[str, dict | None]
    engines: dict[str, dict]
    serves: dict[str, Any]
    reserve: dict[str, int]
    pieces: dict[str, int]
    limit: int
    started: int
    tenants: Any
    keys: KeyCheck
    redact: Redactor
    responses: ResponseLog

    @classmethod
    def of(cls, hub: ServingHub) -> AppState:
        """The state of an app serving ``hub``'s pipelines."""
        plans = {name: s.plan for name, s in hub.services.items()}
        bindings = {name: bind(plan) for name, plan in plans.items()}
        serves = {name: plan.pipeline.serve for name, plan in plans.items()}
        return cls(
            hub=hub, bindings=bindings,
            meta={name: {**accepts(plan, bindings[name]), **bounds(serves[name])}
                  for name, plan in plans.items()},
            embed_specs={name: embed_spec(plan) for name, plan in plans.items()},
            engines={name: spec for name, spec in engine_specs(list(plans.values())).items()
                     if name not in hub.services},
            serves=serves,
            reserve={name: output_tokens(plan) for name, plan in plans.items()},
            pieces={name: piece_budget(plan) for name, plan in plans.items()},
            limit=hub.max_body_bytes, started=int(time.time()), tenants=hub.tenants,
            keys=KeyCheck(hub.api_key, metrics_public=hub.metrics_public,
                          operator_only=hub.tenants is not None),
            redact=hub_redactor(hub), responses=ResponseLog(hub.responses))

    def service(self, name: str) -> PipelineService:
        """The service of pipeline ``name``; 404 naming the served ones."""
        service = self.hub.services.get(name)
        if service is None:
            served = ", ".join(sorted(self.hub.services)) or "none"
            raise WireError(f"pipeline '{name}' is not served here; served: {served}",
                            status=404, code="model_not_found")
        return service

    def tenant_of(self, request: Request) -> Tenant | None:
        """The caller's tenant (a ``--keys-file`` key), None for the hub's own key or no
        key; 401 when a key is needed and missing or wrong."""
        if self.tenants is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() == "bearer" and token:
                tenant = self.tenants.tenant_of(token)
                if tenant is not None:
                    return tenant
        refused = self.keys.bearer(request.headers)  # operator_only: no other key passes
        if refused is not None:
            raise refused
        return None
