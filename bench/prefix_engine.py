"""Prefix reuse inside the embedded llama.cpp engine (issue 16): what the KV cache of
finished prompts saves, on the same engine settings with the cache on and off.

1. Chat: time to first token (TTFT) of turn 5 of a conversation whose four earlier turns
   hold ~1,500 tokens (fixed user and assistant texts, so both engines read the same
   prompt). With the cache, turn 4 ran before on the engine (as in a real chat), so
   turn 5 starts from its prompt's KV. Several conversations; median [min-max].
2. RAG shape: a fixed ~200-token system prompt, a varying retrieved context and a
   question; prompt tokens the engine computed per request (prompt - reused), cache on
   and off.
3. The price of aligned prefill: the cache needs prompts cut into ``prefill_chunk``
   (default 16-token) pieces, one per step; TTFT of turn 5 cold (no cache) with the
   default chunk against 512 (llama.cpp's usual ``n_batch``), same engine otherwise.
4. Memory: a long random workload (random lengths, half the requests sharing one of a
   few prefixes): the cache's KV budget (``cache_bytes``) is fixed at start, and the
   process's RSS before and after.

    python bench/prefix_engine.py                # 5 conversations, 40 RAG requests
    python bench/prefix_engine.py --convs 3 --rag 20 --random 100
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tailrace.engines.base import GenerationRequest  # noqa: E402
from tailrace.engines.llama_cpp import LlamaCppEngine  # noqa: E402

WORDS = ["river", "mountain", "village", "bread", "lake", "station", "morning", "garden",
         "letter", "window", "harbour", "summer", "market", "bridge", "forest", "library",
         "evening", "castle", "meadow", "island"]


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def conversation(seed: int, turns: int = 5, words: int = 230) -> list[dict[str, str]]:
    """``turns`` user messages and the assistant answers between them (fixed texts)."""
    rng = random.Random(seed)
    msgs: list[dict[str, str]] = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Turn {t + 1}: " + text(rng, words)})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": text(rng, 40)})
    return msgs


def ttft(eng: LlamaCppEngine, msgs: list[dict[str, str]]) -> tuple[float, int, int]:
    """Seconds to the first piece, prompt tokens, reused tokens."""
    first: list[float] = []
    t0 = time.perf_counter()

    def on_token(i: int, piece: str) -> None:
        if not first:
            first.append(time.perf_counter() - t0)

    g = eng.generate([GenerationRequest(messages=tuple(msgs), max_tokens=4)], on_token)[0]
    return (first[0] if first else time.perf_counter() - t0), g.prompt_tokens, \
        int(g.extra.get("cached_tokens", 0))


def fmt(xs: list[float], scale: float = 1000.0, unit: str = " ms") -> str:
    return (f"{statistics.median(xs) * scale:.0f}{unit} "
            f"[{min(xs) * scale:.0f}-{max(xs) * scale:.0f}]")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--convs", type=int, default=5)
    ap.add_argument("--rag", type=int, default=40)
    ap.add_argument("--random", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"# prefix reuse, smollm2-135m-instruct, n_threads {args.threads}; "
          f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    kw = {"n_threads": args.threads, "n_ctx": 2048, "n_seq_max": 2}
    on = LlamaCppEngine("smollm2-135m-instruct", cache_sequences=2, **kw)
    off = LlamaCppEngine("smollm2-135m-instruct", prefix_cache=False, **kw)

    # 1. chat, turn 5
    with_, without, n_prompt, reused = [], [], [], []
    for c in range(args.convs):
        msgs = conversation(c)
        turn4 = msgs[:-2]  # up to turn 4's user message: what turn 4 sent
        t_off = ttft(off, msgs)[0]
        ttft(on, turn4)
        t_on, n, hit = ttft(on, msgs)
        with_.append(t_on)
        without.append(t_off)
        n_prompt.append(n)
        reused.append(hit)
    ratios = [b / a for a, b in zip(with_, without, strict=True)]
    print(f"\n## chat: TTFT of turn 5 ({statistics.median(n_prompt):.0f} prompt tokens, "
          f"{statistics.median(reused):.0f} reused), {args.convs} conversations")
    print(f"without reuse {fmt(without)}   with reuse {fmt(with_)}   "
          f"ratio {statistics.median(ratios):.1f}x [{min(ratios):.1f}-{max(ratios):.1f}]")

    # 3 (printed here): cold prefill, the default chunk vs 512
    wide = LlamaCppEngine("smollm2-135m-instruct", prefix_cache=False, prefill_chunk=512,
                          **kw)
    narrow, broad = [], []
    for c in range(args.convs):
        msgs = conversation(100 + c)
        narrow.append(ttft(off, msgs)[0])
        broad.append(ttft(wide, msgs)[0])
    wide.close()
    print(f"cold turn 5, no cache: prefill_chunk {off.prefill_chunk} {fmt(narrow)}   "
          f"512 {fmt(broad)}   "
          f"ratio {statistics.median(narrow) / statistics.median(broad):.2f}")

    # 2. RAG shape
    rng = random.Random(1)
    system = "You answer from the documents below. " + text(rng, 150)
    computed = {"on": [], "off": []}
    for q in range(args.rag):
        prompt = (f"{system}\n\nDocuments: {text(rng, 120)}\n\nQuestion {q}: "
                  f"{text(rng, 10)}\nAnswer:")
        req = [GenerationRequest(prompt=prompt, max_tokens=1)]
        for name, eng in (("on", on), ("off", off)):
            g = eng.generate(req)[0]
            computed[name].append(g.prompt_tokens - int(g.extra.get("cached_tokens", 0)))
    print(f"\n## RAG shape: prompt tokens computed per request ({args.rag} requests, "
          f"~{g.prompt_tokens} prompt tokens each)")
    for name in ("off", "on"):
        xs = computed[name]
        print(f"cache {name:<3}: median {statistics.median(xs):.0f} "
              f"[{min(xs)}-{max(xs)}], total {sum(xs):,}")

    # 4. memory under a long random workload
    before = rss_mb()
    budget = on.cache_bytes
    prefixes = [text(random.Random(100 + i), 200) for i in range(4)]
    rng = random.Random(2)
    for _ in range(args.random):
        head = rng.choice(prefixes) if rng.random() < 0.5 else text(rng, rng.randint(20, 300))
        on.generate([GenerationRequest(prompt=head + " " + text(rng, rng.randint(5, 200)),
                                       max_tokens=rng.randint(1, 8))])
    st = on.cache_statistics()
    print(f"\n## memory: {args.random} random requests")
    held = sum(k is not None for k in on._decoder.cache.streams)
    print(f"cache-only KV budget {budget / 2**20:.0f} MiB (fixed: {on.cache_bytes == budget}), "
          f"streams holding a prefix {held}/{on.n_streams}, "
          f"RSS {before:.0f} -> {rss_mb():.0f} MiB, hit ratio {st['hit_ratio']:.2f}")
    on.close()
    off.close()


if __name__ == "__main__":
    main()
