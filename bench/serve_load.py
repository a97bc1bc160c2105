"""Serving under load: `tailrace serve` on loopback, over the latency-model engine.

Starts two latency-model engine servers (bench/latency_server.py, child processes) and
`tailrace serve` (a child process) with two pipelines and the `slo` admission policy, then
drives it from this process over HTTP:

1. HTTP overhead, exact timings: a child process builds what `tailrace serve` builds
   (a ``PipelineService`` in a ``ServingHub``, ``create_app``, uvicorn) for a pipeline
   whose engine answers in ~1 ms, and times every request with ``perf_counter``, one
   request at a time, the two paths interleaved on the same records:
   - direct: ``await service.submit(record)`` in the server process (a bench-only route
     asks for it; only the ``submit`` call is timed);
   - through HTTP, server side: ``POST /v1/pipelines/fast/runs`` from the ASGI app
     receiving the request to the last body byte handed to uvicorn (an ASGI wrapper);
   - through HTTP, client side: what this script's HTTP client sees (request written to
     response read, loopback and uvicorn's own parsing included).
   Several repeats; p50 and p99 of each, median [min - max] over the repeats.
2. A closed-loop sweep at increasing concurrency over /v1/chat/completions: throughput,
   p50/p99 as the client sees them.
3. 3x overload: open-loop Poisson arrivals at three times the best throughput of the
   sweep. /healthz is probed every 50 ms from a separate process (target < 100 ms),
   excess requests must get 429 quickly rather than queue without bound, and the
   server's RSS is sampled every second.
4. Side by side with a bare FastAPI app: `tailrace serve` on a one-`map` pipeline (an
   identity function; ``POST /v1/pipelines/echo/runs``, no admission) against a bare
   FastAPI app whose one route parses the same JSON body and answers it back
   (``json.loads`` / ``json.dumps``, as tailrace does), each in its own child process on
   the same uvicorn settings (one worker, ``uvicorn.Config`` defaults as `tailrace serve`
   passes them: loop and http ``auto``, which this venv resolves the same way for both;
   the same listening socket options). Both are driven by `wrk` (Debian's package,
   ``apt-get install -y wrk``; one wrk thread, 32 connections, the POST body from a Lua
   script written to a temp file): a 2 s warm-up of each, then alternating rounds;
   req/s, latency p50/p99 (wrk's), the server's CPU use, and tailrace / bare per round.
   Skipped with a message when wrk is not installed.

The load generator is a small HTTP/1.1 client on asyncio streams (keep-alive, one write
per request), so the client is not what saturates first on a small machine.

Bounded and self-stopping (every phase has a fixed duration; stragglers are cut off);
about 2 minutes:

    python bench/serve_load.py            # prints the tables (+ ~1 minute for part 4)
    python bench/serve_load.py --quick    # shorter phases (~1.5 minutes)
    python bench/serve_load.py --vs-bare  # part 4 only (~1 minute; --quick: ~25 s)
    python bench/serve_load.py --json out.json

What part 4 cannot show on a 2-core machine: wrk and the server share the two cores
(wrk takes a good part of one), so both servers are measured CPU-bound on about one
core each; the ratio, not the absolute req/s, is the figure to compare across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
from fastapi import Request  # module level: FastAPI resolves the route's annotations here

sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency_server import LatencyConfig, spawn  # noqa: E402

#: chat: 8 tokens at 50 tok/s (~160 ms alone), 8 sequences at once; fast: ~1 ms
CHAT = LatencyConfig(prefill_tps=1e5, decode_tps=50, batch_slowdown=0.02, max_seqs=8)
FAST = LatencyConfig(prefill_tps=1e6, decode_tps=2000, batch_slowdown=0.0, max_seqs=64)
MAX_IN_FLIGHT = 8

PIPELINE = """version: 1
pipeline: {name}
slo: {{p99_ms: {p99_ms}, priority: interactive}}
source: {{fields: [prompt]}}
engines:
  llm: {{backend: openai, base_url: "{url}", model: latency-model, concurrency: 64,
         timeout_s: 60, retries: 0}}
stages:
  - {{id: answer, op: generate, engine: llm, input: prompt, output: answer,
     max_tokens: {max_tokens}, max_batch: 1, replicas: {replicas}, usage: usage}}
