"""The files of a live index: an atomic snapshot directory and a write-ahead log.

``DIR/snapshot`` (an ``atomic`` link to ``DIR/snapshot.vNNNNNN/``) holds ``index.faiss``,
``docs.jsonl`` (one ``{key, id, t, exp, doc}`` per vector) and ``meta.json`` (format,
model, count, the last logged ``seq`` it covers, the feeder ``cursor``). ``DIR/wal.jsonl``
holds one JSON change per line (``seq``, ``op``: upsert | delete | cursor); a snapshot
retires it as ``wal-SEQ.jsonl``, deleted once the snapshot covering it is linked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import StoreError
from .atomic import current, replace_dir

FORMAT_VERSION = 1


def faiss() -> Any:
    """The faiss module; StoreError with the install command if missing."""
    try:
        import faiss as module
    except ImportError:
        raise StoreError("vector indexes need faiss; install it with: pip install faiss-cpu") \
            from None
    return module


def write_snapshot(directory: Path, data: Any, docs: list[dict], meta: dict) -> Path:
    """Replace ``directory/snapshot`` atomically with ``data`` (the serialized faiss index,
    a uint8 array; None while empty), ``docs`` (one ``{key, id, t, exp, doc}`` per vector)
    and ``meta`` (meta.json); returns its path."""
    target = directory / "snapshot"
    with replace_dir(target) as tmp:
        if data is not None:
            (tmp / "index.faiss").write_bytes(data.tobytes())
        with open(tmp / "docs.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return target


def read_snapshot(directory: Path, name: str) -> tuple[dict, list[dict], Any] | None:
    """(meta, docs, faiss index or None) of ``directory``'s snapshot (recovered first: see
    ``atomic.current``); None if there is none. ``name`` is for messages."""
    snap = current(directory / "snapshot")
    if snap is None:
        return None
    import numpy as np

    index = None
    try:
        meta = json.loads((snap / "meta.json").read_text(encoding="utf-8"))
        if meta["format"] != FORMAT_VERSION:
            raise ValueError(f"format {meta['format']}, this tailrace reads {FORMAT_VERSION}")
        docs = [json.loads(line) for line in
                (snap / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
        if (snap / "index.faiss").exists():
            raw = np.frombuffer((snap / "index.faiss").read_bytes(), dtype=np.uint8)
            index = faiss().deserialize_index(raw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise StoreError(f"live index '{name}': snapshot at {snap} is corrupt ({e}); move it "
                         "away to start empty") from None
    if len(docs) != meta["count"] or (index is not None and index.ntotal != len(docs)):
        raise StoreError(f"live index '{name}': snapshot at {snap} is inconsistent (meta.json "
                         f"says {meta['count']}, docs.jsonl holds {len(docs)}); move it away")
    return meta, docs, index


def read_log(path: Path, after: int, name: str) -> list[dict]:
    """The changes in log ``path`` (a ``wal*.jsonl``; missing: none) with ``seq`` >
    ``after`` (the snapshot's), in order; ``name`` is for messages.

    A torn last line (the process died mid-write; that change never returned) is cut off
    the file, so later appends start on a line of their own; a bad line before the end
    means the log is corrupt (StoreError).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines: list[dict] = []
    good = 0  # bytes of complete, valid lines
    raw_lines = data.split(b"\n")
    for n, raw in enumerate(raw_lines, 1):
        if raw.strip():
            try:
                line = json.loads(raw)
            except ValueError:
                if n == len(raw_lines):  # no newline after it: a torn last write
                    break
                raise StoreError(f"live index '{name}': {path}:{n} is not a JSON log line; "
                                 "the log is corrupt") from None
            if line["seq"] > after:
                lines.append(line)
        good += len(raw) + 1
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return lines
