"""``tailrace serve --runtime ray`` on a multi-node cluster (``ray.cluster_utils.Cluster``:
three nodes on this machine): Ray Serve ingress replicas in front of one hub actor whose
plan's stages are spread over the nodes, the generate stage calling a real OpenAI-wire
server (bench/latency_server.py) from its engine actor.

The official ``openai`` client gets plain and streamed answers; overload gets only 200
and 429 (+ Retry-After) and the gate goes back to 0; a client that disconnects stops the
generation upstream; killing an ingress replica fails only the requests it held, and
killing a stage actor or the engine actor mid-request loses and duplicates no answer.

The cluster cannot share the process with the session's single-node Ray: this module
shuts that one down first and starts it again afterwards (as test_ray_cluster.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import tailrace as tr
from tailrace.compiler import compile_pipeline
from tailrace.control import AdmissionGate, make_policy
from tests.conftest import free_port, multi_node_cluster, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_IN_FLIGHT = 4
MAX_QUEUE = 4
#: replicas of the generate stage: so many requests generate at once
GENERATORS = 3


def latency_server():
    path = ROOT / "bench" / "latency_server.py"
    if "latency_server" not in sys.modules:
        spec = importlib.util.spec_from_file_location("latency_server", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["latency_server"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["latency_server"]


def fcfs_gate():
    """The hub actor's gate (built there): few tickets and a short queue, so a burst
    of requests overloads it."""
    return AdmissionGate(make_policy("fcfs", max_in_flight=MAX_IN_FLIGHT, max_queue=MAX_QUEUE))


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray.serve")
    with multi_node_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def upstream():
    ls = latency_server()
    with ls.start_server(ls.LatencyConfig(decode_tps=100, prefill_tps=1e6, max_seqs=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(cluster, upstream):
    from tailrace.serving.ray import ClusterServer

    p = tr.Pipeline("chat", engines={"llm": {"backend": "openai", "model": "latency-model",
                                             "base_url": upstream.url}})
    (p.source(fields=["question"])
     .apply("generate", id="answer", engine="llm", input="question", output="answer",
            max_tokens=400, replicas=GENERATORS, placement={"strategy": "spread"}, retries=2)
     .sink())
    port = free_port()
    # two ingress replicas, up to three under load (Serve's autoscaler, fast settings)
    srv = ClusterServer([compile_pipeline(p)], port=port, autoscale=(2, 3), target_ongoing=2,
                        autoscaling={"upscale_delay_s": 0.5, "downscale_delay_s": 3,
                                     "look_back_period_s": 1},
                        gate_factory=fcfs_gate, app_name="tailrace-test").start()
    try:
        assert srv.wait_ready(180), srv.state()
        srv.url = f"http://127.0.0.1:{port}"
        yield srv
    finally:
        srv.stop()


def figures(srv):
    import ray

    return ray.get(srv.hub.figures.remote())


def settled(srv):
    """Wait until the gate holds no ticket and nothing waits in the hub."""
    def idle():
        f = figures(srv)
        return f["gate"].in_flight == 0 and f["gate"].queued == 0 and \
            f["services"]["chat"]["pending"] == 0
    wait_until(idle, what="gate and hub idle")


def test_the_plan_spans_the_nodes_and_readyz_is_up(server):
    import ray

    # the replicas poll the hub's readiness (every 0.5 s): /readyz turns 200 shortly after
    wait_until(lambda: httpx.get(server.url + "/readyz").status_code == 200, what="/readyz")
    assert httpx.get(server.url + "/readyz").json()["ready"] is True
    (run,) = [r for r in ray.get(server.hub.actors.remote()) if r["pipeline"] == "chat"]
    nodes = {node for _, node in run["stages"]["answer"]}
    assert len(nodes) == 3  # spread: one generate replica per node
    wait_until(lambda: server.replicas() == 2, what="two ingress replicas (the minimum)")


def test_plain_and_streamed_chat_with_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello there"}], max_tokens=8)
    assert r.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7"
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello again"}], stream=True,
        max_tokens=6))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and
             c.choices[0].delta.content]
    assert "".join(texts) == "tok0 tok1 tok2 tok3 tok4 tok5"
    assert len(texts) > 1  # it came in pieces, not whole
    assert chunks[-1].choices[0].finish_reason == "length"
    settled(server)


def test_overload_gets_only_200_and_429_then_the_gate_is_idle(server):
    async def burst():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(
                c.post(server.url + "/v1/chat/completions", json={
                    "model": "chat", "max_tokens": 100,
                    "messages": [{"role": "user", "content": f"q{i}"}]})
                for i in range(30)))

    replies = asyncio.run(burst())
    statuses = [r.status_code for r in replies]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= MAX_IN_FLIGHT + MAX_QUEUE
    for r in replies:
        if r.status_code == 429:
            assert float(r.headers["retry-after"]) > 0
            assert r.json()["error"]["code"] == "admission_rejected"
    settled(server)
    gate = figures(server)["gate"]
    assert gate.admitted == gate.completed


def test_a_disconnect_stops_the_generation_upstream(server, upstream):
    before = upstream.stats()["cancelled"]
    with httpx.Client(timeout=60) as c, c.stream(
            "POST", server.url + "/v1/chat/completions",
            json={"model": "chat", "stream": True,
                  "messages": [{"role": "user", "content": "long"}]}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk: it is generating (400 tokens take 4 s)
    # the client went away: the ingress replica cancels its call on the hub, the hub's
    # service sets the record's _cancel, the engine closes its upstream stream
    wait_until(lambda: upstream.stats()["cancelled"] > before, what="upstream cancel")
    settled(server)


def unrouted(srv):
    return figures(srv)["services"]["chat"]["unrouted"]


async def stream_one(url, i, client, started):
    """One streamed chat request read as it comes: (ingress replica, text, ended with
    [DONE]); the replica is put on ``started`` at the first chunk. A cut connection
    ends it too (not [DONE])."""
    import json

    text, replica = [], None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json={
                "model": "chat", "stream": True,
                "messages": [{"role": "user", "content": f"s{i}"}]}) as r:
            assert r.status_code == 200
            replica = r.headers["x-tailrace-ingress"]
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return replica, "".join(text), True
                if line.startswith("data: "):
                    if not text:
                        started.put_nowait(replica)
                    text.append(json.loads(line[6:])["choices"][0]["delta"].get("content")
                                or "")
    except httpx.HTTPError:
        pass
    return replica, "".join(text), False


def serve_replicas(app_name):
    """The Serve replica actors of the ingress: {replica id: actor handle}."""
    import ray
    from ray.util import list_named_actors

    found = {}
    for a in list_named_actors(all_namespaces=True):
        if "tailrace-ingress" in a["name"] and a["name"].startswith("SERVE_REPLICA"):
            found[a["name"].rsplit("#", 1)[-1]] = ray.get_actor(a["name"], namespace=a["namespace"])
    return found


FULL = " ".join(f"tok{i}" for i in range(400))


def test_killing_an_ingress_replica_fails_only_its_own_requests(server):
    import ray

    before = unrouted(server)

    async def go():
        started: asyncio.Queue = asyncio.Queue()
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.ensure_future(stream_one(server.url, i, c, started))
                     for i in range(GENERATORS)]
            replicas = [await started.get() for _ in tasks]  # all generating (4 s long)
            victim = replicas[0]
            ray.kill(serve_replicas("tailrace-test")[victim], no_restart=True)
            return victim, await asyncio.gather(*tasks)

    victim, ends = asyncio.run(go())
    for replica, text, done in ends:
        if replica == victim:
            assert not done, "a request of the killed replica finished"  # cut, not hung
        else:
            assert done and text.startswith("tok0 tok1") and text.endswith("tok399"), text
    # Serve replaces the replica; the hub's records of the lost requests ran on for
    # nobody and gave their tickets back
    wait_until(lambda: server.replicas() >= 2 and victim not in serve_replicas("tailrace-test"),
               what="a new ingress replica")
    settled(server)
    r = httpx.post(server.url + "/v1/pipelines/chat/runs", json={"question": "after"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["answer"] == FULL
    assert unrouted(server) - before == sum(1 for rep, _, _ in ends if rep == victim)


def test_the_ingress_scales_out_under_load_and_back_in(server):
    """Serve's autoscaler adds the third replica while requests pile up (ongoing per
    replica above the target of 2) and removes it once they are answered."""
    wait_until(lambda: server.replicas() == 2, what="two replicas before the load")

    async def load():
        seen = []

        async def watch():
            while True:
                seen.append(await asyncio.to_thread(server.replicas))
                await asyncio.sleep(0.2)

        watcher = asyncio.ensure_future(watch())
        async with httpx.AsyncClient(timeout=120) as c:
            async def one(i):
                return await c.post(server.url + "/v1/chat/completions", json={
                    "model": "chat", "messages": [{"role": "user", "content": f"a{i}"}]})
            replies = []
            for _ in range(4):  # 8 at a time (4 generating or waiting, 4 queued): ~12 s
                replies += await asyncio.gather(*(one(i) for i in range(8)))
                if 3 in seen:
                    break
        watcher.cancel()
        return seen, replies

    seen, replies = asyncio.run(load())
    assert max(seen) == 3, f"the ingress never scaled out: {seen}"
    assert {r.status_code for r in replies} <= {200, 429}
    wait_until(lambda: server.replicas() == 2, what="back to two replicas")
    settled(server)


def runs(server, n, timeout=120):
    """n concurrent run requests; their responses in order."""
    async def go():
        async with httpx.AsyncClient(timeout=timeout) as c:
            return await asyncio.gather(*(c.post(server.url + "/v1/pipelines/chat/runs",
                                                 json={"question": f"q{i}"})
                                          for i in range(n)))
    return asyncio.run(go())


def kill_mid_request(server, kill):
    """MAX_IN_FLIGHT run requests; ``kill()`` once they are generating. Every request
    gets exactly its own full answer, none twice (a duplicate output would be unrouted),
    and the gate gives every ticket back."""
    import ray

    before_unrouted = unrouted(server)
    before_out = figures(server)["services"]["chat"]["stats"].records_out
    result = {}

    def killer():
        wait_until(lambda: figures(server)["gate"].in_flight == MAX_IN_FLIGHT, what="in flight")
        time.sleep(0.5)  # into the generation (4 s long)
        result["killed"] = kill(ray)

    import threading

    t = threading.Thread(target=killer)
    t.start()
    replies = runs(server, MAX_IN_FLIGHT)
    t.join()
    assert result.get("killed"), "nothing was killed"
    for i, r in enumerate(replies):
        assert r.status_code == 200, r.text
        assert r.json() == {"question": f"q{i}", "answer": FULL}
    settled(server)
    assert unrouted(server) == before_unrouted
    wait_until(lambda: figures(server)["services"]["chat"]["stats"].records_out
               >= before_out + MAX_IN_FLIGHT, what="outputs counted")
    assert figures(server)["services"]["chat"]["stats"].records_out == before_out + MAX_IN_FLIGHT


def test_killing_a_stage_actor_mid_request_loses_and_duplicates_nothing(server):
    def kill(ray):
        (run,) = [r for r in ray.get(server.hub.actors.remote()) if r["pipeline"] == "chat"]
        name, _ = run["stages"]["answer"][0]
        ray.kill(ray.get_actor(name), no_restart=False)
        return name

    kill_mid_request(server, kill)


def test_killing_the_engine_actor_mid_request_loses_and_duplicates_nothing(server):
    def kill(ray):
        from ray.util import list_named_actors

        (name,) = [a["name"] for a in list_named_actors(all_namespaces=True)
                   if a["name"].startswith("tailrace-engine-llm-")]
        ray.kill(ray.get_actor(name, namespace="tailrace"), no_restart=False)
        return name

    kill_mid_request(server, kill)


def test_zz_a_dead_hub_is_503_and_readyz_says_why(server):
    """Last (it takes the server down): with the hub actor gone, every replica answers
    503 at once, never hangs, and /readyz names the cause."""
    import ray

    ray.kill(server.hub, no_restart=True)
    r = httpx.post(server.url + "/v1/pipelines/chat/runs", json={"question": "x"}, timeout=60)
    assert r.status_code == 503 and "hub actor" in r.json()["error"]["message"]

    def unready():
        r = httpx.get(server.url + "/readyz", timeout=30)
        return r.status_code == 503 and "hub actor is unreachable" in r.text
    wait_until(unready, what="/readyz reporting the dead hub")
