"""Engine replicas spread over the cluster (``cluster:``): a Ray Serve deployment per
engine, requests spread over its replicas, streamed and cancellable one by one, replica
deaths reported or retried, never a hang, and replicas added and removed by load."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from tailrace.engines import GenerationRequest, check_spec, open_engine
from tailrace.engines.cluster import serve_options
from tailrace.errors import EngineError


def req(n: int) -> GenerationRequest:
    return GenerationRequest(prompt="count", max_tokens=n)


def counted(n: int) -> str:
    return "".join(f"t{k} " for k in range(n))


def wait_until(cond, what: str, timeout: float = 90.0):
    """Wait for ``cond()`` to be truthy (a failure ends at ``timeout``); its value."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


# -- the cluster: mapping, without Ray ---------------------------------------------------------

LLM = {"backend": "llama_cpp", "model": "smollm2-135m-instruct"}


@pytest.mark.parametrize("cluster, match", [
    ([2], r"engine 'llm': cluster must be a mapping like"),
    ({"replica": 2}, r"engine 'llm': cluster: unknown key\(s\) replica; known: replicas,"),
    ({"replicas": 0}, r"engine 'llm': cluster.replicas must be a positive integer, got 0"),
    ({"replicas": 2, "max_replicas": 3},
     r"engine 'llm': cluster: give replicas: N \(a fixed count\) or min_replicas and"),
    ({"min_replicas": 1}, r"engine 'llm': cluster: min_replicas needs max_replicas too"),
    ({"min_replicas": 3, "max_replicas": 2},
     r"engine 'llm': cluster.min_replicas \(3\) must not exceed max_replicas \(2\)"),
    ({"replicas": 2, "target_ongoing_requests": 4},
     r"engine 'llm': cluster: target_ongoing_requests tune autoscaling; give min_replicas"),
    ({"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0},
     r"engine 'llm': cluster.target_ongoing_requests must be a positive number, got 0"),
    ({"num_gpus": -1}, r"engine 'llm': cluster.num_gpus must be a non-negative number"),
    ({"memory": 1.5}, r"engine 'llm': cluster.memory must be a non-negative integer \(bytes\)"),
    ({"resources": {"accel": "x"}},
     r"engine 'llm': cluster.resources.accel must be a non-negative number, got 'x'"),
])
def test_a_bad_cluster_mapping_is_one_line_naming_the_engine_and_key(cluster, match):
    with pytest.raises(EngineError, match=match):
        check_spec("llm", {**LLM, "cluster": cluster}, "generate")


def test_cluster_with_pool_keys_or_a_bad_engine_is_refused():
    with pytest.raises(EngineError, match=r"engine 'llm': replicas configure a pool in one "
                                          r"process; with cluster: give its replicas there"):
        check_spec("llm", {**LLM, "replicas": 2, "cluster": {}}, "generate")
    with pytest.raises(EngineError, match=r"engine 'llm': unknown backend 'nope'"):
        check_spec("llm", {"backend": "nope", "cluster": {"replicas": 2}}, "generate")


def test_the_local_runtime_refuses_a_cluster_engine():
    with pytest.raises(EngineError, match=r"engine 'llm': cluster: places its replicas on a "
                                          r"Ray cluster; run with --runtime ray"):
        open_engine({**LLM, "cluster": {"replicas": 2}}, "llm")


def test_the_mapping_becomes_serve_options():
    fixed = serve_options({"replicas": 3, "num_gpus": 1, "memory": 2**30,
                           "resources": {"accel": 1}})
    assert fixed == {"num_replicas": 3, "max_ongoing_requests": 64, "ray_actor_options": {
        "num_cpus": 1.0, "num_gpus": 1.0, "memory": 2**30, "resources": {"accel": 1.0}}}
    auto = serve_options({"min_replicas": 1, "max_replicas": 4, "num_cpus": 2,
                          "downscale_delay_s": 5, "max_ongoing_requests": 8})
    assert "num_replicas" not in auto and auto["max_ongoing_requests"] == 8
    assert auto["ray_actor_options"] == {"num_cpus": 2.0}
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                          "target_ongoing_requests": 4.0,
                                          "downscale_delay_s": 5.0}


def test_the_ray_runtime_opens_a_cluster_spec_as_a_serve_deployment(monkeypatch):
    pytest.importorskip("ray")
    from tailrace.runtime.ray import engine_serve, engines

    made: list[tuple[str, dict]] = []
    monkeypatch.setattr(engine_serve, "ServeEngine", lambda n, s: made.append((n, s)) or n)
    spec = {**LLM, "cluster": {"replicas": 2}, "_name": "llm"}
    assert engines.open_cluster_engine("llm", spec) == "llm"
    assert made == [("llm", spec)]


# -- on Ray Serve ----------------------------------------------------------------------------

