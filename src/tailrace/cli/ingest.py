"""``tailrace ingest``: build the vector index over the bundled Wikipedia corpus.

The index is cached under ``$TAILRACE_HOME/indexes/NAME`` with a fingerprint of its
inputs (corpus bytes, embedder, index kind, limit) and rebuilt only when they change.
"""

from __future__ import annotations

import hashlib
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..engines import open_engine
from ..errors import StoreError
from ..observability.progress import Progress
from ..operators.retrieval import index_dir
from ..stores.corpus import file_digest, read_wiki, wiki_path

DEFAULT_EMBEDDER = "minilm-l6-int8"


@dataclass(frozen=True)
class IngestResult:
    path: str
    documents: int
    built: bool  # False: the cached index was up to date
    seconds: float


def ingest(*, index: str = "wiki", embedder: str = DEFAULT_EMBEDDER, kind: str = "flat",
           corpus: str | None = None, limit: int | None = None, force: bool = False,
           batch: int = 256, quiet: bool = False) -> IngestResult:
    """Embed the corpus and save the index (skipped when the cached one is current)."""
    from ..stores.vector_index import VectorIndex

    src = Path(corpus) if corpus else wiki_path()
    if not src.exists():
        raise StoreError(f"{src}: no such corpus file")
    fingerprint = hashlib.sha256(
        f"v1|{file_digest(src)}|{embedder}|{kind}|{limit}".encode()).hexdigest()[:16]
    out = index_dir(index)
    if not force:
        try:
            cached = VectorIndex.open(out)
            if cached.fingerprint == fingerprint:
                if not quiet:
                    print(f"index '{index}' is up to date: {len(cached):,} documents, "
                          f"embedded with {cached.model} ({out})", file=sys.stderr)
                return IngestResult(out, len(cached), False, 0.0)
        except StoreError:
            pass  # missing or stale: build it
    docs = read_wiki(src, limit)
    engine = open_engine({"backend": "onnx", "model": embedder, "batch_size": 32})
    t0 = time.perf_counter()
    idx = VectorIndex.create(engine.dim, model=embedder, kind=kind)
    stream = sys.stderr if not quiet else io.StringIO()
    with Progress(len(docs), f"embedding {src.name} with {embedder}", stream=stream) as bar:
        for i in range(0, len(docs), batch):
            chunk = docs[i:i + batch]
            idx.add(engine.embed([f"{d['title']}. {d['text']}" for d in chunk]), chunk)
            bar.update(len(chunk))
    idx.save(out, fingerprint=fingerprint)
    secs = time.perf_counter() - t0
    if not quiet:
        print(f"index '{index}': {len(idx):,} documents in {secs:.1f}s -> {out}", file=sys.stderr)
    return IngestResult(out, len(idx), True, secs)
