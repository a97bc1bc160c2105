"""``ClusterServer``: a served job on a Ray cluster, started and stopped as one thing
from the caller's process (``tailrace serve --runtime ray``), and taken down also after
a start that failed half-way or a cluster that stopped answering.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ServiceUnavailable
from .hub import HUB_CONCURRENCY, NAMESPACE, HubActor, hub_name
from .ingress import (
    MAX_OUTSTANDING,
    PROBE_HEADROOM,
    QUIET,
    healthz_app,
    healthz_deployment,
    ingress_deployment,
)
from .proxy import check_proxy, choose_proxy, controller_env, machines


class ClusterServer:
    """A served job on Ray: the hub actor, a Serve application of ingress replicas
    behind Serve's HTTP proxy on the head node, and the ``/healthz`` application.

    plans:            compiled plans, one per pipeline (unique names).
    host, port:       where Serve's proxy listens (a running Serve keeps its own).
    ingress_replicas: ingress replicas, or
    autoscale:        ``(min, max)``: Serve's ``autoscaling_config`` on
                      ``target_ongoing`` requests per replica (``autoscaling``: more keys).
    gate_factory:     builds the admission gate in the hub actor (None: admit all).
    app_name:         the Serve application (and hub actor) name.
    max_outstanding:  ``/v1/*`` requests each ingress replica holds; more get 429.
    proxy:            ``haproxy`` or ``python`` if tailrace starts Serve (None:
                      ``choose_proxy``'s); ``proxy_used`` says which (or ``running``).
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
        check_proxy(proxy)
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
        dep = app.deployments.get("tailrace-ingress") if app is not None else None
        if dep is None:
            return 0
        return sum(n for state, n in dep.replica_states.items()
                   if getattr(state, "value", state) == "RUNNING")

    def stop(self, timeout: float = 30.0) -> None:
        """Drain the pipelines (at most ``timeout`` s), delete the Serve applications and
        the hub actor, and shut Serve down if ``start`` started it; also after a failed
        ``start``. A second call does nothing."""
        import ray
        from ray import serve

        if self.hub is not None:
            with contextlib.suppress(Exception):  # the hub may be gone already
                ray.get(self.hub.drain.remote(timeout), timeout=timeout + 10)
        if self._deployed:
            # Serve waits for its controller, which a lost cluster never answers
            deleting = threading.Thread(target=_delete_apps, args=(
                [self.app_name, healthz_app(self.app_name)],), name="tailrace-serve-delete",
                daemon=True)
            deleting.start()
            deleting.join(timeout)
        if self.hub is not None:
            _quietly(ray.kill, self.hub)
            self.hub = None
        if self._started_serve:  # Serve was started for this server: nothing left behind
            _quietly(serve.shutdown)
        self._deployed = self._started_serve = False


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
