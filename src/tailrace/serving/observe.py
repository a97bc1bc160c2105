"""Observability of a serving hub: ``/metrics``, ``/dashboard`` and request tracing.

``install_observability(app, hub)`` (called at the end of ``create_app``) mounts
``/metrics`` (Prometheus text read at scrape time), ``/dashboard`` (a static page,
``static/``, polling ``/dashboard/data``) and a ``/v1/*`` middleware that times each
request and, while tracing is on, opens its server span (docs/observability.md).
Everything here reads statistics snapshots; nothing runs per record.
"""

from __future__ import annotations

import time
from functools import partial
from importlib import resources
from time import perf_counter
from typing import Any
from urllib.parse import urlencode

from ..observability import Histogram
from ..observability.prometheus import (
    HttpMeter,
    PipelineScrape,
    Scrape,
    StageHistograms,
    TailraceCollector,
    merged,
)
from ..observability.tracing import STATE as TRACING
from ..observability.tracing import configure_tracing, request_span
from ..observability.tracing import enabled as tracing_enabled
from .security import COOKIE, KeyCheck

#: The dashboard's files, served from memory (no directory is exposed).
STATIC = {"dashboard.html": "text/html; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8",
          "dashboard.js": "text/javascript; charset=utf-8"}


def _pools(hub: Any) -> list[Any]:
    """Engine pool statistics that describe replicas (``PoolStatistics``)."""
    pools = hub.pools()
    if isinstance(pools, dict):
        pools = list(pools.values())
    return [p for p in pools if hasattr(p, "replicas") and hasattr(p, "queued")]


def _admission(hub: Any) -> Any:
    stats = getattr(hub.gate, "statistics", None)
    return stats() if callable(stats) else None


def _depths(service: Any) -> dict[str, int]:
    """Records queued now at each operator that has an input queue, by operator id."""
    by_stage = service.queue_depths() if callable(getattr(service, "queue_depths", None)) \
        else {}
    return {s.ops[0].id: by_stage[s.id] for s in service.plan.stages if s.id in by_stage}


def stage_histograms(run: Any) -> dict[str, StageHistograms]:
    """Operator id -> its live histograms merged over replicas, read from a ``LocalRun``."""
    out: dict[str, StageHistograms] = {}
    workers = getattr(run, "workers", None)  # another runtime: no live meters here
    if not isinstance(workers, dict):
        return out
    for ws in list(workers.values()):
        for i, meter in enumerate(ws[0].meters):
            ms = [w.meters[i] for w in ws]
            out[meter.stage] = StageHistograms(merged(m.queue_wait for m in ms),
                                               merged(m.service for m in ms),
                                               merged(m.batch_size for m in ms))
    return out


def scrape(hub: Any, http: HttpMeter | None = None) -> Scrape:
    """What ``/metrics`` reports now (``http``: the app's HTTP meter, if any)."""
    pipelines = []
    for svc in list(hub.services.values()):
        run = getattr(svc, "local_run", None) or getattr(svc, "_run", None)  # live meters
        latency = getattr(run, "latency", None)
        pipelines.append(PipelineScrape(
            svc.name, bool(svc.ready), svc.stats(), stage_histograms(run), _depths(svc),
            latency if isinstance(latency, Histogram) else None,
            dict(getattr(svc, "spend", None) or {})))
    from ..operators.allocate import ledgers

    return Scrape(tuple(pipelines), _admission(hub), tuple(_pools(hub)), http, ledgers())


# -- dashboard data ----------------------------------------------------------------------

def _graph(plan: Any) -> tuple[list[dict], list[dict]]:
    """Nodes (one per operator) and edges of a plan, fused hand-offs marked."""
    nodes, edges = [], []
    last = {s.id: s.ops[-1].id for s in plan.stages}
    for s in plan.stages:
        source = s.ops[0].op.kind == "source"
        for i, o in enumerate(s.ops):
            nodes.append({"id": o.id, "op": o.op.name, "stage": s.id, "replicas": s.replicas,
                          "fused": len(s.ops) > 1,
                          "bound": s.queue if i == 0 and not source else 0})
            if i:
                edges.append({"from": s.ops[i - 1].id, "to": o.id, "port": None,
                              "fused": True})
        for ref in s.upstream:
            src, _, port = ref.partition(".")
            edges.append({"from": last[src], "to": s.ops[0].id, "port": port or None,
                          "fused": False})
    return nodes, edges


