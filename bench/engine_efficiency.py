"""Engine efficiency: the pipeline vs driving the engine directly, same work, same batching.

Generation: 32 chat prompts, greedy, max_tokens tokens each, through a `generate` stage
(batch contract max_size 8) vs `engine.generate` called directly on the same prompts in
batches of 8. Embeddings: 2,000 Wikipedia summaries through an `embed` stage vs
`engine.embed` directly in the same 256-text batches. Prints tokens/s (texts/s) of each
and the ratio; target >= 0.95. Runs alternate direct/pipeline and keep the best of
--repeat, after a warm-up, so neither side gets a cold cache.

    python bench/engine_efficiency.py
"""

from __future__ import annotations

import argparse
import platform
import time

import tailrace as tr
from tailrace.engines import GenerationRequest, open_engine
from tailrace.stores.corpus import read_wiki

LLM = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 2,
       "n_ctx": 2048, "n_seq_max": 8}
EMBEDDER = {"backend": "onnx", "model": "minilm-l6-int8", "n_threads": 2}
TOPICS = ["rivers", "volcanoes", "the moon", "bread", "chess", "violins", "glaciers", "owls"]


def prompts(n: int) -> list[str]:
    kinds = ["Write two sentences about", "Explain briefly what you know about",
             "Give three facts about", "Describe"]
    return [f"{kinds[i % 4]} {TOPICS[i % 8]}." for i in range(n)]


def direct_generate(engine, texts: list[str], max_tokens: int, batch: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), batch):
        reqs = [GenerationRequest(messages=({"role": "user", "content": t},),
                                  max_tokens=max_tokens) for t in texts[i:i + batch]]
        tokens += sum(g.completion_tokens for g in engine.generate(reqs))
    return time.perf_counter() - t0, tokens


def pipeline_generate(texts: list[str], max_tokens: int, batch: int) -> tuple[float, int]:
    p = tr.Pipeline("gen", engines={"llm": LLM})
    (p.source([{"text": t} for t in texts])
     .apply("generate", engine="llm", input="text", max_tokens=max_tokens, usage="usage",
            batch={"max_size": batch, "max_wait_ms": 5})
     .sink(out := []))
    plan = tr.compile_pipeline(p)
    t0 = time.perf_counter()
    result = tr.run(plan)
    dt = time.perf_counter() - t0
    assert not result.errors and len(out) == len(texts)
    return dt, sum(r["usage"]["completion_tokens"] for r in out)


def direct_embed(engine, texts: list[str], batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        engine.embed(texts[i:i + batch])
    return time.perf_counter() - t0


def pipeline_embed(texts: list[str], batch: int) -> float:
    p = tr.Pipeline("emb", engines={"embedder": EMBEDDER})
    (p.source([{"text": t} for t in texts])
     .apply("embed", engine="embedder", input="text", output="v", max_batch=batch)
     .sink(out := []))
    plan = tr.compile_pipeline(p)
    t0 = time.perf_counter()
    result = tr.run(plan)
    dt = time.perf_counter() - t0
    assert not result.errors and len(out) == len(texts)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"tailrace engine efficiency: Python {platform.python_version()} on "
          f"{platform.machine()}, best of {args.repeat}")

    llm = open_engine(LLM)
    texts = prompts(args.prompts)
    direct_generate(llm, texts[:8], 8, 8)  # warm-up
    d_best = p_best = 0.0
    for _ in range(args.repeat):
        dt, dtok = direct_generate(llm, texts, args.max_tokens, 8)
        pt, ptok = pipeline_generate(texts, args.max_tokens, 8)
        assert dtok == ptok, f"different work: {dtok} vs {ptok} tokens"
        d_best, p_best = max(d_best, dtok / dt), max(p_best, ptok / pt)
    print(f"generation ({args.prompts} prompts x {args.max_tokens} tokens, batches of 8, "
          f"smollm2-135m): direct {d_best:.1f} tok/s, pipeline {p_best:.1f} tok/s, "
          f"ratio {p_best / d_best:.3f} (target >= 0.95)")

    emb = open_engine(EMBEDDER)
    docs = [f"{d['title']}. {d['text']}" for d in read_wiki(limit=args.texts)]
    direct_embed(emb, docs[:256], 256)  # warm-up
    d_best = p_best = 0.0
    for _ in range(args.repeat):
        d_best = max(d_best, len(docs) / direct_embed(emb, docs, 256))
        p_best = max(p_best, len(docs) / pipeline_embed(docs, 256))
    print(f"embeddings ({len(docs)} Wikipedia summaries, batches of 256, minilm-l6-int8): "
          f"direct {d_best:.1f} texts/s, pipeline {p_best:.1f} texts/s, "
          f"ratio {p_best / d_best:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
