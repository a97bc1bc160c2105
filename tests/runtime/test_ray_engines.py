"""Engines on Ray are cluster actors shared by every stage replica and every pipeline."""

import numpy as np
import pytest

import tailrace as tr
from tests.conftest import wait_until

pytestmark = [pytest.mark.engine]

EMB = {"backend": "onnx", "model": "minilm-l3", "n_threads": 1}
TEXTS = [f"a sentence about topic number {i}" for i in range(40)]


def embed_pipeline(name: str) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"emb": EMB})
    (p.source(fields=["text"])
     .apply("embed", id="vec", engine="emb", input="text", output="v", replicas=2)
     .apply("embed", id="again", engine="emb", input="text", output="w")
     .sink())
    return p


def engine_actors(ray) -> list[str]:
    from ray.util import list_named_actors

    from tailrace.runtime.ray.engines import NAMESPACE

    return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and a["name"].startswith("tailrace-engine-"))


def test_every_stage_and_pipeline_shares_one_engine_actor(ray_session):
    from tailrace.runtime.ray.engines import shutdown_engines

    shutdown_engines()
    try:
        records = [{"text": t} for t in TEXTS]
        local = {r["text"]: r["v"] for r in tr.run(embed_pipeline("l"), input=records).outputs}
        first = tr.run(embed_pipeline("a"), runtime="ray", input=records)
        second = tr.run(embed_pipeline("b"), runtime="ray", input=records)
        assert not first.errors and not second.errors
        actors = engine_actors(ray_session)
        assert len(actors) == 1 and actors[0].startswith("tailrace-engine-emb-")
        for result in (first, second):
            assert len(result.outputs) == len(TEXTS)
            for r in result.outputs:
                assert np.allclose(r["v"], local[r["text"]], atol=1e-5)
                assert np.allclose(r["w"], r["v"], atol=1e-6)
    finally:
        assert shutdown_engines() >= 1


def test_an_engine_that_cannot_start_on_the_cluster_fails_the_run_clearly(ray_session,
                                                                          tmp_path):
    bad = {"backend": "onnx", "model": "minilm-l3", "path": str(tmp_path / "none.onnx")}
    (tmp_path / "none.onnx").write_bytes(b"not a model")
    p = tr.Pipeline("broken", engines={"emb": bad})
    p.source(fields=["text"]).apply("embed", id="vec", engine="emb", input="text",
                                   output="v").sink()
    from tailrace.runtime.ray.engines import shutdown_engines

    try:
        with pytest.raises(tr.TailraceError, match="engine 'emb' failed to start on the "
                                                   "cluster"):
            tr.run(p, runtime="ray", input=[{"text": "x"}])
    finally:
        shutdown_engines()


@pytest.fixture
def owner_actor(ray_session):
    """An actor that opens the engine first, so it owns the engine's actor."""

    @ray_session.remote(num_cpus=0)
    class Owner:
        def open(self):
            from tailrace.runtime.ray.engines import open_cluster_engine

            return len(open_cluster_engine("emb", EMB).embed(["warm up"]))

    owner = Owner.remote()
    yield owner
    ray_session.kill(owner)


def test_a_handle_outlives_the_process_that_created_its_engine_actor(ray_session,
                                                                    owner_actor):
    """An engine actor dies with the process that created it (a stage host), restarts or
    not: a handle elsewhere then creates the engine anew instead of failing every call."""
    from tailrace.runtime.ray.engines import ClusterEngine, shutdown_engines

    shutdown_engines()
    try:
        assert ray_session.get(owner_actor.open.remote()) == 1
        (before,) = engine_actors(ray_session)
        handle = ClusterEngine("emb", EMB)  # finds the owner's actor by name
        assert handle.embed(["one"]).shape[0] == 1
        ray_session.kill(owner_actor)  # its engine actor dies with it, for good
        wait_until(lambda: not engine_actors(ray_session), what="the engine actor reaped")
        vecs = handle.embed(["two", "three"])  # a new engine actor, made by this handle
        assert vecs.shape[0] == 2
        assert engine_actors(ray_session) == [before]  # one engine, by the same name
    finally:
        shutdown_engines()
