"""The ingest pipeline on Ray (convert, chunk and embed in actors) builds the same index
as locally."""

import pytest

from tailrace.cli.ingest_files import ingest_files
from tailrace.stores.vector_index import VectorIndex

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_ingest_on_ray_builds_the_local_index(tmp_path, monkeypatch, ray_session):
    monkeypatch.setenv("TAILRACE_HOME", str(tmp_path / "home"))
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(3):
        (d / f"f{i}.md").write_text(f"# File {i}\n\n" + " ".join(
            f"Sentence {j} of file {i} is about turbines." for j in range(40)))
    (d / "bad.txt").write_bytes(b"\xff\xfe")
    ray = ingest_files([str(d)], index="on-ray", runtime="ray", quiet=True, chunk_tokens=64,
                       overlap=8)
    local = ingest_files([str(d)], index="local", quiet=True, chunk_tokens=64, overlap=8)
    assert ray.embedded == local.embedded == 3
    assert [p for p, _ in ray.errors] == [f"{d}/bad.txt"]
    assert "not UTF-8 text" in ray.errors[0][1]
    a, b = VectorIndex.open(ray.path), VectorIndex.open(local.path)
    assert len(a) == len(b) > 3
    assert [x["text"] for x in a.docs] == [x["text"] for x in b.docs]
