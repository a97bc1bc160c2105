"""bench/retrieval.py's synthetic chunks: the asked count, ingest-like metadata, perturbed
copies, and a filter that keeps about 5% of them (a behavioural check, not a benchmark)."""

import importlib.util
from pathlib import Path

import numpy as np

from tailrace.stores.filters import compile_filter
from tailrace.stores.vector_index import VectorIndex

_PATH = Path(__file__).resolve().parents[2] / "bench" / "retrieval.py"
_spec = importlib.util.spec_from_file_location("bench_retrieval", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_synthetic_chunks_copy_and_perturb_the_base_index():
    rng = np.random.default_rng(7)  # not the bench's seed 0: its noise would be these
    vecs = rng.normal(size=(100, 8)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    base = VectorIndex.create(8, model="m")
    base.add(vecs, [{"id": str(i), "title": f"t{i}", "text": f"One two three. Four five "
                     f"six seven {i}."} for i in range(100)])
    v, docs = bench.synthetic(base, 1000)
    assert v.shape == (1000, 8) and len(docs) == 1000
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)
    assert np.allclose(v[:100], vecs) and not np.allclose(v[100:200], vecs)
    assert docs[0]["text"] == base.docs[0]["text"] and docs[100]["title"] == "t0"
    assert set(docs[0]) >= {"id", "doc_id", "title", "text", "path", "page", "mtime"}
    kept = compile_filter(bench.FILTER).mask(docs).mean()
    assert 0.03 < kept < 0.07
