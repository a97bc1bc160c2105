"""Engine pools declared in a pipeline's ``engines:`` block (``replicas:``/``endpoints:``).

Fast tests use the fake backend on thread replicas; the last runs real llama.cpp replica
processes shared by two pipelines (``engine`` mark).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

import tailrace as tr
from tailrace.engines import BACKENDS, open_engine
from tailrace.engines.pool import close_pools
from tailrace.errors import PlanError

from .test_pool import FakeEngine, chat


class FileFake(FakeEngine):
    """The fake engine, given a model ``path`` (so specs pass the model-file check); it
    completes prompts (no chat template)."""

    chat = False

    def __init__(self, path: str, **kw):
        super().__init__(**kw)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setitem(BACKENDS, "fake", (__name__, "FileFake", ("generate", "embed")))
    (tmp_path / "fake.bin").write_bytes(b"")
    yield {"backend": "fake", "model": "fake", "path": str(tmp_path / "fake.bin")}
    close_pools()


def generate_pipeline(name: str, engine: dict) -> tr.Pipeline:
    p = tr.Pipeline(name, engines={"llm": engine})
    (p.source(fields=["q"])
     .apply("generate", id="gen", engine="llm", input="q", output="a", max_tokens=8)
     .sink())
    return p


def test_an_engine_with_replicas_is_a_shared_pool(fake):
    spec = {**fake, "endpoints": ["a", "b"], "max_wait_ms": 20}
    results: dict[str, list] = {}

    def go(name: str, texts: list[str]) -> None:
        result = tr.run(generate_pipeline(name, spec), input=[{"q": t} for t in texts])
        assert result.errors == []
        results[name] = result.outputs

    threads = [threading.Thread(target=go, args=(n, [f"{n}-{i}" for i in range(20)]))
               for n in ("one", "two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool = open_engine(spec, "llm")
    assert pool is open_engine({**spec, "_name": "llm"})  # every pipeline: one pool by name
    for name in ("one", "two"):
        assert sorted(r["a"] for r in results[name]) == sorted(
            f"{name}-{i}".upper() for i in range(20))
    stats = pool.statistics()
    assert sum(r.requests for r in stats.replicas) == 40  # every record went through it


def test_a_pool_counts_tokens_and_knows_its_engine_after_start(fake):
    pool = open_engine({**fake, "replicas": 1, "isolation": "thread"}, "llm")
    assert pool.context_length == 100 and pool.count_tokens("abcdefgh") == 3
    assert pool.chat is False  # as the replicas' engine reported


@pytest.mark.parametrize(("extra", "match"), [
    ({"replicas": 0}, r"engine 'llm': replicas must be a positive integer .* got 0"),
    ({"replicas": "2"}, r"engine 'llm': replicas must be a positive integer .* got '2'"),
    ({"endpoints": []}, r"engine 'llm': endpoints must be a non-empty list of base URLs"),
    ({"replicas": 1, "endpoints": ["x"]}, r"engine 'llm': give either replicas: N .* not both"),
    ({"replicas": 1, "dispatch": "fastest"},
     r"engine pool 'llm': unknown dispatch policy 'fastest'; known: least_work, "
     r"prefix_affinity, round_robin"),
    ({"replicas": 2, "dispatch": "prefix_affinity", "affinity_slack": -1},
     r"engine pool 'llm': affinity_slack must be an integer >= 0 \(predicted tokens\), got -1"),
    ({"replicas": 2, "affinity_slack": 512},
     r"engine pool 'llm': affinity_slack applies to dispatch: prefix_affinity, not "
     r"'least_work'"),
    ({"replicas": 1, "max_batch_size": 0}, r"max_batch_size must be an integer >= 1"),
    ({"max_batch_size": 4}, r"engine 'llm': max_batch_size configure an engine pool; add "
                            r"replicas: N"),
])
def test_bad_pool_specs_are_plan_errors_naming_the_stage(fake, extra, match):
    with pytest.raises(PlanError, match=match) as info:
        tr.compile_pipeline(generate_pipeline("bad", {**fake, **extra}))
    assert info.value.stage == "gen"


def test_a_pool_spec_in_yaml(fake, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\npipeline: pooled\n"
                    f"engines:\n  llm: {{backend: fake, path: '{fake['path']}', replicas: 2, "
                    "isolation: thread, max_batch_size: 4}\n"
                    "source: {fields: [q]}\n"
                    "stages:\n  - {id: gen, op: generate, engine: llm, input: q, output: a}\n")
    out = tr.run(tr.Pipeline.from_yaml(path), input=[{"q": "x"}, {"q": "y"}]).outputs
    assert sorted(r["a"] for r in out) == ["X", "Y"]
    pool = open_engine({"backend": "fake", "path": fake["path"], "replicas": 2}, "llm")
    assert len(pool.statistics().replicas) == 2


LLAMA_POOL = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 1,
              "n_ctx": 512, "n_seq_max": 4, "replicas": 2, "max_wait_ms": 20}


@pytest.mark.engine
def test_two_pipelines_share_llama_replica_processes():
    pytest.importorskip("llama_cpp")
    from tailrace.engines.llama_cpp import LlamaCppEngine

    questions = ["What is the capital of France?", "Name a primary colour.",
                 "Who wrote Hamlet?", "What is 2 + 2?"]
    local = LlamaCppEngine(**{k: v for k, v in LLAMA_POOL.items()
                              if k not in ("backend", "replicas", "max_wait_ms")})
    try:
        want = {q: local.generate([chat(q)])[0].text for q in questions}
        tokens = {q: local.count_tokens(q) for q in questions}
    finally:
        local.close()
    try:
        results: dict[str, list] = {}
        # Both pipelines reach the pool at the same instant with 2 requests each (half a
        # batch), and the pool waits up to 2 s for more: their requests share a batch
        # however loaded the machine is (it used to depend on timing and flaked).
        spec = {**LLAMA_POOL, "max_wait_ms": 2000}
        together = threading.Barrier(2)
        asked = {"a": questions[:2], "b": questions[2:]}

        def go(name: str) -> None:
            p = tr.Pipeline(name, engines={"llm": spec})
            (p.source(fields=["q"]).map(lambda r: together.wait(60) and r or r, queue=2)
             .apply("generate", id="gen", engine="llm", input="q", output="a",
                    max_tokens=8).sink())
            results[name] = tr.run(p, input=[{"q": q} for q in asked[name]]).outputs

        threads = [threading.Thread(target=go, args=(n,)) for n in ("a", "b")]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert time.monotonic() - t0 < 300, "pipelines did not finish"
        pool = open_engine(spec, "llm")
        stats = pool.statistics()
        for name in ("a", "b"):
            assert {r["q"]: r["a"] for r in results[name]} == \
                {q: want[q] for q in asked[name]}  # greedy: same text
        assert {q: pool.count_tokens(q) for q in questions} == tokens  # exact, in this process
        assert pool.context_length == 512 and pool.chat is True
        pids = {r.pid for r in stats.replicas}
        assert len(pids) == 2 and os.getpid() not in pids
        assert sum(r.calls for r in stats.replicas) == stats.batches and stats.shared_batches
    finally:
        close_pools()
    assert multiprocessing.active_children() == []


@pytest.mark.engine
def test_a_caller_that_goes_away_frees_its_sequence_in_a_replica_process():
    pytest.importorskip("llama_cpp")
    from tailrace.engines.pool import EnginePool

    spec = {k: v for k, v in LLAMA_POOL.items() if k not in ("replicas", "max_wait_ms")}
    count = chat("Count from 1 to 100, separated by commas.", max_tokens=120)
    pieces: list[str] = []
    with EnginePool("llm", spec, replicas=1) as pool:
        [gone] = pool.generate([count], on_token=lambda i, t: pieces.append(t) or
                               len(pieces) < 3)
        [full] = pool.generate([count])
    assert gone.finish_reason == "cancelled" and gone.completion_tokens < 10
    assert full.finish_reason == "length" and full.completion_tokens == 120
    assert full.text.startswith(gone.text)
