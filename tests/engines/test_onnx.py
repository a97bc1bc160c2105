"""The onnxruntime embedder with the real catalog models (minilm-l6-int8, minilm-l3)."""

from __future__ import annotations

import pytest

from tailrace.engines import EmbeddingEngine
from tailrace.errors import EngineError

MODELS = ["minilm-l6-int8", "minilm-l3"]

# (anchor, paraphrase, unrelated): the anchor is closer to the paraphrase.
TRIPLES = [
    ("A man is playing a guitar.", "Someone plays an instrument.",
     "The stock market fell sharply today."),
    ("The cat sleeps on the sofa.", "A kitten is napping on the couch.",
     "The central bank raised interest rates."),
    ("How do I bake bread at home?", "A simple recipe for homemade bread.",
     "The football match ended in a draw."),
    ("It is sunny and warm outside.", "The weather is bright and hot today.",
     "He fixed a bug in the compiler."),
    ("She is reading a novel.", "A woman reads a book.", "Trucks are parked in the garage."),
]

TEXTS = ["short", "a somewhat longer sentence about trains and stations",
         "Paris is the capital of France.", "", "x " * 40,
         "Photosynthesis converts light energy into chemical energy in plants.",
         "one two three", "The quick brown fox jumps over the lazy dog. " * 3]


@pytest.fixture(scope="module", params=MODELS)
def embedder(request):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("tokenizers")
    from tailrace.engines.onnx import OnnxEmbedder

    emb = OnnxEmbedder(request.param, n_threads=2)
    yield emb
    emb.close()


@pytest.mark.engine
def test_is_an_embedding_engine(embedder):
    assert isinstance(embedder, EmbeddingEngine)
    assert embedder.model in MODELS
    assert embedder.dim == 384


@pytest.mark.engine
def test_rows_are_unit_norm_float32(embedder):
    import numpy as np

    vecs = embedder.embed(TEXTS)
    assert vecs.shape == (len(TEXTS), 384)
    assert vecs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


@pytest.mark.engine
@pytest.mark.parametrize("anchor,near,far", TRIPLES, ids=[t[0][:20] for t in TRIPLES])
def test_paraphrase_is_closer_than_unrelated(embedder, anchor, near, far):
    a, n, f = embedder.embed([anchor, near, far])
    assert a @ n > a @ f + 0.1, (float(a @ n), float(a @ f))


@pytest.mark.engine
def test_each_query_finds_its_paraphrase(embedder):
    anchors = embedder.embed([t[0] for t in TRIPLES])
    corpus = embedder.embed([t[1] for t in TRIPLES] + [t[2] for t in TRIPLES])
    best = (anchors @ corpus.T).argmax(axis=1)
    assert best.tolist() == list(range(len(TRIPLES)))


@pytest.mark.engine
def test_batch_and_order_independent(embedder):
    import numpy as np

    together = embedder.embed(TEXTS)
    one_by_one = np.vstack([embedder.embed([t]) for t in TEXTS])
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)
    backwards = embedder.embed(TEXTS[::-1])
    np.testing.assert_allclose(backwards[::-1], together, atol=1e-5)


@pytest.mark.engine
@pytest.mark.parametrize("model", MODELS)
def test_small_batches_give_the_same_rows(model):
    import numpy as np

    pytest.importorskip("onnxruntime")
    from tailrace.engines.onnx import OnnxEmbedder

    big, small = OnnxEmbedder(model, n_threads=1), OnnxEmbedder(model, batch_size=3, n_threads=1)
    np.testing.assert_allclose(small.embed(TEXTS), big.embed(TEXTS), atol=1e-5)


@pytest.mark.engine
def test_long_texts_are_truncated(embedder):
    long_a = "the history of the railway " * 200 + "ends with apples"
    long_b = "the history of the railway " * 200 + "ends with submarines"
    assert embedder.count_tokens(long_a) > 1000  # counted without truncation
    a, b = embedder.embed([long_a, long_b])
    assert abs(float(a @ b) - 1.0) < 1e-5  # the differing tails were cut off


@pytest.mark.engine
def test_count_tokens_includes_special_tokens(embedder):
    assert embedder.count_tokens("hello world") == 4  # [CLS] hello world [SEP]
    assert embedder.count_tokens("word " * 300) == 302  # not the tokenizer's pinned 128


@pytest.mark.engine
def test_empty_input(embedder):
    import numpy as np

    out = embedder.embed([])
    assert out.shape == (0, 384)
    assert out.dtype == np.float32


@pytest.mark.engine
def test_a_single_string_is_refused(embedder):
    with pytest.raises(EngineError, match="takes a list of texts"):
        embedder.embed("not a list")


@pytest.mark.engine
def test_closed_engine_refuses_to_embed():
    pytest.importorskip("onnxruntime")
    from tailrace.engines.onnx import OnnxEmbedder

    emb = OnnxEmbedder("minilm-l3", n_threads=1)
    emb.close()
    with pytest.raises(EngineError, match="embedding engine 'minilm-l3' is closed"):
        emb.embed(["hi"])


def test_unknown_model_lists_the_known_ones():
    from tailrace.engines.onnx import OnnxEmbedder

    with pytest.raises(EngineError, match=r"unknown model 'minilm-xl' for backend 'onnx'; "
                                          r"known: minilm-l3, minilm-l6-int8"):
        OnnxEmbedder("minilm-xl")


def test_path_without_tokenizer_for_an_unknown_model(tmp_path):
    from tailrace.engines.onnx import OnnxEmbedder

    with pytest.raises(EngineError, match="with 'path:' also give 'tokenizer:'"):
        OnnxEmbedder("my-model", path=str(tmp_path / "m.onnx"))
