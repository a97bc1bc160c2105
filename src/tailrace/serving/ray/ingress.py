"""What runs in Ray Serve's replicas (shipped there, built against the hub actor found by
name): the ingress deployment, serving the same ``create_app`` as a local server over
``RemoteService`` handles; its bound (``_Outstanding``: one request more is refused with
429 before the hub, so an overload's backlog never piles up, and the one gate's
``max_in_flight`` holds); and ``/healthz`` as a Serve application of its own, routed past
the ingress replicas. Layout and failures: docs/ray.md, "Serving on a cluster".
"""

from __future__ import annotations

import contextlib
from typing import Any

from .hub import remote_hub
from .nodelay import NoDelay, nodelay_for

#: Serve's logging for tailrace's deployments: warnings only, no access log per request
QUIET = {"log_level": "WARNING", "enable_access_log": False}
#: ``/v1/*`` requests an ingress replica holds at once by default (no gate bounding what
#: is in flight); more get 429 at once
MAX_OUTSTANDING = 256
#: with such a gate: this many times its ``max_in_flight``, at least ``MIN_OUTSTANDING``
#: (a longer backlog only waits to be refused and grows memory: bench/serve_ray.py part 3)
OUTSTANDING_PER_IN_FLIGHT = 4
MIN_OUTSTANDING = 32
#: requests Serve may hand a replica beyond its bound: probes and refusals on their way
PROBE_HEADROOM = 64
#: seconds a refused client is told to wait (``Retry-After``)
REFUSED_RETRY_S = 1.0
#: the app on the replica's main loop, not Serve's default second loop in a thread: its
#: handlers never block, and a request saves a thread hand-off each way (~1 ms here)
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
#: Ray options of both deployments' replicas (they reserve no CPU)
REPLICA_OPTIONS = {"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}}


def default_outstanding(max_in_flight: int | None) -> int:
    """The per-replica bound when none is given, sized to a gate's ``max_in_flight``
    (None: nothing bounds what is in flight)."""
    if max_in_flight is None:
        return MAX_OUTSTANDING
    return max(MIN_OUTSTANDING, OUTSTANDING_PER_IN_FLIGHT * max_in_flight)


def build_ingress_app(app_name: str, plans: list[Any], gated: bool,
                      options: dict[str, Any], max_outstanding: int = MAX_OUTSTANDING) -> Any:
    """The FastAPI app of one ingress replica (runs in the replica), over the hub actor
    of Serve application ``app_name`` (``gated``: it has an admission gate; ``options``:
    ``ServingHub``'s)."""
    from starlette.middleware import Middleware

    from ..app import create_app

    app = create_app(remote_hub(app_name, plans, gated, options))
    replica = _replica_id()
    # innermost of the middleware: /metrics counts its refusals, which carry the replica
    app.user_middleware.append(Middleware(_Outstanding, bound=max_outstanding,
                                          replica=replica))
    app.add_middleware(_IngressHeader, replica=replica)
    app.add_middleware(NoDelay)
    return app


class _Outstanding:
    """ASGI middleware: at most ``bound`` ``/v1/*`` requests in this replica at once (each
    counts until its response ends or fails); one more is answered 429 with
    ``Retry-After`` without reading its body. Other paths are never counted nor refused;
    ``replica`` names this one in the refusal."""

    def __init__(self, app: Any, bound: int, replica: str) -> None:
        from ..openai_wire import dumps, error_body, retry_headers

        self.app = app
        self.bound = bound
        self.outstanding = 0
        self.refused = 0
        body = dumps(error_body(
            f"ingress replica {replica} holds {bound} requests (its bound, "
            "--ingress-max-outstanding); retry later", 429, "ingress_busy"))
        self._start = {"type": "http.response.start", "status": 429, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode())
              for k, v in retry_headers(REFUSED_RETRY_S).items())]}
        self._body = {"type": "http.response.body", "body": body}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.outstanding >= self.bound:
            self.refused += 1
            await send(dict(self._start))  # a copy: an outer middleware adds its header
            await send(self._body)
            return
        self.outstanding += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.outstanding -= 1


def _replica_id() -> str:
    from ray import serve

    with contextlib.suppress(Exception):  # outside a Serve replica (tests of the app)
        return str(serve.get_replica_context().replica_id.unique_id)
    return "local"


class _IngressHeader:
    """ASGI middleware: every response names the ingress replica that answered it
    (``X-Tailrace-Ingress``), to tell which requests a replica's failure took down."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (b"x-tailrace-ingress", replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, tagged)


HEALTHZ_BODY = b'{"status":"ok"}'


def healthz_app(app: str) -> str:
    """The Serve application that answers ``/healthz`` for Serve application ``app``."""
    return f"{app}-healthz"


def healthz_deployment() -> Any:
    """The Serve deployment answering ``GET /healthz`` (as ``create_app`` does) in a
    replica of its own, so a probe never queues behind the ingress replicas' work."""
    from ray import serve
    from starlette.responses import Response

    from ..openai_wire import dumps, error_body

    @serve.deployment(name="tailrace-healthz", ray_actor_options=REPLICA_OPTIONS,
                      max_ongoing_requests=PROBE_HEADROOM, health_check_period_s=2,
                      logging_config=QUIET)
    class Healthz:
        def __init__(self) -> None:
            self.port: int | None = None  # the port its first request came in on

        async def __call__(self, request: Any) -> Any:
            if self.port is None:
                self.port = nodelay_for(request.scope)
            if request.url.path.rstrip("/") != "/healthz":
                msg = f"{request.method} {request.url.path}: Not Found"
                return Response(dumps(error_body(msg, 404, "not_found")), status_code=404,
                                media_type="application/json")
            return Response(HEALTHZ_BODY, media_type="application/json")

    return Healthz


def ingress_deployment() -> Any:
    """The Serve deployment class of the ingress (built on demand: imports Serve)."""
    from ray import serve

    @serve.deployment(name="tailrace-ingress", ray_actor_options=REPLICA_OPTIONS,
                      max_ongoing_requests=MAX_OUTSTANDING + PROBE_HEADROOM,
                      health_check_period_s=2, logging_config=QUIET)
    @serve.ingress()
    class Ingress:
        def __init__(self, app_name: str, plans: list[Any], gated: bool,
                     options: dict[str, Any], max_outstanding: int = MAX_OUTSTANDING) -> None:
            self._args = (app_name, plans, gated, options, max_outstanding)

        async def __serve_build_asgi_app__(self) -> Any:
            app = build_ingress_app(*self._args)
            link = app.state.hub.link
            await link.refresh()  # a new replica knows the hub's readiness before serving
            link.start()
            return app

    return Ingress


