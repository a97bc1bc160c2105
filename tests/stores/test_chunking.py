"""The structure-aware chunker: budgets in the embedder's real tokens, offsets that map
back to the text, heading paths, overlap, and sentences longer than a chunk."""

import pytest

from tailrace.errors import StoreError
from tailrace.stores.chunking import Chunker

DOC = """# Guide

Tailrace runs pipelines. It compiles them into stages. Each stage has a queue.

Stages run in threads or on Ray. Records flow through bounded channels.

## Install

Install it with pip. Then run the demo. The demo builds an index first.

### Extras

The rag extra brings ONNX and faiss. The serve extra brings FastAPI.

# Other

A second top-level section with its own text.
"""


@pytest.fixture(scope="module")
def tok():
    from tailrace.stores.chunking import load_tokenizer

    return load_tokenizer("minilm-l6-int8")


@pytest.fixture(scope="module")
def embedder():
    from tailrace.engines.onnx import OnnxEmbedder

    return OnnxEmbedder("minilm-l6-int8", n_threads=1)


def test_chunks_map_back_to_the_text_and_keep_the_heading_path(tok):
    chunks = Chunker(max_tokens=30, overlap=0, tokenizer=tok).chunk(DOC, "Guide")
    assert all(DOC[c.start:c.end] == c.text for c in chunks)
    assert [c.heading for c in chunks] == ["Guide", "Guide", "Guide > Install",
                                           "Guide > Install > Extras", "Other"]
    assert chunks[0].text.startswith("Tailrace runs") and chunks[-1].text.endswith("text.")
    # a chunk ends at a paragraph end when the next paragraph would not fit
    assert chunks[0].text.endswith("has a queue.")
    assert not any("#" in c.text for c in chunks)  # heading lines are context, not text


def test_every_chunk_fits_the_budget_in_real_tokens(embedder):
    from tailrace.stores.corpus import read_wiki

    docs = read_wiki(limit=40)
    text = "\n\n".join(f"# {d['title']}\n\n{d['text']}" for d in docs)
    chunks = Chunker(max_tokens=64, overlap=16).chunk(text, "wiki")
    assert len(chunks) > 40
    counts = [embedder.count_tokens(c.context("wiki")) for c in chunks]
    assert max(counts) <= 64
    assert counts == [c.tokens for c in chunks]  # the chunker's own count is exact
    covered = set()
    for c in chunks:
        covered.update(range(c.start, c.end))
    # every sentence character is in some chunk (only headings and blank lines are not)
    missing = [i for i in range(len(text)) if i not in covered and not text[i].isspace()]
    assert missing and all(text.startswith("# ", text.rfind("\n", 0, i) + 1) for i in missing)


def test_overlap_repeats_the_last_sentences_of_the_previous_chunk(tok):
    text = " ".join(f"Sentence number {i} is here." for i in range(40))
    chunks = Chunker(max_tokens=48, overlap=16, tokenizer=tok).chunk(text)
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.start < a.end  # overlapping spans
        assert a.text.endswith(text[b.start:a.end])
    none = Chunker(max_tokens=48, overlap=0, tokenizer=tok).chunk(text)
    assert all(b.start >= a.end for a, b in zip(none, none[1:], strict=False))


def test_a_sentence_longer_than_the_budget_is_cut_at_token_boundaries(tok):
    text = "word " * 500 + "end."
    chunks = Chunker(max_tokens=32, overlap=0, tokenizer=tok).chunk(text)
    assert len(chunks) >= 500 // 30
    assert all(c.tokens <= 32 for c in chunks)
    assert all(text[c.start:c.end] == c.text for c in chunks)
    assert chunks[-1].text.endswith("end.")


@pytest.mark.parametrize("kw, match", [
    ({"max_tokens": 8}, "chunk tokens must be an integer >= 16, got 8"),
    ({"max_tokens": 64, "overlap": 32}, "overlap must be an integer from 0 to below half"),
    ({"overlap": -1}, "overlap must be"),
])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(StoreError, match=match):
        Chunker(**kw)


def test_windows_line_endings_keep_headings_and_paragraphs(tok):
    a = "Rivers carry water downhill. Dams hold the water back. Turbines turn in the flow."
    b = "The tailrace returns water to the river. It sits below the turbines."
    chunker = Chunker(max_tokens=34, overlap=0, tokenizer=tok)
    for nl in ("\n", "\r\n"):
        text = f"# Hydro{nl}{nl}{a}{nl}{nl}{b}{nl}"
        chunks = chunker.chunk(text)
        # the first chunk ends with its paragraph although a sentence of the next fits
        assert [c.text for c in chunks] == [a, b], nl
        assert chunks[0].heading == "Hydro"
    assert sum(chunker.count([a, b])) + 2 + 2 > 34 >= chunker.count([a])[0] + 4 + 8


def test_hash_lines_inside_code_fences_are_not_headings(tok):
    doc = ("# Serving\n\nStart the server.\n\n```bash\ntailrace serve app.yaml &\n"
           "# {\"answer\": \"...\"}\ncurl localhost\n```\n\nThen ask.\n\n~~~\n# also not\n~~~\n"
           "\n## Next\n\nMore text.\n")
    chunks = Chunker(max_tokens=200, overlap=0, tokenizer=tok).chunk(doc, "Serving")
    assert [c.heading for c in chunks] == ["Serving", "Serving > Next"]
    assert '# {"answer"' in chunks[0].text and "# also not" in chunks[0].text
    assert all(doc[c.start:c.end] == c.text for c in chunks)
