"""Ingest: the ingest pipeline vs the embedder alone, incremental re-ingest, long documents.

1. Throughput: a folder of long Markdown files built from the Wikipedia corpus (``--per-file``
   articles a file, each under its own ``# Title`` heading) goes through ``tailrace
   ingest`` (files -> convert -> chunk -> embed -> index write) into a fresh index; the
   same chunks' texts are then embedded by ``engine.embed`` directly in batches of the same
   size (64). Prints chunks/s of each and the ratio (target >= 0.95): parsing, chunking and
   the index write must hide behind the embedder. Best of ``--repeat`` alternating runs.
2. Incremental: ingest the unchanged folder again: seconds, embedding calls (must be 0).
3. Long documents (``--long``): the whole corpus as long files, recall@10 / MRR@10 of the
   FanOutQA evidence page with chunking vs the one-summary-per-document index (``tailrace
   ingest`` of the bundled corpus). A chunk's article is its heading; hits are de-duplicated
   by article (50 chunks searched) before the top 10 are scored.

    python bench/ingest.py                 # 1 and 2 on 2,000 articles
    python bench/ingest.py --long          # also 3, on the whole corpus (minutes)
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from tailrace.engines import open_engine
from tailrace.engines.onnx import OnnxEmbedder
from tailrace.stores.corpus import read_wiki

EMBEDDER = "minilm-l6-int8"
ORIGINAL_HOME = Path(os.environ.get("TAILRACE_HOME", Path.home() / ".cache" / "tailrace"))
BATCH = 64


def build_long_corpus(folder: Path, docs: list[dict], per_file: int) -> list[Path]:
    """``docs`` as Markdown files of ``per_file`` articles each, one ``# Title`` heading
    per article; returns the files."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for n, i in enumerate(range(0, len(docs), per_file)):
        part = docs[i:i + per_file]
        f = folder / f"wiki-{n:04d}.md"
        f.write_text(f"---\ntitle: Wikipedia part {n}\n---\n" + "\n\n".join(
            f"# {d['title']}\n\n{d['text']}" for d in part) + "\n", encoding="utf-8")
        files.append(f)
    return files


class Counter:
    """Counts OnnxEmbedder.embed calls and texts (patched on the class, so engines the
    pipeline opens are counted too)."""

    def __init__(self) -> None:
        self.calls = self.texts = 0
        real = OnnxEmbedder.embed

        def counting(engine, texts):
            self.calls += 1
            self.texts += len(texts)
            return real(engine, texts)

        OnnxEmbedder.embed = counting  # type: ignore[method-assign]


def ingest_once(folder: Path, index: str, force: bool = True):
    from tailrace.cli.ingest_files import ingest_files

    t0 = time.perf_counter()
    res = ingest_files([str(folder)], index=index, quiet=True, force=force)
    return time.perf_counter() - t0, res


def direct_once(engine, texts: list[str]) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(texts), BATCH):
        engine.embed(texts[i:i + BATCH])
    return time.perf_counter() - t0


def chunk_texts(index_path: str) -> list[str]:
    """The texts the pipeline embedded: each chunk's context line and text."""
    from tailrace.stores.chunking import Chunk
    from tailrace.stores.vector_index import VectorIndex

    return [Chunk(d["text"], d["start"], d["end"], d["heading"], 0).context(d["title"])
            for d in VectorIndex.open(index_path).docs]


def long_recall(index_path: str, engine, k: int = 10, depth: int = 50) -> tuple[float, float]:
    """recall@k and MRR@k of the evidence article, chunk hits de-duplicated by article."""
    from tailrace.stores.corpus import read_fanoutqa
    from tailrace.stores.vector_index import VectorIndex

    index = VectorIndex.open(index_path)
    titles = {d["heading"].split(" > ")[0] for d in index.docs}
    qs = read_fanoutqa(titles)
    hits = index.search(engine.embed([q.question for q in qs]), depth)
    recall = mrr = 0.0
    for q, h in zip(qs, hits, strict=True):
        seen: list[str] = []
        for d in h:
            art = d["heading"].split(" > ")[0]
            if art not in seen:
                seen.append(art)
        top = seen[:k]
        if q.evidence in top:
            recall += 1
            mrr += 1 / (top.index(q.evidence) + 1)
    print(f"   {len(qs)} questions")
    return recall / len(qs), mrr / len(qs)


