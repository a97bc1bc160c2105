"""``tailrace ingest PATH... --index NAME``: every format end to end on the real embedder,
chunk metadata, incremental re-ingest (embedding calls counted), bad files and bad
command lines."""

import json

import numpy as np
import pytest

from tailrace.cli.ingest_files import ingest_files
from tailrace.cli.main import main
from tailrace.engines.onnx import OnnxEmbedder
from tailrace.stores.loaders import Columns
from tailrace.stores.vector_index import VectorIndex
from tests.pdf_fixture import write_pdf

pytestmark = pytest.mark.engine

LONG = " ".join(f"Paragraph sentence {i} talks about river turbines and tailraces."
                for i in range(60))


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILRACE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "guide.md").write_text("---\ntitle: Guide\nversion: 3\n---\n# Guide\n\nIntro text."
                                f"\n\n## Long part\n\n{LONG}\n")
    (d / "note.txt").write_text("A plain note about dams.")
    (d / "sub" / "page.html").write_text("<title>Page</title><h1>Top</h1><p>Hello web.</p>")
    write_pdf(d / "report.pdf", [["Page one talks about water."], ["Page two about power."]])
    (d / "rows.jsonl").write_text(json.dumps({"id": "r1", "title": "Row", "text": "row text",
                                              "year": 2024}) + "\n")
    (d / "table.csv").write_text("title,text,lang\nT1,csv body one,en\n")
    (d / ".hidden.txt").write_text("never read")
    return d


@pytest.fixture
def calls(monkeypatch):
    """Texts embedded per OnnxEmbedder.embed call."""
    seen: list[int] = []
    real = OnnxEmbedder.embed

    def counting(self, texts):
        seen.append(len(texts))
        return real(self, texts)

    monkeypatch.setattr(OnnxEmbedder, "embed", counting)
    return seen


def by_id(index):
    return {d["id"]: d for d in index.docs}


def test_every_format_is_indexed_with_its_metadata(home, folder, calls):
    res = ingest_files([str(folder)], index="mine", quiet=True,
                       columns=Columns(("text",), None), chunk_tokens=64, overlap=8)
    assert res.errors == [] and res.files == 6 and res.embedded == 6
    idx = VectorIndex.open(res.path)
    docs = by_id(idx)
    assert res.chunks == len(idx) == sum(calls) and len(idx) > 6
    md = [d for d in idx.docs if d["doc_id"] == f"{folder}/guide.md"]
    assert md[0]["heading"] == "Guide" and md[0]["text"] == "Intro text."
    assert {d["heading"] for d in md[1:]} == {"Guide > Long part"}
    text = (folder / "guide.md").read_text().split("---\n", 2)[2]
    assert all(text[d["start"]:d["end"]] == d["text"] for d in md)
    assert all(d["version"] == 3 and d["title"] == "Guide" for d in md)
    pdf = [d for d in idx.docs if d["path"].endswith("report.pdf")]
    assert [d["page"] for d in pdf] == [1]  # both short pages fit one chunk
    assert docs[f"{folder}/rows.jsonl:r1#0"]["year"] == 2024
    assert docs[f"{folder}/note.txt#0"]["mtime"].endswith("+00:00")
    assert docs[f"{folder}/sub/page.html#0"]["heading"] == "Top"
    assert not any(".hidden" in d["path"] for d in idx.docs)
    # the vectors are the real embedder's, of the context line and the chunk
    emb = OnnxEmbedder("minilm-l6-int8", n_threads=1)
    [[hit]] = idx.search(emb.embed(["note. A plain note about dams."]), 1)
    assert hit["path"].endswith("note.txt")


def test_pdf_chunks_carry_their_page(home, tmp_path):
    write_pdf(tmp_path / "r.pdf", [[f"Line {i} of page one about water." for i in range(30)],
                                   [f"Line {i} of page two about power." for i in range(30)]])
    res = ingest_files([str(tmp_path / "r.pdf")], index="pdf", quiet=True, chunk_tokens=64,
                       overlap=0)
    docs = VectorIndex.open(res.path).docs
    assert [d["page"] for d in docs] == sorted(d["page"] for d in docs)
    assert {d["page"] for d in docs} == {1, 2}
    for d in docs:
        assert f"page {'one' if d['page'] == 1 else 'two'}" in d["text"].split("Line")[1]


