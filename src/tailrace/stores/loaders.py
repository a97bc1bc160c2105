"""Loaders: files of common formats to documents ``{"doc_id", "title", "text", meta...}``.

``.txt``; ``.md`` (a leading ``---`` YAML front matter becomes metadata, its ``title``
the title); ``.html``/``.htm`` (BeautifulSoup: headings become ``#`` lines so the chunker
sees the structure, scripts and styles are dropped); ``.pdf`` (pypdf, the text layer;
``pages`` holds each page's start offset); ``.jsonl``/``.json`` (one document per
object: ``title`` and the text fields, other fields metadata); ``.csv`` (one document
per row: text and metadata columns chosen by the caller). Metadata values are scalars
(str, int, float, bool); a list or mapping is kept as its JSON text. A key that a chunk
itself uses (``id``, ``path``, ``start``...) is kept as ``meta_KEY``. Any failure raises
``StoreError`` naming the file and the reason. pypdf and bs4 are imported on first use.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StoreError

SUFFIXES = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf", ".jsonl", ".json", ".csv")
#: keys a chunk's document uses itself; metadata with these names becomes ``meta_KEY``
RESERVED = ("id", "doc_id", "title", "text", "path", "mtime", "heading", "page", "start",
            "end", "score", "vector")


@dataclass(frozen=True)
class Columns:
    """Which fields of JSONL/JSON/CSV rows are text and which metadata.

    text:     fields joined (blank line between) into the text; empty: ``text``.
    metadata: fields kept as metadata; None: every other scalar field.
    """

    text: tuple[str, ...] = ()
    metadata: tuple[str, ...] | None = None


def _scalar(v: Any) -> Any:
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return json.dumps(v, ensure_ascii=False, default=str)


def _meta(fields: dict[str, Any]) -> dict[str, Any]:
    return {(f"meta_{k}" if k in RESERVED else str(k)): _scalar(v)
            for k, v in fields.items() if v is not None}


def _doc(doc_id: str, title: str, text: str, meta: dict | None = None,
         pages: list[int] | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"doc_id": doc_id, "title": title, "text": text,
                         "meta": _meta(meta or {})}
    if pages is not None:
        d["pages"] = pages
    return d


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise StoreError(f"{path}: not UTF-8 text ({e})") from None


def _first_heading(text: str) -> str | None:
    return next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), None)


def load_markdown(path: Path, doc_id: str) -> list[dict]:
    text = _read_text(path)
    meta: dict[str, Any] = {}
    if text.startswith("---\n"):
        end = text.find("\n---", 4)
        if end < 0:
            raise StoreError(f"{path}: front matter starts with '---' but has no closing '---'")
        import yaml

        try:
            front = yaml.safe_load(text[4:end])
        except yaml.YAMLError as e:
            raise StoreError(f"{path}: bad YAML front matter ({str(e).splitlines()[0]})") from None
        if front is not None and not isinstance(front, dict):
            raise StoreError(f"{path}: front matter must be a YAML mapping, got "
                             f"{type(front).__name__}")
        meta = dict(front or {})
        nl = text.find("\n", end + 4)
        text = "" if nl < 0 else text[nl + 1:]
    title = str(meta.pop("title", "") or _first_heading(text) or path.stem)
    return [_doc(doc_id, title, text, meta)]


def load_html(path: Path, doc_id: str) -> list[dict]:
    try:
        from bs4 import BeautifulSoup
    except ImportError as e:
        raise StoreError(f"reading HTML needs beautifulsoup4 ({e}); install it with: "
                         "pip install beautifulsoup4") from None
    soup = BeautifulSoup(_read_text(path), "html.parser")
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    for tag in soup(["script", "style", "noscript", "template", "head", "title"]):
        tag.decompose()
    for level in range(1, 7):
        for h in soup.find_all(f"h{level}"):
            h.replace_with(f"\n\n{'#' * level} {h.get_text(' ', strip=True)}\n\n")
    for block in soup.find_all(["p", "li", "tr", "pre", "blockquote", "div", "section"]):
        block.insert_after("\n\n")
    lines = [" ".join(line.split()) for line in soup.get_text().splitlines()]
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    text = text.strip()
    return [_doc(doc_id, title or _first_heading(text) or path.stem, text)]


def load_pdf(path: Path, doc_id: str) -> list[dict]:
    try:
        from pypdf import PdfReader
    except ImportError as e:
        raise StoreError(f"reading PDF needs pypdf ({e}); install it with: pip install pypdf") \
            from None
    try:
        reader = PdfReader(str(path))
        texts = [(page.extract_text() or "").strip() for page in reader.pages]
        info = reader.metadata
        title = str(info.title) if info is not None and info.title else ""
    except Exception as e:  # pypdf raises many types for damaged files
        raise StoreError(f"{path}: not a readable PDF ({type(e).__name__}: {e})") from None
    pages, pos = [], 0
    for t in texts:
        pages.append(pos)
        pos += len(t) + 2
    text = "\n\n".join(texts)
    if not text.strip():
        raise StoreError(f"{path}: the PDF has no text layer (scanned pages need OCR first)")
    return [_doc(doc_id, title or path.stem, text, {"page_count": len(texts)}, pages)]


def _row_doc(path: Path, doc_id: str, n: int, row: dict, cols: Columns, where: str) -> dict:
    """Row ``n`` of a file as a document with id ``FILE:ID`` (its ``id`` field) or ``FILE:n``."""
    fields = cols.text or ("text",)
    missing = [f for f in fields if f not in row]
    if missing:
        raise StoreError(f"{path}: {where} has no text field '{missing[0]}' (its fields: "
                         f"{', '.join(map(str, row)) or 'none'}); choose with --text-columns")
    text = "\n\n".join(str(row[f]) for f in fields if row[f] is not None and str(row[f]))
    title = str(row.get("title") or "")
    if cols.metadata is None:
        meta = {k: v for k, v in row.items() if k not in fields and k not in ("title", "id")}
    else:
        absent = [f for f in cols.metadata if f not in row]
        if absent:
            raise StoreError(f"{path}: {where} has no metadata field '{absent[0]}' (its "
                             f"fields: {', '.join(map(str, row))}); check --metadata-columns")
        meta = {k: row[k] for k in cols.metadata}
    rid = row.get("id")
    return _doc(f"{doc_id}:{rid if rid not in (None, '') else n}", title, text, meta)


def load_jsonl(path: Path, doc_id: str, cols: Columns) -> list[dict]:
    text = _read_text(path)
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise StoreError(f"{path}: not valid JSON ({e})") from None
        rows = data if isinstance(data, list) else [data]
        numbered = [(f"item {i}", r) for i, r in enumerate(rows)]
    else:
        numbered = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((f"line {lineno}", json.loads(line)))
            except ValueError as e:
                raise StoreError(f"{path}:{lineno}: not valid JSON ({e})") from None
    out = []
    for i, (where, row) in enumerate(numbered):
        if not isinstance(row, dict):
            raise StoreError(f"{path}: {where} is not a JSON object")
        out.append(_row_doc(path, doc_id, i, row, cols, where))
    return out


def load_csv(path: Path, doc_id: str, cols: Columns) -> list[dict]:
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    if not reader.fieldnames:
        raise StoreError(f"{path}: empty CSV (no header row)")
    return [_row_doc(path, doc_id, i, dict(row), cols, f"row {i + 2}")
            for i, row in enumerate(reader)]


def csv_header(path: Path) -> list[str]:
    """The column names of a CSV file (its first row)."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        return next(csv.reader(f), [])


def load(path: Path, doc_id: str, cols: Columns = Columns()) -> list[dict]:
    """The documents of one file: ``[{"doc_id", "title", "text", "meta", ("pages")}]``;
    StoreError naming the file and the reason if it cannot be read."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".md", ".markdown"):
            return load_markdown(path, doc_id)
        if suffix in (".html", ".htm"):
            return load_html(path, doc_id)
        if suffix == ".pdf":
            return load_pdf(path, doc_id)
        if suffix in (".jsonl", ".json"):
            return load_jsonl(path, doc_id, cols)
        if suffix == ".csv":
            return load_csv(path, doc_id, cols)
        if suffix == ".txt":
            return [_doc(doc_id, path.stem, _read_text(path))]
    except OSError as e:
        raise StoreError(f"{path}: cannot read ({e.strerror or e})") from None
    raise StoreError(f"{path}: unsupported file type '{suffix}' (supported: "
                     f"{', '.join(SUFFIXES)})")
