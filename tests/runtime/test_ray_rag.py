"""The RAG pipeline (real llama.cpp, ONNX and faiss) on Ray gives what it gives locally:
models and the index load inside the actors from the driver's TAILRACE_HOME."""

import pytest

import tailrace as tr
from tests.operators.test_rag import rag

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_rag_on_ray_answers_as_locally(tailrace_home, ray_session):
    qs = [{"question": "Who directed 2001: A Space Odyssey?"},
          {"question": "Which film did Stanley Kubrick make in 1968?"}]
    pipeline = rag(batch={"max_size": 8, "max_wait_ms": 5})
    local = tr.run(pipeline, input=qs)
    ray = tr.run(pipeline, runtime="ray", input=qs)
    assert not ray.errors
    key = lambda r: r["question"]  # noqa: E731
    assert sorted(ray.outputs, key=key) == sorted(local.outputs, key=key)
    assert ray.stats["answer"].batch_size.max == 2  # one batched engine call, as locally