def test_incremental_reingest_embeds_only_changed_files(home, folder, calls):
    first = ingest_files([str(folder)], index="inc", quiet=True)
    n_first = sum(calls)
    assert n_first == first.chunks
    calls.clear()
    again = ingest_files([str(folder)], index="inc", quiet=True)
    assert calls == [] and not again.built and again.chunks == first.chunks
    (folder / "note.txt").write_text("The note changed: it is about fish ladders now.")
    (folder / "new.txt").write_text("A brand new file about spillways.")
    (folder / "table.csv").unlink()
    res = ingest_files([str(folder)], index="inc", quiet=True)
    assert sum(calls) == 2  # one chunk per changed/new file, nothing else re-embedded
    assert (res.embedded, res.unchanged, res.removed) == (2, 4, 1)
    docs = by_id(VectorIndex.open(res.path))
    assert docs[f"{folder}/note.txt#0"]["text"].startswith("The note changed")
    assert f"{folder}/new.txt#0" in docs
    assert not any(d["path"].endswith("table.csv") for d in docs.values())
    assert len(list((home / "indexes" / "inc.files").glob("*.npz"))) == 6
    # the rebuilt index equals a fresh build of the same folder
    calls.clear()
    fresh = ingest_files([str(folder)], index="fresh", quiet=True)
    a, b = VectorIndex.open(res.path), VectorIndex.open(fresh.path)
    assert [d["id"] for d in a.docs] == [d["id"] for d in b.docs]
    q = np.ones((1, a.dim), dtype=np.float32) / np.sqrt(a.dim)
    assert [h["id"] for h in a.search(q, 5)[0]] == [h["id"] for h in b.search(q, 5)[0]]


def test_bad_files_become_error_records_and_the_rest_proceed(home, folder, capsys):
    (folder / "broken.pdf").write_bytes(b"%PDF-1.4 not really")
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    rc = main(["ingest", str(folder), "--index", "bad", "-q"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"tailrace: error: {folder}/broken.pdf: not a readable PDF" in err
    assert f"tailrace: error: {folder}/latin1.txt: not UTF-8 text" in err
    assert "8 files (6 embedded, 0 unchanged, 0 removed, 2 errors)" in err
    docs = VectorIndex.open(home / "indexes" / "bad").docs
    assert {d["path"].rsplit("/", 1)[1] for d in docs} == {
        "guide.md", "note.txt", "page.html", "report.pdf", "rows.jsonl", "table.csv"}


@pytest.mark.parametrize("argv, message", [
    (["--index", "x", "--text-columns", "nope"],
     "--text-columns: column 'nope' is not in {d}/table.csv (its columns: title, text, lang)"),
    (["--index", "x", "--metadata-columns", "lang,zz"],
     "--metadata-columns: column 'zz' is not in {d}/table.csv"),
    (["--index", "x", "--include", "*.docx"], "no files to ingest under {d} matching "
                                              "--include *.docx"),
    (["--index", "x", "--chunk-tokens", "8"], "chunk tokens must be an integer >= 16, got 8"),
    ([], "--index: name the index for your files"),
    (["--index", "x", "--corpus", "c.json"], "--corpus applies to the bundled corpus"),
])
def test_bad_command_lines_are_one_line_errors(home, folder, capsys, argv, message):
    assert main(["ingest", str(folder), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tailrace: error: " + message.format(d=folder) or \
        err.startswith("tailrace: error: " + message.format(d=folder))
    assert "\n" not in err


def test_missing_path_and_file_options_without_paths(home, capsys, tmp_path):
    assert main(["ingest", str(tmp_path / "nothing"), "--index", "x"]) == 2
    assert capsys.readouterr().err == f"tailrace: error: {tmp_path}/nothing: no such file " \
                                      "or folder\n"
    assert main(["ingest", "--include", "*.md"]) == 2
    assert "--include applies to files: give PATH..." in capsys.readouterr().err


def test_other_file_types_are_counted_and_a_named_one_is_an_error(home, folder, capsys):
    (folder / "image.png").write_bytes(b"\x89PNG")
    (folder / "slides.pptx").write_bytes(b"PK")
    assert main(["ingest", str(folder), "--index", "types", "-q"]) == 0
    assert "; 2 files of other types left out" in capsys.readouterr().err
    assert main(["ingest", str(folder / "slides.pptx"), str(folder / "note.txt"),
                 "--index", "named", "-q"]) == 1
    err = capsys.readouterr().err
    assert f"tailrace: error: {folder}/slides.pptx: unsupported file type '.pptx'" in err
    assert "2 files (1 embedded, 0 unchanged, 0 removed, 1 errors)" in err


def test_plan_shows_the_ingest_pipeline(folder, capsys):
    assert main(["ingest", str(folder), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "plan 'ingest'" in out
    for stage in ("files: source", "convert: flat_map", "chunk: flat_map", "embed: embed",
                  "index_write: sink"):
        assert stage in out