def arrivals(stats: Any) -> int:
    """Records that entered a pipeline so far (a live run counts them at its sources)."""
    return max(stats.records_in, sum(s.records_out for s in stats.stages if s.op == "source"))


def _pipeline_data(svc: Any) -> dict[str, Any]:
    stats = svc.stats()
    by_id = {s.stage: s for s in stats.stages}
    depths = _depths(svc)
    nodes, edges = _graph(svc.plan)
    parts = []
    for n in nodes:
        s = by_id.get(n["id"])
        q, v = (s.queue_wait_us, s.service_us) if s is not None else (None, None)
        n.update({
            "records_in": s.records_in if s else 0, "records_out": s.records_out if s else 0,
            "errors": s.errors if s else 0,
            "wait_p50_us": q.p50 if q else 0.0, "wait_p99_us": q.p99 if q else 0.0,
            "svc_p50_us": v.p50 if v else 0.0, "svc_p99_us": v.p99 if v else 0.0,
            "batch_mean": s.batch_size.mean if s else 0.0,
            "depth": depths.get(n["id"], 0), "max_depth": s.max_queue_depth if s else 0,
            "counters": dict(s.counters) if s else {}})
        if n["op"] != "source":
            parts.append({"id": n["id"],
                          "wait_us": n["wait_p99_us"] if n["bound"] else 0.0,
                          "svc_us": n["svc_p99_us"]})
        else:  # a source's records are in as soon as they are out
            n["records_in"] = n["records_out"]
    # Percentiles do not add up exactly; the bar spans the larger of the end-to-end p99 and
    # the stages' sum, and time outside every stage (admission queue, hand-offs) shows too.
    staged = sum(p["wait_us"] + p["svc_us"] for p in parts)
    e2e = stats.latency_us.p99
    total = max(staged, e2e)
    for p in parts:
        p["share"] = (p["wait_us"] + p["svc_us"]) / total if total > 0 else 0.0
    return {"name": svc.name, "ready": bool(svc.ready), "records_in": arrivals(stats),
            "records_out": stats.records_out, "errors": stats.errors,
            "latency_p50_us": stats.latency_us.p50, "latency_p99_us": stats.latency_us.p99,
            "nodes": nodes, "edges": edges,
            "p99": {"parts": parts, "staged_us": staged, "total_us": total,
                    "outside_us": max(0.0, e2e - staged),
                    "outside_share": max(0.0, e2e - staged) / total if total > 0 else 0.0}}


def _http_data(http: HttpMeter | None) -> list[dict[str, Any]]:
    if http is None:
        return []
    statuses = list(http.statuses.items())
    out = []
    for (method, route), h in sorted(list(http.durations.items())):
        st = h.statistics()
        codes = {str(code): n for (m, r, code), n in statuses if (m, r) == (method, route)}
        out.append({"method": method, "route": route, "count": st.count, "p50_us": st.p50,
                    "p99_us": st.p99, "statuses": codes})
    return out


def dashboard_data(hub: Any, http: HttpMeter | None = None) -> dict[str, Any]:
    """The JSON the dashboard polls: per pipeline its graph and live per-stage figures,
    plus admission, engine pool and HTTP figures."""
    a = _admission(hub)
    admission = None if a is None else {
        "policy": a.policy, "admitted": a.admitted, "completed": a.completed,
        "rejected": sum(a.rejected.values()), "rejected_by_reason": dict(a.rejected),
        "queued": a.queued, "in_flight": a.in_flight, "mean_wait_s": a.mean_wait}
    pools = []
    for p in _pools(hub):
        live = [r for r in p.replicas if r.healthy and not r.down]
        busy = sum(1 for r in live if r.in_flight > 0)
        pools.append({"name": p.name, "up": len(live), "busy": busy,
                      "utilization": busy / len(live) if live else 0.0, "queued": p.queued,
                      "batches": p.batches, "mean_batch_size": p.mean_batch_size,
                      "replicas": [{"id": r.id, "healthy": r.healthy and not r.down,
                                    "in_flight": r.in_flight,
                                    "outstanding": r.outstanding_work,
                                    "prompt_tokens": r.prompt_tokens,
                                    "cached_tokens": r.cached_tokens,
                                    "cache_hit_ratio": r.cache_hit_ratio}
                                   for r in p.replicas]})
    return {"now": time.time(),
            "pipelines": [_pipeline_data(s) for s in list(hub.services.values())],
            "admission": admission, "pools": pools, "http": _http_data(http)}


