"""Retrieval latency: one query as a served ``retrieve`` stage makes it, dense, sparse
(BM25) and hybrid, with and without a metadata filter, at 10k and 100k chunks.

The chunks are synthetic, made from the bundled wiki index (10,033 summaries, run
``tailrace ingest`` first): copy j of summary i keeps its text with the words of one
sentence shuffled (so BM25 statistics differ per copy) and its vector plus Gaussian
noise (sigma 0.05 per dimension, renormalised), so 100k chunks are ten perturbed copies
of the corpus, not 100k distinct documents. Each chunk gets metadata as ingest writes
it: ``path`` (one of 1,000 files), ``page`` (0-49) and ``mtime`` (a day of 2026). The
queries are the first ``--queries`` FanOutQA questions, embedded once with the index's
model. The filter keeps ``page`` 0-4 of files modified in the first half of 2026 (about
5% of the chunks). Each query is one call (a lone request; a micro-batch of many is
faster per query); p50/p99 over the queries, after one warm-up pass. Building the
filter's selection (once per stage, at start) and the BM25 index are timed too.

    python bench/retrieval.py [--sizes 10000 100000] [--queries 200] [--kind flat]
                              [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from tailrace.engines import open_engine
from tailrace.operators.retrieval import index_dir
from tailrace.stores.corpus import read_fanoutqa
from tailrace.stores.filters import compile_filter
from tailrace.stores.vector_index import VectorIndex

FILTER = {"page": {"lt": 5}, "mtime": {"gte": "2026-01-01", "lt": "2026-07-01"}}


def synthetic(base: VectorIndex, n: int, seed: int = 0) -> tuple[np.ndarray, list[dict]]:
    """``n`` chunks made from the base index's documents and vectors (see module doc)."""
    rng = np.random.default_rng(seed)
    shuffle = random.Random(seed)
    vecs = base._index.reconstruct_n(0, len(base))  # noqa: SLF001 - a flat index's vectors
    out_v, out_d = [], []
    for j in range(0, n, len(base)):
        take = min(len(base), n - j)
        v = vecs[:take] if j == 0 else vecs[:take] + rng.normal(0, 0.05, (take, vecs.shape[1]))
        out_v.append((v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32))
        for i, d in enumerate(base.docs[:take]):
            text = d["text"]
            if j:
                sents = text.split(". ")
                words = sents[i % len(sents)].split()
                shuffle.shuffle(words)
                sents[i % len(sents)] = " ".join(words)
                text = ". ".join(sents)
            c = j + i
            out_d.append({"id": str(c), "doc_id": d["id"], "title": d["title"], "text": text,
                          "path": f"corpus/{c % 1000:03d}.md", "page": c % 50,
                          "mtime": f"2026-{1 + c % 12:02d}-{1 + c % 28:02d}"})
    return np.concatenate(out_v), out_d


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def timed(fn, queries: list) -> list[float]:
    for q in queries[:20]:
        fn(q)  # warm-up
    out = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--kind", default="flat", choices=["flat", "hnsw"])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1,
                    help="faiss OpenMP threads (1: steady lone-query latency on a shared "
                         "machine)")
    args = ap.parse_args()
    import faiss

    faiss.omp_set_num_threads(args.threads)

    base = VectorIndex.open(index_dir("wiki"))
    qs = [q.question for q in read_fanoutqa({d["title"] for d in base.docs},
                                            args.queries)]
    qv = open_engine({"backend": "onnx", "model": base.model}).embed(qs)
    k = args.k
    print(f"{len(qs)} queries, k={k}, {args.kind} index, {args.threads} faiss thread(s); "
          "latency per lone query in ms")
    print("| chunks | mode | filter | p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for n in args.sizes:
        vecs, docs = synthetic(base, n)
        idx = VectorIndex.create(vecs.shape[1], model=base.model, kind=args.kind)
        idx.add(vecs, docs)
        t0 = time.perf_counter()
        idx.sparse()
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        allow = idx.select(compile_filter(FILTER))
        select = time.perf_counter() - t0
        pairs = list(zip(qv, qs, strict=True))
        for label, sel in (("none", None), (f"{len(allow) / n:.0%} kept", allow)):
            runs = {
                "dense": lambda p, s=sel: idx.search(p[0], k, allow=s),
                "sparse": lambda p, s=sel: idx.search_text([p[1]], k, allow=s),
                "hybrid": lambda p, s=sel: idx.hybrid_search(p[0], [p[1]], k, allow=s),
            }
            for mode, fn in runs.items():
                ms = timed(fn, pairs)
                print(f"| {n:,} | {mode} | {label} | {statistics.median(ms):.2f} | "
                      f"{pct(ms, 99):.2f} |", flush=True)
        print(f"|  {n:,} | (BM25 index build {build:.1f} s; filter selection "
              f"{select * 1e3:.0f} ms, once per stage) | | | |", flush=True)


if __name__ == "__main__":
    main()