def summary_recall(engine, k: int = 10) -> tuple[float, float]:
    from tailrace.cli.evaluate import retrieval_metrics
    from tailrace.cli.ingest import ingest
    from tailrace.stores.corpus import read_fanoutqa
    from tailrace.stores.vector_index import VectorIndex

    res = ingest(index=str(ORIGINAL_HOME / "indexes" / "wiki"), quiet=True)  # cached if built
    index = VectorIndex.open(res.path)
    qs = read_fanoutqa({d["title"] for d in index.docs})
    return retrieval_metrics(index, engine, qs, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--articles", type=int, default=2000, help="articles for 1 and 2")
    ap.add_argument("--per-file", type=int, default=50, help="articles per long file")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--long", action="store_true", help="also the long-document recall check")
    args = ap.parse_args()
    home = tempfile.mkdtemp(prefix="tailrace-bench-ingest-")
    os.environ["TAILRACE_HOME"] = home
    print(f"# ingest bench on {platform.machine()} {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    counter = Counter()
    docs = read_wiki(limit=args.articles)
    folder = Path(home) / "corpus"
    files = build_long_corpus(folder, docs, args.per_file)
    engine = open_engine({"backend": "onnx", "model": EMBEDDER, "batch_size": BATCH})
    engine.embed(["warm up"] * BATCH)
    _, res = ingest_once(folder, "bench")  # warm-up, and the chunks to compare with
    texts = chunk_texts(res.path)
    best_pipe = best_direct = float("inf")
    for _ in range(args.repeat):
        best_direct = min(best_direct, direct_once(engine, texts))
        secs, res = ingest_once(folder, "bench")
        best_pipe = min(best_pipe, secs)
    n = res.chunks
    print(f"1. {len(files)} files, {res.documents} documents, {n} chunks "
          f"({args.articles} articles, {args.per_file} a file)")
    print(f"   ingest pipeline (parse+chunk+embed+write): {n / best_pipe:8.1f} chunks/s "
          f"({best_pipe:.2f} s)")
    print(f"   embedder alone, same chunks, batch {BATCH}: {n / best_direct:8.1f} chunks/s "
          f"({best_direct:.2f} s)")
    print(f"   ratio: {best_direct / best_pipe:.3f} (target >= 0.95)")
    calls = counter.calls
    secs, again = ingest_once(folder, "bench", force=False)
    print(f"2. re-ingest of the unchanged folder: {secs:.2f} s, "
          f"{counter.calls - calls} embedding calls, index rebuilt: {again.built}")
    (files[0]).write_text(files[0].read_text(encoding="utf-8") + "\nOne more line.\n",
                          encoding="utf-8")
    calls, texts_before = counter.calls, counter.texts
    secs, again = ingest_once(folder, "bench", force=False)
    print(f"   after changing 1 of {len(files)} files: {secs:.2f} s, "
          f"{counter.texts - texts_before} chunks embedded ({again.embedded} file)")
    if args.long:
        all_docs = read_wiki()
        long_folder = Path(home) / "long"
        long_files = build_long_corpus(long_folder, all_docs, args.per_file)
        t0 = time.perf_counter()
        _, res = ingest_once(long_folder, "long")
        print(f"3. long documents: {len(long_files)} files of {args.per_file} articles, "
              f"{res.chunks} chunks, ingested in {time.perf_counter() - t0:.0f} s")
        r, m = long_recall(res.path, engine)
        print(f"   chunked long files:        recall@10 {r:.3f}  MRR@10 {m:.3f}")
        r0, m0 = summary_recall(engine)
        print(f"   one summary per document:  recall@10 {r0:.3f}  MRR@10 {m0:.3f}")
        print(f"   difference: {r - r0:+.3f} (target within 0.01)")


if __name__ == "__main__":
    main()