"""


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def rss_mb(pid: int) -> float:
    """Resident set size of a process in MiB (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_serve(files: list[Path], log: Path, admission: bool = True,
                env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`tailrace serve FILES --port 0 [--admission slo]`; returns (process, base URL)."""
    cmd = [sys.executable, "-m", "tailrace.cli.main", "serve", *map(str, files), "--port", "0"]
    if admission:
        cmd += ["--admission", "slo", "--max-in-flight", str(MAX_IN_FLIGHT)]
    err = open(log, "wb")  # noqa: SIM115 - the child writes to it while it lives
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                            env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.search(r"on (http://\S+)/v1", line)
    if not m:
        proc.kill()
        raise SystemExit(f"serve_load: tailrace serve did not start: {line!r}; see {log}")
    base = m.group(1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"serve_load: tailrace serve not ready after 60 s; see {log}")


def chat_body(i: int) -> dict:
    return {"model": "chat", "messages": [{"role": "user", "content": f"question {i}: why?"}]}


class Http:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams (one write per request).

    base: ``http://HOST:PORT``.
    """

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(self, method: str, path: str, body: dict | None = None) -> int:
        """Send one request, read the whole response; returns its status (-1: failed).

        method: GET or POST.
        path: the request path.
        body: a JSON body, or None.
        """
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        raw = head.encode() + data
        if self.idle:  # the server may have closed an idle connection: then a fresh one
            status = await self._send(self.idle.pop(), raw)
            if status != -1:
                return status
        return await self._send(None, raw)

    async def _send(self, conn: Any, raw: bytes) -> int:
        try:
            if conn is None:
                conn = await asyncio.open_connection(self.host, self.port)
            reader, writer = conn
            writer.write(raw)
            status = int((await reader.readline()).split()[1])
            length, chunked, close = 0, False, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode("latin-1").partition(":")
                k, v = k.strip().lower(), v.strip().lower()
                if k == "content-length":
                    length = int(v)
                elif k == "transfer-encoding":
                    chunked = "chunked" in v
                elif k == "connection":
                    close = v == "close"
            if chunked:
                while (size := int((await reader.readline()).strip(), 16)) > 0:
                    await reader.readexactly(size + 2)
                await reader.readline()
            else:
                await reader.readexactly(length)
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
            if conn is not None:
                conn[1].close()
            return -1
        if close:
            writer.close()
        else:
            self.idle.append(conn)
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def timed(http: Http, path: str, body: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    status = await http.request("POST", path, body)
    return status, time.perf_counter() - t0


async def closed_loop(base: str, path: str, body, concurrency: int, seconds: float) -> dict:
    """``concurrency`` clients each sending the next request when the last one answers."""
    lat: list[float] = []
    codes: dict[int, int] = {}
    stop = time.perf_counter() + seconds
    http = Http(base)

    async def worker(w: int) -> None:
        i = 0
        while time.perf_counter() < stop:
            status, dt = await timed(http, path, body(w * 100_000 + i))
            i += 1
            codes[status] = codes.get(status, 0) + 1
            if status == 200:
                lat.append(dt)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - t0
    http.close()
    return {"concurrency": concurrency, "ok": len(lat), "codes": codes,
            "throughput": len(lat) / wall, "p50_ms": pct(lat, 0.5) * 1e3,
            "p99_ms": pct(lat, 0.99) * 1e3}


def probe(base: str, pid: int, seconds: float) -> None:
    """Probe mode (a child process): GET /healthz every 50 ms, RSS of ``pid`` every second
    and the admission queue; prints one JSON line at the end."""
    import http.client

    host, port = base.removeprefix("http://").rsplit(":", 1)
    health, rss, queued = [], [], []
    t_start = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    while time.perf_counter() - t_start < seconds:
        t0 = time.perf_counter()
        try:
            conn.request("GET", "/healthz")
            ok = conn.getresponse().read() == b'{"status":"ok"}'
        except OSError:
            ok = False
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
        health.append(time.perf_counter() - t0 if ok else float("inf"))
        if len(health) % 20 == 1:
            rss.append((time.perf_counter() - t_start, rss_mb(pid)))
            try:
                conn.request("GET", "/dashboard/data")
                adm = json.loads(conn.getresponse().read())["admission"]
                queued.append(adm["queued"] if adm else 0)
            except (OSError, ValueError):
                conn = http.client.HTTPConnection(host, int(port), timeout=5)
        time.sleep(max(0.0, 0.05 - (time.perf_counter() - t0)))
    print(json.dumps({"health": health, "rss": rss, "queued": queued}))


async def overload(base: str, pid: int, rate: float, seconds: float, seed: int) -> dict:
    """Open-loop Poisson arrivals at ``rate``/s; a child process probes /healthz meanwhile."""
    rng = random.Random(seed)
    lat_ok: list[float] = []
    lat_429: list[float] = []
    codes: dict[int, int] = {}
    prober = subprocess.Popen([sys.executable, __file__, "--probe", base, str(pid),
                               str(seconds + 2)], stdout=subprocess.PIPE)
    http = Http(base)

    async def one(i: int) -> None:
        status, dt = await timed(http, "/v1/chat/completions", chat_body(i))
        codes[status] = codes.get(status, 0) + 1
        (lat_ok if status == 200 else lat_429 if status == 429 else []).append(dt)

    tasks = []
    t0 = time.perf_counter()
    i = 0
    next_at = t0 + 1.0  # the prober starts first
    while next_at < t0 + 1.0 + seconds:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
        i += 1
        next_at += rng.expovariate(rate)
    offered_s = time.perf_counter() - t0 - 1.0
    _, late = await asyncio.wait(tasks, timeout=30)  # stragglers are cut off
    for t in late:
        t.cancel()
    http.close()
    with urllib.request.urlopen(base + "/dashboard/data", timeout=10) as resp:
        adm = json.loads(resp.read())["admission"] or {}
    out, _ = prober.communicate(timeout=60)
    probed = json.loads(out)
    health, rss = probed["health"], probed["rss"]
    rss_vals = [r for _, r in rss]
    return {"offered": i, "offered_rate": i / offered_s, "codes": codes, "cut_off": len(late),
            "rejected_by_reason": adm.get("rejected_by_reason", {}),
            "ok_p50_ms": pct(lat_ok, 0.5) * 1e3, "ok_p99_ms": pct(lat_ok, 0.99) * 1e3,
            "reject_p50_ms": pct(lat_429, 0.5) * 1e3, "reject_p99_ms": pct(lat_429, 0.99) * 1e3,
            "healthz_p50_ms": pct(health, 0.5) * 1e3, "healthz_p99_ms": pct(health, 0.99) * 1e3,
            "healthz_max_ms": max(health) * 1e3 if health else float("nan"),
            "healthz_probes": len(health), "max_admission_queue": max(probed["queued"],
                                                                         default=0),
            "rss_mb": rss, "rss_first_mb": rss_vals[0] if rss_vals else float("nan"),
            "rss_last_mb": rss_vals[-1] if rss_vals else float("nan"),
            "rss_max_mb": max(rss_vals, default=float("nan"))}


FAST_ROUTE = "/v1/pipelines/fast/runs"


def overhead_server(pipeline_file: str) -> None:
    """Child mode: `tailrace serve`'s hub and app for one pipeline (no admission gate: it
    sits inside ``submit``, on both paths), with exact per-request timings; prints its URL,
    serves until terminated."""
    import socket

    import uvicorn

    import tailrace as tr
    from tailrace.cli.serve import draining_server
    from tailrace.serving import PipelineService, ServingHub
    from tailrace.serving.app import create_app

    svc = PipelineService(tr.Pipeline.from_yaml(pipeline_file))
    hub = ServingHub([svc])  # started on the server's loop, as `tailrace serve` does
    app = create_app(hub)
    direct: list[float] = []
    through_http: list[float] = []

    @app.post("/bench/direct")
    async def _direct(request: Request) -> dict:
        record = await request.json()
        t0 = time.perf_counter()
        await svc.submit(record)
        direct.append(time.perf_counter() - t0)
        return {}

    @app.get("/bench/timings")
    async def _timings() -> dict:
        out = {"direct": direct[:], "http": through_http[:]}
        direct.clear()
        through_http.clear()
        return out

    async def timed_app(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != FAST_ROUTE:
            return await app(scope, receive, send)
        t0 = time.perf_counter()

        async def send_timed(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                through_http.append(time.perf_counter() - t0)

        await app(scope, receive, send_timed)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = draining_server(uvicorn.Config(timed_app, log_level="warning", access_log=False,
                                            lifespan="off"), hub)

    def announce() -> None:  # the URL once the pipeline is ready
        if not svc.wait_ready(120):
            print(f"serve_load: the fast pipeline did not start: {svc.failure}", flush=True)
            server.should_exit = True
            return
        print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        hub.stop()


async def overhead_rounds(base: str, n: int, repeats: int) -> list[dict]:
    """``repeats`` rounds of ``n`` records, each sent directly and through HTTP (order
    alternating per record); per round p50/p99 of each path, in us."""
    http = Http(base)
    rounds = []
    for _ in range(3):  # warm both paths
        await http.request("POST", "/bench/direct", {"prompt": "warm"})
        await http.request("POST", FAST_ROUTE, {"prompt": "warm"})
    urllib.request.urlopen(base + "/bench/timings", timeout=10).close()  # forget the warm-up
    for r in range(repeats):
        client: list[float] = []
        for i in range(n):
            record = {"prompt": f"hi {r}-{i}"}
            paths = ("/bench/direct", FAST_ROUTE) if i % 2 == 0 else (FAST_ROUTE, "/bench/direct")
            for path in paths:
                t0 = time.perf_counter()
                status = await http.request("POST", path, record)
                dt = time.perf_counter() - t0
                if status != 200:
                    raise SystemExit(f"serve_load: {path} answered {status}")
                if path == FAST_ROUTE:
                    client.append(dt)
        with urllib.request.urlopen(base + "/bench/timings", timeout=10) as resp:
            got = json.loads(resp.read())
        if len(got["direct"]) != n or len(got["http"]) != n:
            raise SystemExit(f"serve_load: timed {len(got['direct'])} direct and "
                             f"{len(got['http'])} HTTP requests of {n}")
        row = {}
        for name, xs in (("direct", got["direct"]), ("server", got["http"]),
                         ("client", client)):
            row[f"{name}_p50_us"] = pct(xs, 0.5) * 1e6
            row[f"{name}_p99_us"] = pct(xs, 0.99) * 1e6
        row["overhead_p50_us"] = row["server_p50_us"] - row["direct_p50_us"]
        row["client_overhead_p50_us"] = row["client_p50_us"] - row["direct_p50_us"]
        rounds.append(row)
    http.close()
    return rounds


def http_overhead(fast_yaml: Path, n: int, repeats: int, log: Path) -> dict:
    """Start the overhead server child, time ``repeats`` x ``n`` records both ways."""
    err = open(log, "wb")  # noqa: SIM115 - the child writes to it while it lives
    proc = subprocess.Popen([sys.executable, __file__, "--overhead-server", str(fast_yaml)],
                            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        base = proc.stdout.readline().decode().strip()
        if not base.startswith("http://"):
            raise SystemExit(f"serve_load: the overhead server did not start; see {log}")
        rounds = asyncio.run(overhead_rounds(base, n, repeats))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"n": n, "repeats": repeats, "rounds": rounds}


def spread(rounds: list[dict], key: str) -> str:
    """``median [min - max]`` in ms of one figure over the rounds."""
    xs = [r[key] / 1e3 for r in rounds]
    return f"{statistics.median(xs):.3f} [{min(xs):.3f} - {max(xs):.3f}]"


def report(o: dict, sweep: list[dict], ov: dict, capacity: float) -> None:
    rs = o["rounds"]
    print(f"\n1. HTTP layer overhead: {o['repeats']} rounds x {o['n']} records, one request at "
          "a time, each record sent directly and through HTTP (interleaved), ~1 ms engine;")
    print("   exact per-request perf_counter timings; ms, median [min - max] over the rounds")
    print(f"   {'path':<52} {'p50 ms':>22} {'p99 ms':>22}")
    for key, name in (("direct", "direct: await PipelineService.submit(record)"),
                      ("server", "HTTP, server side (ASGI app in -> last byte out)"),
                      ("client", "HTTP, client side (what the HTTP client sees)")):
        print(f"   {name:<52} {spread(rs, key + '_p50_us'):>22} "
              f"{spread(rs, key + '_p99_us'):>22}")
    print(f"   HTTP layer overhead, p50 server side - p50 direct: "
          f"{spread(rs, 'overhead_p50_us')} ms (target <= 1 ms)")
    print(f"   as the client sees it, p50 client side - p50 direct: "
          f"{spread(rs, 'client_overhead_p50_us')} ms (adds this script's asyncio client, "
          "loopback TCP and uvicorn's parsing)")
    print("\n2. closed-loop sweep, POST /v1/chat/completions (8 tokens, ~160 ms alone; "
          f"engine runs {CHAT.max_seqs} sequences, admission {MAX_IN_FLIGHT} in flight)")
    print(f"   {'clients':>7}  {'req/s':>7}  {'p50 ms':>8}  {'p99 ms':>8}  statuses")
    for r in sweep:
        print(f"   {r['concurrency']:>7}  {r['throughput']:>7.1f}  {r['p50_ms']:>8.1f}  "
              f"{r['p99_ms']:>8.1f}  {dict(sorted(r['codes'].items()))}")
    c = ov["codes"]
    print(f"\n3. 3x overload: {ov['offered']} requests at {ov['offered_rate']:.0f}/s "
          f"(3 x {capacity:.1f}/s), open loop")
    other = {k: v for k, v in sorted(c.items()) if k not in (200, 429)}
    print(f"   200: {c.get(200, 0)}  429: {c.get(429, 0)}  other: {other or 0} "
          f"(-1: connection failed)  cut off after 30 s: {ov['cut_off']}")
    print(f"   admission rejections by reason (server): {ov['rejected_by_reason']}")
    print(f"   admitted p50 {ov['ok_p50_ms']:.0f} ms p99 {ov['ok_p99_ms']:.0f} ms; 429 answered "
          f"in p50 {ov['reject_p50_ms']:.1f} ms p99 {ov['reject_p99_ms']:.1f} ms; "
          f"admission queue at most {ov['max_admission_queue']}")
    print(f"   /healthz while loaded: p50 {ov['healthz_p50_ms']:.1f} ms p99 "
          f"{ov['healthz_p99_ms']:.1f} ms max {ov['healthz_max_ms']:.1f} ms over "
          f"{ov['healthz_probes']} probes (target < 100 ms)")
    series = "  ".join(f"{t:.0f}s:{m:.0f}" for t, m in ov["rss_mb"])
    growth = (ov["rss_last_mb"] / ov["rss_first_mb"] - 1) * 100 if ov["rss_mb"] else 0.0
    print(f"   server RSS MiB: {series}  (first->last {growth:+.1f}%)")


# -- 4. side by side with a bare FastAPI app, driven by wrk --------------------------------

ECHO_ROUTE = "/v1/pipelines/echo/runs"
ECHO_BODY = '{"prompt": "What is the capital of France?", "user": "bench"}'
ECHO_MODULE = "def echo(record):\n    return record\n"
ECHO_PIPELINE = """version: 1
pipeline: echo
source: {fields: [prompt, user]}
stages:
  - {id: echo, op: map, fn: tr_bench_echo.echo}
"""
#: wrk: POST the body; at the end one line "JSON {...}" with wrk's own figures (us)
WRK_LUA = """wrk.method = "POST"
wrk.body = 'BODY'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('JSON {"requests": %d, "duration_us": %d, "p50_us": %d, ' ..
    '"p99_us": %d, "mean_us": %.1f, "max_us": %d, "connect": %d, "read": %d, ' ..
    '"write": %d, "status": %d, "timeout": %d}\\n', summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), latency.mean, latency.max, e.connect,
    e.read, e.write, e.status, e.timeout))
end
""".replace("BODY", ECHO_BODY)
WRK_CONNECTIONS = 32
WRK_INSTALL = "apt-get install -y wrk   (Debian/Ubuntu; `make bench` installs it)"


def listen_like_serve() -> socket.socket:
    """A loopback listening socket made as `tailrace serve` makes its own (cli/serve.py:
    IPPROTO_TCP, so asyncio sets TCP_NODELAY on accepted connections; backlog 1024)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def bare_server() -> None:
    """Child mode: a bare FastAPI app answering ECHO_ROUTE with the JSON object it was
    sent, on uvicorn with the settings `tailrace serve` uses; prints its URL."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import Response

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.post(ECHO_ROUTE)
    async def runs(request: Request) -> Response:
        record = json.loads(await request.body())
        return Response(json.dumps(record), media_type="application/json")

    sock = listen_like_serve()
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                  lifespan="off")).run(sockets=[sock])


def start_bare(log: Path) -> tuple[subprocess.Popen, str]:
    err = open(log, "wb")  # noqa: SIM115 - the child writes to it while it lives
    proc = subprocess.Popen([sys.executable, __file__, "--bare-server"], stdout=subprocess.PIPE,
                            stderr=err, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    base = proc.stdout.readline().decode().strip()
    if not base.startswith("http://"):
        proc.kill()
        raise SystemExit(f"serve_load: the bare FastAPI server did not start; see {log}")
    return proc, base


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk(url: str, lua: Path, seconds: float, pid: int) -> dict:
    """One wrk run (1 thread, WRK_CONNECTIONS connections); wrk's figures + server CPU."""
    cmd = ["wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{seconds:g}s", "--timeout", "10s",
           "-s", str(lua), url]
    cpu0 = cpu_seconds(pid)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk's, once it is waited for
    cpu = cpu_seconds(pid) - cpu0
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("JSON ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"serve_load: wrk failed ({out.returncode}): {out.stdout}{out.stderr}")
    r = json.loads(line[5:])
    r["req_s"] = r["requests"] / (r["duration_us"] / 1e6)
    r["cpu"] = cpu / (r["duration_us"] / 1e6)  # cores the server used, on average
    r["wrk_cpu"] = ((ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime)
                    / (r["duration_us"] / 1e6))
    r["errors"] = sum(r[k] for k in ("connect", "read", "write", "status", "timeout"))
    return r


def vs_bare(repeats: int, seconds: float, tmp: Path) -> dict | None:
    """Part 4: `tailrace serve` (one map) vs a bare FastAPI app, wrk-driven, alternating."""
    if shutil.which("wrk") is None:
        print(f"\nserve_load: part 4 skipped: wrk is not installed; install it with\n"
              f"    {WRK_INSTALL}", flush=True)
        return None
    (tmp / "tr_bench_echo.py").write_text(ECHO_MODULE)
    (tmp / "echo.yaml").write_text(ECHO_PIPELINE)
    lua = tmp / "post.lua"
    lua.write_text(WRK_LUA)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        servers["tailrace"] = start_serve([tmp / "echo.yaml"], tmp / "echo-serve.log",
                                          admission=False, env=env)
        servers["bare"] = start_bare(tmp / "bare.log")
        bodies = {}
        for name, (_, base) in servers.items():  # both answer the same bytes
            req = urllib.request.Request(base + ECHO_ROUTE, data=ECHO_BODY.encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                bodies[name] = json.loads(resp.read())
        if bodies["tailrace"] != bodies["bare"] or bodies["bare"] != json.loads(ECHO_BODY):
            raise SystemExit(f"serve_load: the two servers answer differently: {bodies}")
        for proc, base in servers.values():  # warm-up
            run_wrk(base + ECHO_ROUTE, lua, 2, proc.pid)
        rounds: dict[str, list[dict]] = {"tailrace": [], "bare": []}
        load0 = os.getloadavg()[0]
        for r in range(repeats):
            for name in (("tailrace", "bare") if r % 2 == 0 else ("bare", "tailrace")):
                proc, base = servers[name]
                rounds[name].append(run_wrk(base + ECHO_ROUTE, lua, seconds, proc.pid))
            print(f"serve_load: part 4 round {r + 1}/{repeats}: tailrace "
                  f"{rounds['tailrace'][-1]['req_s']:,.0f} req/s, bare "
                  f"{rounds['bare'][-1]['req_s']:,.0f} req/s", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    import uvicorn

    setup = (f"uvicorn {uvicorn.__version__}, one worker, loop auto -> "
             f"{'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio'}, http auto -> "
             f"{'httptools' if importlib.util.find_spec('httptools') else 'h11'}")
    return {"repeats": repeats, "seconds": seconds, "connections": WRK_CONNECTIONS,
            "setup": setup, "rounds": rounds, "load": (load0, os.getloadavg()[0]),
            "ratio": [t["req_s"] / b["req_s"] for t, b in zip(rounds["tailrace"],
                                                            rounds["bare"], strict=True)]}


def report_vs_bare(v: dict) -> None:
    def sp(xs: list[float], fmt: str) -> str:
        return (f"{fmt.format(statistics.median(xs))} "
                f"[{fmt.format(min(xs))} - {fmt.format(max(xs))}]")

    print(f"\n4. tailrace serve (one map, POST {ECHO_ROUTE}) vs a bare FastAPI app echoing "
          f"the same JSON;\n   wrk -t1 -c{v['connections']}, {v['repeats']} alternating "
          f"rounds of {v['seconds']:g} s after a 2 s warm-up each; {v['setup']};")
    print("   median [min - max] over the rounds; CPU: cores the server process / wrk used; "
          f"load average {v['load'][0]:.2f} before, {v['load'][1]:.2f} after")
    print(f"   {'server':<10} {'req/s':>26} {'p50 ms':>20} {'p99 ms':>22} {'server CPU':>18} "
          f"{'wrk CPU':>18} errors")
    for name in ("tailrace", "bare"):
        rs = v["rounds"][name]
        print(f"   {name:<10} {sp([r['req_s'] for r in rs], '{:,.0f}'):>26} "
              f"{sp([r['p50_us'] / 1e3 for r in rs], '{:.2f}'):>20} "
              f"{sp([r['p99_us'] / 1e3 for r in rs], '{:.2f}'):>22} "
              f"{sp([r['cpu'] for r in rs], '{:.2f}'):>18} "
              f"{sp([r['wrk_cpu'] for r in rs], '{:.2f}'):>18} {sum(r['errors'] for r in rs)}")
    print(f"   tailrace / bare, req/s per round: {sp(v['ratio'], '{:.2f}')} (target >= 0.88)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases (~1.5 minutes)")
    ap.add_argument("--vs-bare", action="store_true",
                    help="only part 4: tailrace serve vs a bare FastAPI app, under wrk")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--probe", nargs=3, metavar=("URL", "PID", "SECONDS"),
                    help=argparse.SUPPRESS)  # internal: the /healthz prober child
    ap.add_argument("--overhead-server", metavar="YAML",
                    help=argparse.SUPPRESS)  # internal: the timed server child
    ap.add_argument("--bare-server", action="store_true",
                    help=argparse.SUPPRESS)  # internal: the bare FastAPI child
    args = ap.parse_args()
    if args.probe:
        probe(args.probe[0], int(args.probe[1]), float(args.probe[2]))
        return 0
    if args.overhead_server:
        overhead_server(args.overhead_server)
        return 0
    if args.bare_server:
        bare_server()
        return 0
    step_s, overload_s, n_overhead, rounds = ((3.0, 10.0, 100, 3) if args.quick
                                              else (6.0, 20.0, 200, 5))
    bare_rounds, bare_s = (3, 3.0) if args.quick else (5, 5.0)
    levels = [1, 2, 4, 8, 16]
    tmp = Path(tempfile.mkdtemp(prefix="serve_load-"))
    figures: dict[str, Any] = {}
    if not args.vs_bare:
        chat_srv, fast_srv = spawn(CHAT), spawn(FAST)
        proc = None
        try:
            files = [tmp / "chat.yaml", tmp / "fast.yaml"]
            files[0].write_text(PIPELINE.format(name="chat", p99_ms=1000, url=chat_srv.url,
                                                max_tokens=8, replicas=2 * MAX_IN_FLIGHT))
            files[1].write_text(PIPELINE.format(name="fast", p99_ms=1000, url=fast_srv.url,
                                                max_tokens=1, replicas=2))
            overhead = http_overhead(files[1], n_overhead, rounds, tmp / "overhead.log")
            proc, base = start_serve(files, tmp / "serve.log")
            print(f"serve_load: tailrace serve at {base} (pid {proc.pid}); engines: latency "
                  f"model at {chat_srv.url} and {fast_srv.url}", flush=True)
            sweep = [asyncio.run(closed_loop(base, "/v1/chat/completions", chat_body, c,
                                             step_s)) for c in levels]
            capacity = max(r["throughput"] for r in sweep)
            ov = asyncio.run(overload(base, proc.pid, 3 * capacity, overload_s, args.seed))
            report(overhead, sweep, ov, capacity)
            figures.update(overhead=overhead, sweep=sweep, overload=ov, capacity=capacity)
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for srv in (chat_srv, fast_srv):
                srv.stop()
    v = vs_bare(bare_rounds, bare_s, tmp)  # after the other servers are gone
    if v is not None:
        report_vs_bare(v)
        figures["vs_bare"] = v
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