# -- tracing -------------------------------------------------------------------------------

#: Routes metered by name; other paths under /v1/ count as ``/v1/{other}``.
_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses"})


def route_of(path: str) -> str:
    """A low-cardinality route name for a ``/v1/`` path (pipeline names become ``{name}``)."""
    if path in _ROUTES:
        return path
    parts = path.split("/")
    if len(parts) == 5 and parts[1:3] == ["v1", "pipelines"] and parts[4] == "runs":
        return "/v1/pipelines/{name}/runs"
    return "/v1/{other}"


class ObserveMiddleware:
    """ASGI middleware for ``/v1/*``: times every request into ``meter``, and opens a
    server span for it while tracing is on."""

    def __init__(self, app: Any, meter: HttpMeter) -> None:
        self.app = app
        self.meter = meter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        t0 = perf_counter()
        status = [0]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        route = route_of(scope["path"])
        try:
            if TRACING.tracer is None:
                await self.app(scope, receive, send_status)
            else:
                await self._traced(scope, receive, send_status, route, status)
        finally:
            self.meter.observe(scope["method"], route, status[0], perf_counter() - t0)

    async def _traced(self, scope: dict, receive: Any, send: Any, route: str,
                      status: list) -> None:
        method = scope["method"]
        with request_span(f"{method} {route}", {"http.request.method": method,
                                                "http.route": route,
                                                "url.path": scope["path"]}) as span:
            await self.app(scope, receive, send)
            if span is not None:
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    from opentelemetry.trace import Status, StatusCode

                    span.set_status(Status(StatusCode.ERROR, f"HTTP {status[0]}"))


# -- mounting ------------------------------------------------------------------------------

def install_observability(app: Any, hub: Any, keys: KeyCheck | None = None) -> None:
    """Mount ``/metrics``, ``/dashboard`` (+ ``/dashboard/data``) and request tracing.
    ``keys``: who may read them (default: the hub's ``api_key`` and ``metrics_public``)."""
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        CollectorRegistry,
        ProcessCollector,
        generate_latest,
    )
    from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response

    from .app import error_response

    if not tracing_enabled():
        configure_tracing()  # on only if OTEL_EXPORTER_OTLP_ENDPOINT is set
    meter = HttpMeter()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TailraceCollector(partial(scrape, hub, meter)))
    ProcessCollector(registry=registry)  # process_resident_memory_bytes, cpu, fds
    static_dir = resources.files("tailrace.serving").joinpath("static")
    files = {name: (static_dir.joinpath(name).read_bytes(), ctype)
             for name, ctype in STATIC.items()}

    if keys is None:
        keys = KeyCheck(hub.api_key, metrics_public=hub.metrics_public)

    def metrics(request: Any) -> Response:
        refused = keys.metrics(request.headers)
        if refused is not None:
            return error_response(refused)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def dashboard(request: Any) -> Response:
        refused, remember = keys.dashboard(request.headers, request.cookies,
                                           request.query_params.get("key"))
        if refused is not None:
            return error_response(refused)
        if remember:  # the key leaves the address bar; the cookie carries its HMAC
            rest = urlencode([(k, v) for k, v in request.query_params.multi_items()
                              if k != "key"])
            page = RedirectResponse("/dashboard" + ("?" + rest if rest else ""), 303)
            page.set_cookie(COOKIE, keys.cookie or "", path="/dashboard", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
            return page
        body, ctype = files["dashboard.html"]
        return Response(body, media_type=ctype, headers={"Cache-Control": "no-cache"})

    def data(request: Any) -> Response:
        refused, _ = keys.dashboard(request.headers, request.cookies, None)
        if refused is not None:
            return error_response(refused)
        return JSONResponse(dashboard_data(hub, meter), headers={"Cache-Control": "no-store"})

    def static(request: Any) -> Response:
        name = request.path_params["name"]
        if name not in files:
            return PlainTextResponse(f"no dashboard file {name!r}", status_code=404)
        body, ctype = files[name]
        return Response(body, media_type=ctype, headers={"Cache-Control": "no-cache"})

    app.add_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_route("/dashboard", dashboard, methods=["GET"], include_in_schema=False)
    app.add_route("/dashboard/data", data, methods=["GET"], include_in_schema=False)
    app.add_route("/dashboard/static/{name}", static, methods=["GET"],
                  include_in_schema=False)
    app.add_middleware(ObserveMiddleware, meter=meter)