SMALL = 0.1  # CPUs per replica: the session's Ray has two


@pytest.fixture(scope="module")
def serve_on(ray_session):
    """Serve on the session's Ray for this module, shut down at its end."""
    from ray import serve

    serve.start(proxy_location="Disabled")
    yield serve
    from tailrace.runtime.ray.engines import shutdown_engines

    shutdown_engines()
    serve.shutdown()


@pytest.fixture
def engine(serve_on):
    """Opens fake engines on Serve under fresh names; deletes their deployments after."""
    from tests.runtime.engine_serve_fakes import serve_engine

    opened = []

    def open_(cluster: dict, **kw):
        eng = serve_engine(f"c{uuid.uuid4().hex[:8]}",
                           {"backend": "counter", "model": "counter", **kw,
                            "cluster": {"num_cpus": SMALL, **cluster}})
        opened.append(eng)
        return eng

    yield open_
    for eng in opened:
        serve_on.delete(eng.app)


def test_two_replicas_both_serve_and_every_handle_shares_them(engine):
    from tailrace.runtime.ray.engine_serve import ServeEngine, cluster_pool_statistics
    from tests.runtime.engine_serve_fakes import FakeReplica, replica_actors

    eng = engine({"replicas": 2}, delay=0.01)
    replicas = replica_actors(eng)
    assert len(replicas) == 2
    gens = eng.generate([req(5) for _ in range(16)])  # 16 calls at once, ~50 ms each
    assert [g.text for g in gens] == [counted(5)] * 16
    assert len({g.extra["pid"] for g in gens}) == 2
    again = ServeEngine(eng.name, eng._spec, body=FakeReplica)  # another stage's handle
    assert again.app == eng.app and replica_actors(again) == replicas  # not redeployed
    stats = cluster_pool_statistics()[eng.name]
    assert (stats["app"], stats["status"], stats["replicas"]) == (eng.app, "RUNNING", 2)
    assert sorted(stats["ongoing"]) == sorted(r.rsplit("#", 1)[1] for r in replicas)


def test_pieces_stream_in_order_while_the_engine_is_still_generating(engine):
    import ray

    from tests.runtime.ray_engine_fakes import signal

    hold = f"hold-{uuid.uuid4().hex[:8]}"
    sig = signal(hold)
    try:
        eng = engine({"replicas": 2}, hold=hold)
        got: dict[int, list[str]] = {0: [], 1: [], 2: []}

        def on_token(i: int, piece: str) -> bool:
            if i == 0 and not got[0]:  # request 0's engine waits for this before going on
                sig.send.remote()
            got[i].append(piece)
            return True

        gens = eng.generate([req(40), req(7), req(1)], on_token)
        assert got[0][0] == "t0 "  # the first piece, alone: the engine was held after it
        for i, n in enumerate((40, 7, 1)):
            assert "".join(got[i]) == gens[i].text == counted(n)
            assert gens[i].finish_reason == "length"
    finally:
        ray.kill(sig)


def test_refusing_one_request_stops_only_it_in_its_replica(engine):
    eng = engine({"replicas": 1}, delay=0.001)
    seen: list[tuple[int, str]] = []

    def on_token(i: int, piece: str) -> bool:
        seen.append((i, piece))
        return i != 0  # refuse request 0 (endless) from its first piece on

    gens = eng.generate([req(0), req(30)], on_token)
    refused = [p for i, p in seen if i == 0]
    assert len(refused) == 1  # nothing handed on after False
    assert (gens[0].text, gens[0].finish_reason) == (refused[0], "cancelled")
    assert (gens[1].text, gens[1].finish_reason) == (counted(30), "length")
    log = wait_until(lambda: [g for g in eng.handle().log.remote().result()
                              if g.finish_reason == "cancelled"], "the replica to stop it")
    assert 0 < log[0].completion_tokens < 1_000_000  # stopped in the replica, not capped


def test_a_caller_that_stops_reading_cancels_its_requests(engine):
    eng = engine({"replicas": 1}, delay=0.001)

    def on_token(i: int, piece: str) -> bool:
        raise RuntimeError("the consumer broke")

    with pytest.raises(RuntimeError, match="the consumer broke"):
        eng.generate([req(0)], on_token)  # endless unless stopped
    log = wait_until(lambda: eng.handle().log.remote().result(), "the replica to stop it")
    assert [g.finish_reason for g in log] == ["cancelled"]


def test_an_engine_error_keeps_its_message(engine):
    eng = engine({"replicas": 1}, fail_after=3)
    with pytest.raises(EngineError, match="counter engine failed after 3 tokens"):
        eng.generate([req(10)])
    with pytest.raises(EngineError, match="counter engine failed after 3 tokens"):
        eng.generate([req(10)], lambda i, p: True)


