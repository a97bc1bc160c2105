"""``tailrace ingest PATH... --index NAME``: index your own files, incrementally.

Ingest is a tailrace pipeline (``ingest_pipeline``: files -> convert -> chunk -> embed
-> index write), run on the new or changed files only (by content hash): each file's
chunks and vectors are cached beside the index, which is rebuilt from the cache.
docs/ingest.md ("Ingest is a pipeline", "Incremental").
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..api.pipeline import Pipeline
from ..errors import StoreError
from ..observability.progress import Progress
from ..operators.retrieval import index_dir
from ..stores.chunking import DEFAULT_CHUNK_TOKENS, DEFAULT_OVERLAP, Chunker
from ..stores.corpus import file_digest
from ..stores.loaders import SUFFIXES, Columns, csv_header, load

CACHE_VERSION = "files-v1"
#: chunk records per embedding batch (the embed stage's batch contract)
EMBED_BATCH = 64


@dataclass(frozen=True)
class SourceFile:
    """A file to index: ``key`` names its cache entry (settings, path and content hash)."""

    path: str
    key: str
    mtime: str


@dataclass
class FilesResult:
    """What an ingest of files did (``errors``: ``(path, reason)`` per unreadable file)."""

    path: str
    files: int
    embedded: int  # files converted, chunked and embedded this time
    unchanged: int
    removed: int
    documents: int
    chunks: int
    errors: list[tuple[str, str]] = field(default_factory=list)
    built: bool = True
    seconds: float = 0.0
    unsupported: int = 0  # files in the folders left out for their suffix


def _matches(rel: str, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(name, p) for p in patterns)


def discover(paths: list[str], include: list[str] | None = None,
             exclude: list[str] | None = None) -> tuple[list[Path], int]:
    """The files to ingest under ``paths`` (folders recursively, hidden entries skipped; a
    file named on its own is always taken: an unsupported one becomes an error record),
    filtered by the globs, sorted; and how many files of the folders were left out for
    their suffix. StoreError when a path is missing or nothing matches."""
    found: list[Path] = []
    unsupported = 0
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise StoreError(f"{raw}: no such file or folder")
        candidates = [p] if p.is_file() else [
            f for f in p.rglob("*")
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)]
        for f in candidates:
            rel = f.as_posix()
            if include and not _matches(rel, include):
                continue
            if exclude and _matches(rel, exclude):
                continue
            if p.is_file() or f.suffix.lower() in SUFFIXES:
                found.append(f)
            else:
                unsupported += 1
    files = sorted(set(found))
    if not files:
        what = ", ".join(paths)
        globs = (f" matching --include {' '.join(include)}" if include else "") + \
            (f" outside --exclude {' '.join(exclude)}" if exclude else "")
        raise StoreError(f"no files to ingest under {what}{globs} (supported: "
                         f"{', '.join(SUFFIXES)})")
    return files, unsupported


def check_columns(files: list[Path], cols: Columns) -> None:
    """A one-line StoreError when ``--text-columns``/``--metadata-columns`` name a column a
    CSV file lacks, or apply to no file at all."""
    if not cols.text and cols.metadata is None:
        return
    tabular = [f for f in files if f.suffix.lower() in (".csv", ".jsonl", ".json")]
    if not tabular:
        raise StoreError("--text-columns/--metadata-columns apply to .csv, .jsonl and .json "
                         "files, and none of those were found")
    for f in tabular:
        if f.suffix.lower() != ".csv":
            continue  # JSONL/JSON fields are checked per row (an error record per file)
        try:
            header = csv_header(f)
        except (OSError, UnicodeDecodeError):
            continue  # unreadable: becomes an error record
        for opt, names in (("--text-columns", cols.text), ("--metadata-columns",
                                                            cols.metadata or ())):
            for name in names:
                if name not in header:
                    raise StoreError(f"{opt}: column '{name}' is not in {f} (its columns: "
                                     f"{', '.join(header)})")


def _mtime(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat(timespec="seconds")


# -- the pipeline's functions (module level: they travel to Ray actors by reference) ------
class Convert:
    """flat_map: a file record -> its documents (StoreError: the file's error record)."""

    def __init__(self, columns: Columns) -> None:
        self.columns = columns

    def __call__(self, rec: dict) -> list[dict]:
        docs = load(Path(rec["path"]), rec["path"], self.columns)
        return [{"file": rec["key"], "path": rec["path"], "mtime": rec["mtime"], "n": n,
                 "last": n == len(docs) - 1, **d} for n, d in enumerate(docs)]


class ChunkDocs:
    """flat_map: a document -> chunk records ``{file, seq, doc, embed_text}``."""

    def __init__(self, chunker: Chunker) -> None:
        self.chunker = chunker

    def __call__(self, d: dict) -> list[dict]:
        chunks = self.chunker.chunk(d["text"], d["title"])
        pages = d.get("pages")
        out = []
        for i, c in enumerate(chunks):
            doc: dict[str, Any] = {"id": f"{d['doc_id']}#{i}", "doc_id": d["doc_id"],
                                   "title": d["title"], "text": c.text, "path": d["path"],
                                   "mtime": d["mtime"], "heading": c.heading,
                                   "start": c.start, "end": c.end}
            if pages:
                doc["page"] = sum(1 for p in pages if p <= c.start)
            doc.update({k: v for k, v in d["meta"].items() if k not in doc})
            out.append({"file": d["file"], "seq": (d["n"], i), "doc": doc,
                        "embed_text": c.context(d["title"]),
                        "file_done": d["last"] and i == len(chunks) - 1})
        return out


def ingest_pipeline(embedder: str, columns: Columns, chunker: Chunker) -> Pipeline:
    """files -> convert -> chunk -> embed -> index write; the source and the sink are
    bound at run time (``input=`` file records, ``output=`` a chunk collector)."""
    p = Pipeline("ingest", engines={"embedder": {"backend": "onnx", "model": embedder,
                                                 "batch_size": EMBED_BATCH}})
    s = p.source(id="files", fields=["path", "key", "mtime"])
    s = s.flat_map(Convert(columns), id="convert")
    s = s.flat_map(ChunkDocs(chunker), id="chunk")
    s = s.apply("embed", id="embed", engine="embedder", input="embed_text", output="vector",
                max_batch=EMBED_BATCH, batch={"max_size": EMBED_BATCH, "max_wait_ms": 5})
    s.sink(id="index_write")
    return p


# -- the cache ------------------------------------------------------------------------
def _cache_key(settings: str, path: Path) -> str:
    return hashlib.sha256(f"{settings}|{path.as_posix()}|{file_digest(path)}".encode()
                          ).hexdigest()[:32]


def _save_entry(cache: Path, key: str, vectors: Any, docs: list[dict]) -> None:
    import numpy as np

    tmp = cache / f".{key}.{os.getpid()}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, vectors=vectors, docs=np.array(json.dumps(docs, ensure_ascii=False)))
    os.replace(tmp, cache / f"{key}.npz")


def _load_entry(cache: Path, key: str) -> tuple[Any, list[dict]]:
    import numpy as np

    with np.load(cache / f"{key}.npz", allow_pickle=False) as z:
        return z["vectors"], json.loads(str(z["docs"]))


def ingest_files(paths: list[str], *, index: str, embedder: str = "minilm-l6-int8",
                 kind: str = "flat", include: list[str] | None = None,
                 exclude: list[str] | None = None, columns: Columns | None = None,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap: int = DEFAULT_OVERLAP,
                 runtime: str = "local", force: bool = False, quiet: bool = False,
                 plan_only: bool = False, stream: Any = None) -> FilesResult | str:
    """Index the files and folders (recursive) under ``paths`` as ``index`` (a name under
    ``$TAILRACE_HOME/indexes`` or a directory) in a ``kind`` (flat | hnsw) faiss index;
    only new or changed files are embedded (``force``: all), with the catalog ONNX model
    ``embedder``, whose tokenizer measures ``chunk_tokens`` and ``overlap``.

    include, exclude: globs on the path or the file name.
    columns:      text and metadata fields of JSONL/JSON/CSV rows.
    runtime:      ``local`` or ``ray`` for the ingest pipeline.
    quiet:        no progress bar and no stage table; ``stream``: where the error and
                  summary lines go (default: stderr, or nowhere when quiet).
    plan_only:    return the rendered plan and run nothing.
    A file that cannot be read is in ``result.errors`` as ``(path, reason)``; StoreError
    for bad arguments (a missing path, no files, a column a CSV file lacks).
    """
    from ..compiler import compile_pipeline
    from ..engines.models import model_info
    from ..stores.vector_index import VectorIndex

    columns = columns or Columns()
    chunker = Chunker(embedder, max_tokens=chunk_tokens, overlap=overlap)
    pipeline = ingest_pipeline(embedder, columns, chunker)
    if plan_only:
        return str(compile_pipeline(pipeline).render("text"))
    info = model_info(embedder, "onnx")
    files, unsupported = discover(paths, include, exclude)
    check_columns(files, columns)
    out = Path(index_dir(index))
    cache = Path(f"{out}.files")
    cache.mkdir(parents=True, exist_ok=True)
    settings = (f"{CACHE_VERSION}|{embedder}|{chunk_tokens}|{overlap}|{columns.text}|"
                f"{columns.metadata}")
    t0 = time.perf_counter()
    sources = [SourceFile(f.as_posix(), _cache_key(settings, f), _mtime(f)) for f in files]
    fingerprint = hashlib.sha256("|".join([kind] + [s.key for s in sources]).encode()
                                 ).hexdigest()[:16]
    log = stream if stream is not None else (io.StringIO() if quiet else sys.stderr)
    noise = io.StringIO() if quiet else log  # the progress bar and the stage table
    todo = [s for s in sources if force or not (cache / f"{s.key}.npz").exists()]
    if not todo and not force:
        try:
            cached = VectorIndex.open(out)
            if cached.fingerprint == fingerprint:
                n_docs = len({d.get("doc_id") for d in cached.docs})
                print(f"index '{index}' is up to date: {len(files):,} files, {n_docs:,} "
                      f"documents, {len(cached):,} chunks ({out})", file=log)
                return FilesResult(str(out), len(files), 0, len(files), 0, n_docs,
                                   len(cached), built=False)
        except StoreError:
            pass  # missing or stale: assemble it from the cache
    errors = _embed(todo, pipeline, cache, runtime, noise, quiet)
    failed = {p for p, _ in errors}
    idx = VectorIndex.create(info.dim, model=embedder, kind=kind)
    keep = set()
    for s in sources:
        if s.path in failed or not (cache / f"{s.key}.npz").exists():
            continue
        vectors, docs = _load_entry(cache, s.key)
        for d in docs:
            d["mtime"] = s.mtime
        if docs:
            idx.add(vectors, docs)
        keep.add(s.key)
    for entry in cache.glob("*.npz"):
        if entry.stem not in keep:
            entry.unlink()  # a changed or deleted file's chunks
    manifest = cache / "manifest.json"
    try:
        before = set(json.loads(manifest.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        before = set()
    removed = len(before - {s.path for s in sources})
    manifest.write_text(json.dumps({s.path: s.key for s in sources if s.key in keep},
                                   indent=0), encoding="utf-8")
    idx.save(out, fingerprint=fingerprint if not errors else f"{fingerprint}-partial")
    documents = len({d["doc_id"] for d in idx.docs})
    res = FilesResult(str(out), len(files), len(todo) - len(errors), len(files) - len(todo),
                      removed, documents, len(idx), errors, True, time.perf_counter() - t0,
                      unsupported)
    for path, reason in errors:
        print(f"tailrace: error: {reason if reason.startswith(path) else f'{path}: {reason}'}",
              file=log)
    print(f"index '{index}': {res.files:,} files ({res.embedded:,} embedded, "
          f"{res.unchanged:,} unchanged, {removed:,} removed, {len(errors):,} errors), "
          f"{documents:,} documents, {len(idx):,} chunks"
          + (f"; {unsupported:,} files of other types left out" if unsupported else "")
          + f" in {res.seconds:.1f}s -> {out}", file=log)
    return res


def _embed(todo: list[SourceFile], pipeline: Pipeline, cache: Path, runtime: str,
           log: Any, quiet: bool) -> list[tuple[str, str]]:
    """Run the ingest pipeline over ``todo`` and cache each good file's chunks and
    vectors; returns ``(path, reason)`` per file that failed."""
    import numpy as np

    from ..api.records import ErrorRecord
    from ..observability import format_stats
    from ..runtime import run

    if not todo:
        return []
    by_file: dict[str, list[dict]] = defaultdict(list)
    errors: dict[str, str] = {}
    by_key = {s.key: s for s in todo}
    bar = Progress(len(todo), "ingesting", unit="files", stream=log)

    def write(rec: dict) -> None:
        by_file[rec["file"]].append(rec)
        if rec["file_done"]:
            bar.update(1)

    def on_error(err: ErrorRecord) -> None:
        rec = err.input if isinstance(err.input, dict) else {}
        key = rec.get("key") or rec.get("file")
        errors.setdefault(key if key is not None else rec.get("path") or "?", err.message)

    with bar:
        result = run(pipeline, input=[{"path": s.path, "key": s.key, "mtime": s.mtime}
                                      for s in todo],
                     output=write, errors=on_error, runtime=runtime)
        bar.done = len(todo)
    if not quiet:
        print(format_stats(result.stats), file=log)
    for s in todo:
        if s.key in errors:
            continue
        recs = sorted(by_file.get(s.key, []), key=lambda r: tuple(r["seq"]))
        vectors = (np.stack([r["vector"] for r in recs]).astype(np.float32) if recs
                   else np.zeros((0, 1), dtype=np.float32))
        _save_entry(cache, s.key, vectors, [r["doc"] for r in recs])
    return [(by_key[k].path if k in by_key else k, msg) for k, msg in errors.items()]
