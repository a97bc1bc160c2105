"""Loaders: each format to documents with title, text and metadata; unreadable files
raise StoreError naming the file and the reason."""

import json

import pytest

from tailrace.errors import StoreError
from tailrace.stores.loaders import Columns, load
from tests.pdf_fixture import write_pdf


def test_markdown_front_matter_is_metadata(tmp_path):
    f = tmp_path / "g.md"
    f.write_text("---\ntitle: Guide\nversion: 3\ntags: [a, b]\nid: x\n---\n# Head\n\nBody.\n")
    [d] = load(f, "g")
    assert d["title"] == "Guide" and d["text"] == "# Head\n\nBody.\n"
    assert d["meta"] == {"version": 3, "tags": '["a", "b"]', "meta_id": "x"}


def test_markdown_title_falls_back_to_the_first_heading(tmp_path):
    f = tmp_path / "g.md"
    f.write_text("intro\n# The Heading\ntext")
    assert load(f, "g")[0]["title"] == "The Heading"


def test_html_text_keeps_headings_and_drops_scripts(tmp_path):
    f = tmp_path / "p.html"
    f.write_text("<html><head><title>Page</title><style>p{}</style></head><body>"
                 "<h1>Top</h1><p>Hello <b>world</b>.</p><script>var x = 1;</script>"
                 "<h2>Sub</h2><ul><li>one</li><li>two</li></ul></body></html>")
    [d] = load(f, "p")
    assert d["title"] == "Page"
    assert d["text"] == "# Top\n\nHello world.\n\n## Sub\n\none\n\ntwo"


def test_pdf_text_layer_and_page_offsets(tmp_path):
    f = write_pdf(tmp_path / "r.pdf", [["First page text."], ["Second page text."]],
                  title="Report")
    [d] = load(f, "r")
    assert d["title"] == "Report" and d["meta"] == {"page_count": 2}
    assert d["text"] == "First page text.\n\nSecond page text."
    assert d["pages"] == [0, d["text"].index("Second")]


def test_jsonl_rows_fields_and_metadata(tmp_path):
    f = tmp_path / "j.jsonl"
    f.write_text(json.dumps({"id": 7, "title": "A", "text": "alpha", "year": 2020,
                             "extra": {"k": 1}}) + "\n\n" + json.dumps({"text": "beta"}) + "\n")
    a, b = load(f, "j")
    assert (a["doc_id"], a["title"], a["text"]) == ("j:7", "A", "alpha")
    assert a["meta"] == {"year": 2020, "extra": '{"k": 1}'}
    assert (b["doc_id"], b["title"], b["meta"]) == ("j:1", "", {})


def test_json_array_with_chosen_columns(tmp_path):
    f = tmp_path / "j.json"
    f.write_text(json.dumps([{"q": "question", "a": "answer", "lang": "en", "x": 1}]))
    [d] = load(f, "j", Columns(("q", "a"), ("lang",)))
    assert d["text"] == "question\n\nanswer" and d["meta"] == {"lang": "en"}


def test_csv_text_and_metadata_columns(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("id,title,body,lang,n\n1,First,Body one.,en,3\n2,Second,\"Body, two.\",fr,4\n")
    a, b = load(f, "t", Columns(("body",), ("lang",)))
    assert (a["doc_id"], a["title"], a["text"], a["meta"]) == ("t:1", "First", "Body one.",
                                                             {"lang": "en"})
    assert b["text"] == "Body, two."
    _, d = load(f, "t", Columns(("body",)))
    assert d["meta"] == {"lang": "fr", "n": "4"}  # CSV values are text


@pytest.mark.parametrize("name, data, match", [
    ("bad.txt", b"\xff\xfe\x00", r"bad.txt: not UTF-8 text"),
    ("bad.pdf", b"%PDF-1.4 garbage", r"bad.pdf: not a readable PDF"),
    ("bad.jsonl", b'{"text": "ok"}\n{oops\n', r"bad.jsonl:2: not valid JSON"),
    ("bad.md", b"---\ntitle: [x\n---\nbody", r"bad.md: bad YAML front matter"),
    ("rows.jsonl", b'{"body": "x"}\n', r"rows.jsonl: line 1 has no text field 'text' "
                                       r"\(its fields: body\); choose with --text-columns"),
    ("x.docx", b"PK", r"x.docx: unsupported file type '.docx'"),
])
def test_unreadable_files_name_the_file_and_reason(tmp_path, name, data, match):
    f = tmp_path / name
    f.write_bytes(data)
    with pytest.raises(StoreError, match=match):
        load(f, name)


def test_a_pdf_without_a_text_layer_is_an_error(tmp_path):
    f = write_pdf(tmp_path / "scan.pdf", [[]])
    with pytest.raises(StoreError, match="scan.pdf: the PDF has no text layer"):
        load(f, "scan")