def test_a_replica_killed_mid_stream_is_a_clear_error_and_the_deployment_recovers(
        engine):
    import ray

    from tests.runtime.engine_serve_fakes import replica_actors, running_replicas
    from tests.runtime.ray_engine_fakes import signal

    hold = f"hold-{uuid.uuid4().hex[:8]}"
    sig = signal(hold)  # never sent before the kill: the engine holds after the first piece
    try:
        eng = engine({"replicas": 1}, hold=hold)
        (replica,) = replica_actors(eng)

        def on_token(i: int, piece: str) -> bool:
            ray.kill(ray.get_actor(replica, namespace="serve"))
            return True

        with pytest.raises(EngineError, match=f"engine '{eng.name}': its replica died while "
                                              "streaming"):
            eng.generate([req(5)], on_token)
        sig.send.remote()  # the new replica's engine need not wait
        wait_until(lambda: running_replicas(eng) == 1 and replica_actors(eng) != [replica],
                   "Serve to replace the replica")
        pieces: list[str] = []
        gens = eng.generate([req(5)], lambda i, p: pieces.append(p))
        assert "".join(pieces) == gens[0].text == counted(5)
    finally:
        ray.kill(sig)


def test_a_replica_that_dies_before_streaming_anything_is_retried(engine, tmp_path):
    marker = tmp_path / "died"
    eng = engine({"replicas": 1}, die_once=str(marker))
    pieces: list[str] = []
    gens = eng.generate([req(6)], lambda i, p: pieces.append(p))
    assert marker.exists()  # the first attempt's replica process died
    assert "".join(pieces) == gens[0].text == counted(6)


@pytest.mark.slow
def test_replicas_are_added_under_sustained_load_and_removed_after(engine):
    from tests.runtime.engine_serve_fakes import running_replicas

    eng = engine({"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                  "upscale_delay_s": 0, "downscale_delay_s": 0, "look_back_period_s": 2},
                 delay=0.005)
    assert running_replicas(eng) == 1
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            eng.generate([req(40) for _ in range(4)])  # 4 in flight, target 1 per replica

    workers = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        wait_until(lambda: running_replicas(eng) == 2, "Serve to add a replica", 120)
    finally:
        stop.set()
        for w in workers:
            w.join()
    wait_until(lambda: running_replicas(eng) == 1, "Serve to remove it when idle", 120)


# -- in a pipeline on the Ray runtime (a real embedding model) ---------------------------------

EMB = {"backend": "onnx", "model": "minilm-l3", "n_threads": 1}


def embed_pipeline(name: str, spec: dict):
    import tailrace as tr

    p = tr.Pipeline(name, engines={"emb": spec})
    (p.source(fields=["text"])
     .apply("embed", id="vec", engine="emb", input="text", output="v", replicas=2)
     .apply("embed", id="again", engine="emb", input="text", output="w")
     .sink())
    return p


@pytest.mark.engine
def test_every_stage_and_pipeline_of_a_ray_run_shares_one_deployment(serve_on):
    import numpy as np

    import tailrace as tr
    from tailrace.runtime.ray.engine_serve import cluster_pool_statistics
    from tailrace.runtime.ray.engines import shutdown_engines

    records = [{"text": f"a sentence about topic number {i}"} for i in range(40)]
    local = {r["text"]: r["v"] for r in tr.run(embed_pipeline("l", EMB), input=records).outputs}
    spread = {**EMB, "cluster": {"replicas": 2, "num_cpus": SMALL}}
    try:
        for name in ("a", "b"):
            result = tr.run(embed_pipeline(name, spread), runtime="ray", input=records)
            assert not result.errors and len(result.outputs) == len(records)
            for r in result.outputs:
                assert np.allclose(r["v"], local[r["text"]], atol=1e-5)
                assert np.allclose(r["w"], r["v"], atol=1e-6)
        stats = cluster_pool_statistics()
        assert list(stats) == ["emb"] and stats["emb"]["replicas"] == 2
    finally:
        assert shutdown_engines() >= 1


@pytest.mark.engine
def test_an_engine_that_cannot_start_fails_the_run_clearly(serve_on, tmp_path):
    import tailrace as tr

    (tmp_path / "none.onnx").write_bytes(b"not a model")
    bad = {**EMB, "path": str(tmp_path / "none.onnx"), "cluster": {"num_cpus": SMALL}}
    with pytest.raises(tr.TailraceError, match="engine 'emb' failed to start on the "
                                               "cluster: .*cannot load ONNX model"):
        tr.run(embed_pipeline("broken", bad), runtime="ray", input=[{"text": "x"}])
    status = serve_on.status().applications  # deleted or going: no replica keeps trying
    assert all(s.status == "DELETING" for a, s in status.items()
               if a.startswith("tailrace-engine-emb-"))
