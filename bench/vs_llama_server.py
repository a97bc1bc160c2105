"""tailrace's llama.cpp engine against llama.cpp's own server, and against the machine's limits.

What users pick instead of tailrace to serve a GGUF model on CPUs is ``llama-server`` (C++
continuous batching, native samplers, slot prompt cache). This runs both side by side:

- the same llama.cpp: ``llama-server`` is built from the sources vendored in the installed
  llama-cpp-python's sdist, with the wheel's CPU flags (bench/llama_server_build.py, cached
  under ~/.cache/tailrace/llama-server/VERSION); a failed build leaves tailrace's side only;
- the same model file (SmolLM2-135M-Instruct Q4_1; the Qwen2.5-Coder 0.5B GGUF of the
  routing workload too when one is installed), threads (2), slots (4) and context per slot:
  ``llama-server -np 4 -c 4*CTX -t 2 --no-repack`` against ``tailrace serve`` of a
  one-stage ``generate`` pipeline (``n_threads: 2, n_seq_max: 4, n_ctx: CTX,
  cache_sequences: 4``; tailrace loads weights without repacking, so llama-server does too;
  llama-server keeps prompts in host memory beyond its slots, tailrace in its 4 extra
  cache streams), ``--admission slo`` so a request's class reaches the engine;
- the same requests from one load generator (asyncio + httpx): streamed
  ``/v1/chat/completions``, greedy (``temperature: 0``), ``max_tokens`` fixed, usage
  streamed; prompts ask for long stories so greedy answers do not stop early, and the
  table gives the real token counts. Only fields both servers accept are sent; the class
  rides in the ``X-Tailrace-Priority`` header, which llama-server ignores (FIFO).

Workloads: ``plain-C`` (C = 1, 4, 8, 16 closed-loop streams, distinct prompts); ``rag``
(one long system + context prefix, distinct questions, 4 streams); ``chat`` (4
conversations of 5 turns, each turn resending the grown history); ``mixed`` (6 closed-loop
batch streams with long answers, and interactive requests arriving one every 1.5 s).
Figures per workload and server: aggregate output tokens/s (all answers' tokens over the
workload's wall time), TTFT p50/p99 (send to first content chunk), inter-token latency
p50/p99 (gaps between content chunks), CPU seconds per 1k output tokens and peak RSS of
the server's process tree (psutil, sampled every 0.1 s). Each run starts each server
fresh and runs every workload; runs alternate which server goes first; the table shows
median [min - max] over the runs.

Physical limits, measured in the same run: memory bandwidth (a STREAM-like numpy copy of
128 MiB arrays, 1 and 2 threads, best of 5, counting read + write) and a decode bound
``bandwidth x B / (weights + B x L x KV bytes per token)`` (B sequences per step, L their
context) against each engine's decode rate ``B / ITL p50``; and prefill FLOP/s
(``2 x matmul params x prompt tokens / TTFT`` of a lone ~500-token prompt that no cache
holds) against the measured peak of numpy float32 matmul (OpenBLAS, 2 threads). The
engines run quantized int8/VNNI dot products, not float32 GEMM, so that peak is a yardstick,
not their ceiling.

What this 2-core VM cannot show: the load generator shares the two cores with the server
(both sides pay the same); llama.cpp's OpenMP threads spin, so any neighbour (another
agent's test run) moves the figures, which is why runs alternate and show their spread;
there is no NUMA, no many-core scaling and no GPU; a 135M model is small enough that
per-token overheads dominate more than they would on a 7B model.

    python bench/vs_llama_server.py                  # 2 runs (~10-15 minutes)
    python bench/vs_llama_server.py --quick          # 1 short run
    python bench/vs_llama_server.py --runs 3 --json out.json
    python bench/vs_llama_server.py --no-llama-server   # tailrace's side only
    python bench/vs_llama_server.py --engine-set prefill_chunk=64  # an engine setting
    python bench/vs_llama_server.py --table out.json    # the table of a saved run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import yaml

from llama_server_build import ensure_llama_server  # bench/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]

THREADS, SLOTS, CTX = 2, 4, 2048
SYSTEM = "You are a careful assistant. Follow the instruction exactly and keep going."
RAG_CONTEXT = " ".join(
    f"Document {i}: the river station at kilometre {i * 7} records a flow of {100 + i * 13} "
    f"cubic metres per second in spring and {40 + i * 5} in autumn; its gauge was rebuilt "
    f"in {1950 + i} after the flood." for i in range(24))


# ------------------------------------------------------------------------------ statistics
def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    """``median [min - max]`` of the runs' values (one value: just it)."""
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))} - {fmt.format(max(xs))}]"


# ------------------------------------------------------------------------------ requests
def user(text: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


JOBS = ("lighthouse keeper", "baker", "ferry pilot", "glassblower", "beekeeper", "cartographer",
        "clockmaker", "shepherd", "librarian", "miner", "weaver", "astronomer", "potter")


def story_prompt(i: int) -> list[dict[str, str]]:
    """A prompt greedy SmolLM2 answers at length (no early stop at 96 tokens here)."""
    return user(f"Write a long, detailed story about a {JOBS[i % len(JOBS)]} named Keeper {i} "
                f"and the storm that lasted a week.")


def rag_prompt(i: int) -> list[dict[str, str]]:
    system = f"{SYSTEM}\nAnswer from the context.\n\nContext:\n{RAG_CONTEXT}"
    return user(f"Question {i}: list every station whose spring flow is above {150 + 20 * i}, "
                f"then explain each gauge's history in detail.", system)


def body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": "chat", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Answer:
    sent: float
    stamps: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cls: str = ""

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent if self.stamps else float("nan")


async def stream_chat(client: httpx.AsyncClient, base: str, req: dict[str, Any],
                      cls: str = "") -> Answer:
    """One streamed chat completion; the same code for both servers."""
    headers = {"X-Tailrace-Priority": cls} if cls else {}
    ans = Answer(time.perf_counter(), cls=cls)
    pieces = []
    async with client.stream("POST", base + "/v1/chat/completions", json=req,
                             headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ans.stamps.append(time.perf_counter())
                    pieces.append(piece)
            usage = chunk.get("usage")
            if usage:
                ans.tokens = usage.get("completion_tokens") or 0
                ans.prompt_tokens = usage.get("prompt_tokens") or 0
                ans.cached_tokens = ((usage.get("prompt_tokens_details") or {})
                                     .get("cached_tokens") or 0)
    ans.text = "".join(pieces)
    ans.tokens = ans.tokens or len(pieces)
    return ans


# ------------------------------------------------------------------------------ workloads
async def closed_loop(client, base, reqs: list[dict], concurrency: int) -> list[Answer]:
    queue = list(reversed(reqs))
    out: list[Answer] = []

    async def worker() -> None:
        while queue:
            out.append(await stream_chat(client, base, queue.pop()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def chats(client, base, n_conv: int, turns: int, max_tokens: int) -> list[Answer]:
    out: list[Answer] = []

    async def conversation(c: int) -> None:
        msgs = [{"role": "system", "content": f"{SYSTEM} You are talking to visitor {c}."}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"Tell me more about river {c}, part "
                                                    f"{t + 1}: its towns, bridges and fish."})
            ans = await stream_chat(client, base, body(msgs, max_tokens))
            out.append(ans)
            msgs.append({"role": "assistant", "content": ans.text})

    await asyncio.gather(*(conversation(c) for c in range(n_conv)))
    return out


async def mixed(client, base, n_batch: int, n_inter: int, every_s: float,
                max_tokens: int) -> list[Answer]:
    out: list[Answer] = []
    done = asyncio.Event()

    async def batch_worker(w: int) -> None:
        i = 0
        while not done.is_set():
            req = body(rag_prompt(100 + 10 * w + i), max_tokens * 2)
            out.append(await stream_chat(client, base, req, "batch"))
            i += 1

    async def interactive() -> None:
        await asyncio.sleep(every_s)
        tasks = []
        for i in range(n_inter):
            req = body(user(f"In one line: what is {i + 2} times {i + 7}?"), max_tokens // 2)
            tasks.append(asyncio.ensure_future(stream_chat(client, base, req, "interactive")))
            await asyncio.sleep(every_s)
        out.extend(await asyncio.gather(*tasks))
        done.set()

    await asyncio.gather(interactive(), *(batch_worker(w) for w in range(n_batch)))
    return out


def workloads(quick: bool, n: int) -> list[tuple[str, Any]]:
    """(name, coroutine factory taking (client, base)) in the order they run."""
    ws: list[tuple[str, Any]] = []
    for c in (1, 4, 8, 16):
        k = max(c, 2) if quick else max(2 * c, 4)
        ws.append((f"plain-{c}", lambda cl, b, c=c, k=k: closed_loop(
            cl, b, [body(story_prompt(i), n) for i in range(k)], c)))
    k = 6 if quick else 12
    ws.append(("rag", lambda cl, b: closed_loop(
        cl, b, [body(rag_prompt(i), n // 2) for i in range(k)], SLOTS)))
    ws.append(("chat", lambda cl, b: chats(cl, b, 4, 3 if quick else 5, n // 2)))
    ws.append(("mixed", lambda cl, b: mixed(cl, b, 6, 4 if quick else 8, 1.5, n)))
    return ws


# ------------------------------------------------------------------------------ servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server child process: its URL, its process tree's CPU time and sampled RSS."""

    def __init__(self, name: str, cmd: list[str], ready: str, log: Path,
                 env: dict | None = None) -> None:
        self.name, self.log = name, log
        self.port = free_port()
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                     stdin=subprocess.DEVNULL, env=env)
        self.base = f"http://127.0.0.1:{self.port}"
        self.ps = psutil.Process(self.proc.pid)
        self.peak = 0
        self._stop = threading.Event()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode}); see {log}")
            try:
                if httpx.get(self.base + ready, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            raise RuntimeError(f"{name} not ready after 120 s; see {log}")
        threading.Thread(target=self._sample, daemon=True).start()

    def tree(self) -> list[psutil.Process]:
        try:
            return [self.ps, *self.ps.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu(self) -> float:
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            rss = 0
            for p in self.tree():
                with contextlib.suppress(psutil.Error):
                    rss += p.memory_info().rss
            self.peak = max(self.peak, rss)

    def stop(self) -> None:
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


#: tailrace engine settings given with --engine-set KEY=VALUE (e.g. prefill_chunk=64)
ENGINE_SETTINGS: dict[str, Any] = {}


def tailrace_yaml(path: Path, model: dict[str, str]) -> Path:
    engine = {"backend": "llama_cpp", **model, "n_threads": THREADS, "n_ctx": CTX,
              "n_seq_max": SLOTS, "cache_sequences": SLOTS, **ENGINE_SETTINGS}
    path.write_text(
        "version: 1\npipeline: chat\nsource: {fields: [question]}\n"
        "serve: {priorities: [interactive, batch]}\n"
        f"engines:\n  llm: {json.dumps(engine)}\n"
        "stages:\n  - {id: answer, op: generate, engine: llm, input: question, output: answer,"
        " messages: _messages, max_tokens: 512, usage: usage}\n")
    return path


def start(name: str, gguf: Path, model: dict[str, str], binary: Path | None,
          tmp: Path) -> Server:
    if name == "tailrace":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "tailrace.cli.main", "serve",
               str(tailrace_yaml(tmp / "chat.yaml", model)), "--port", "{port}",
               "--admission", "slo", "--max-in-flight", "32"]
        return Server(name, cmd, "/readyz", tmp / "tailrace.log", env)
    assert binary is not None
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
           "-np", str(SLOTS), "-c", str(SLOTS * CTX), "--cont-batching", "-t", str(THREADS),
           "-tb", str(THREADS), "--no-repack", "-ngl", "0"]
    return Server(name, cmd, "/health", tmp / "llama-server.log")


async def measure(server: Server, name: str, factory: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=64)) as client:
        cpu0, server.peak = server.cpu(), 0
        t0 = time.perf_counter()
        answers = await factory(client, server.base)
        wall = time.perf_counter() - t0
        cpu = server.cpu() - cpu0
    tokens = sum(a.tokens for a in answers)
    itl = [b - a for x in answers for a, b in zip(x.stamps, x.stamps[1:], strict=False)]
    row = {"tok_s": tokens / wall, "wall_s": wall, "requests": len(answers),
           "tokens_per_answer": tokens / max(len(answers), 1),
           "chunks_per_answer": sum(len(a.stamps) for a in answers) / max(len(answers), 1),
           "prompt_tokens": statistics.mean(a.prompt_tokens for a in answers),
           "cached_tokens": statistics.mean(a.cached_tokens for a in answers),
           "ttft_p50": pct([a.ttft for a in answers], 0.5),
           "ttft_p99": pct([a.ttft for a in answers], 0.99),
           "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99),
           "cpu_s_per_1k": 1000 * cpu / max(tokens, 1), "peak_rss_mb": server.peak / 2**20}
    if name == "mixed":
        for cls in ("interactive", "batch"):
            mine = [a for a in answers if a.cls == cls]
            row[f"{cls}_ttft_p50"] = pct([a.ttft for a in mine], 0.5)
            row[f"{cls}_ttft_p99"] = pct([a.ttft for a in mine], 0.99)
            row[f"{cls}_tok_s"] = sum(a.tokens for a in mine) / wall
    return row


async def prefill_probe(server: Server, tries: int = 3) -> dict[str, float]:
    """Best TTFT of a lone ~500-token prompt no cache holds (a fresh nonce up front)."""
    best: dict[str, float] = {"ttft": float("inf"), "prompt_tokens": 0}
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(tries):
            nonce = os.urandom(6).hex()
            msgs = user(f"Session {nonce}. Summarise:\n{RAG_CONTEXT[:2400]}", f"[{nonce}] {SYSTEM}")
            ans = await stream_chat(client, server.base, body(msgs, 1))
            if ans.ttft < best["ttft"]:
                best = {"ttft": ans.ttft, "prompt_tokens": ans.prompt_tokens}
    return best


# ------------------------------------------------------------------------------ limits
def bandwidth_gbs(mib: int = 128, reps: int = 5) -> dict[str, float]:
    """STREAM-like copy (bytes read + written per second), 1 and 2 threads, best of reps."""
    n = mib * 2**20 // 8
    src, dst = np.ones(n), np.empty(n)
    np.copyto(dst, src)

    def copy(lo: int, hi: int) -> None:
        np.copyto(dst[lo:hi], src[lo:hi])

    out = {}
    for threads in (1, 2):
        best = float("inf")
        for _ in range(reps):
            parts = [threading.Thread(target=copy, args=(k * n // threads, (k + 1) * n // threads))
                     for k in range(threads)]
            t0 = time.perf_counter()
            for p in parts:
                p.start()
            for p in parts:
                p.join()
            best = min(best, time.perf_counter() - t0)
        out[f"copy_{threads}t"] = 2 * src.nbytes / best / 1e9
    return out


def matmul_gflops(n: int = 1024, reps: int = 5) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.T.copy()
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def model_facts(gguf: Path) -> dict[str, float]:
    """Sizes the bounds need, read from the model through llama-cpp-python."""
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=64, n_threads=1, verbose=False)
    md, m = llm.metadata, llm._model
    arch = md["general.architecture"]
    layers, heads = int(md[f"{arch}.block_count"]), int(md[f"{arch}.attention.head_count"])
    kv_heads = int(md.get(f"{arch}.attention.head_count_kv", heads))
    kv = 2 * layers * kv_heads * (m.n_embd() // heads) * 2  # K and V, f16
    facts = {"params": m.n_params(), "weight_bytes": m.size(), "kv_bytes_per_token": kv,
             # token embedding rows are looked up, not multiplied
             "matmul_params": m.n_params() - m.n_vocab() * m.n_embd()}
    del llm
    return facts


def decode_bound(bw: float, facts: dict, batch: int, ctx: float) -> float:
    """Tokens/s if each decode step only had to read the weights once and each
    sequence's KV (``ctx`` tokens) once, at ``bw`` bytes/s."""
    return bw * batch / (facts["weight_bytes"] + batch * ctx * facts["kv_bytes_per_token"])


def find_models() -> list[tuple[str, Path, dict[str, str]]]:
    from tailrace.engines.models import MODELS, model_path

    found = [("smollm2-135m", model_path(MODELS["smollm2-135m-instruct"]),
              {"model": "smollm2-135m-instruct"})]
    import site
    roots = [Path(p) for p in site.getsitepackages()] + [Path.home() / ".cache" / "tailrace"]
    for root in roots:
        for p in sorted(root.glob("**/*wen2.5-[Cc]oder-0.5[Bb]*.gguf"))[:1]:
            found.append(("qwen2.5-coder-0.5b", p, {"path": str(p)}))
            return found
    print("vs_llama_server: no Qwen2.5-Coder 0.5B GGUF installed; SmolLM2-135M only")
    return found


# ------------------------------------------------------------------------------ the run
SERVERS = ("tailrace", "llama-server")


async def one_server(name: str, gguf: Path, model: dict, binary: Path | None, quick: bool,
                     n: int, tmp: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    srv = start(name, gguf, model, binary, tmp)
    try:
        await measure(srv, "warmup", lambda cl, b: closed_loop(
            cl, b, [body(story_prompt(i), 8) for i in range(SLOTS)], SLOTS))
        rows = {"prefill": await prefill_probe(srv)}
        for wname, factory in workloads(quick, n):
            rows[wname] = await measure(srv, wname, factory)
            r = rows[wname]
            print(f"  {name:12s} {wname:9s} {r['tok_s']:6.1f} tok/s  ttft p50 "
                  f"{r['ttft_p50']:.2f} s  itl p50 {1000 * r['itl_p50']:.0f} ms  "
                  f"({r['requests']} answers, {r['tokens_per_answer']:.0f} tok each)",
                  flush=True)
    finally:
        srv.stop()
    rows["startup_and_run_s"] = time.monotonic() - t0
    return rows


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    binary = None if args.no_llama_server else ensure_llama_server()
    if binary is None and not args.no_llama_server:
        print("vs_llama_server: llama-server is not available; tailrace's side only")
    servers = [s for s in SERVERS if s == "tailrace" or binary is not None]
    print("vs_llama_server: measuring memory bandwidth and matmul peak", flush=True)
    limits = {**bandwidth_gbs(), "matmul_f32_gflops": matmul_gflops()}
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                              "limits": limits, "max_tokens": args.tokens,
                              "engine_settings": ENGINE_SETTINGS, "models": {}}
    for label, gguf, model in find_models():
        facts = model_facts(gguf)
        runs: dict[str, list[dict]] = {s: [] for s in servers}
        report["models"][label] = {"path": str(gguf), "facts": facts, "runs": runs}
        for r in range(args.runs):
            order = servers if r % 2 == 0 else servers[::-1]
            for name in order:
                print(f"vs_llama_server: {label} run {r + 1}/{args.runs}: {name}", flush=True)
                with tempfile.TemporaryDirectory() as tmp:
                    runs[name].append(asyncio.run(one_server(
                        name, gguf, model, binary, args.quick, args.tokens, Path(tmp))))
                if args.json:  # what is done so far survives an interrupted run
                    Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def machine() -> str:
    import importlib.metadata as md

    return (f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, CPython "
            f"{platform.python_version()}, llama-cpp-python {md.version('llama-cpp-python')}, "
            f"load {os.getloadavg()[0]:.1f} at start")


# ------------------------------------------------------------------------------ the table
METRICS = (("tok_s", "tok/s", "{:.1f}", 1), ("ttft_p50", "TTFT p50 s", "{:.2f}", 1),
           ("ttft_p99", "TTFT p99 s", "{:.2f}", 1), ("itl_p50", "ITL p50 ms", "{:.0f}", 1000),
           ("itl_p99", "ITL p99 ms", "{:.0f}", 1000),
           ("cpu_s_per_1k", "CPU s / 1k tok", "{:.1f}", 1),
           ("peak_rss_mb", "peak RSS MiB", "{:.0f}", 1),
           ("tokens_per_answer", "tok / answer", "{:.0f}", 1),
           ("interactive_ttft_p50", "interactive TTFT p50 s", "{:.2f}", 1),
           ("interactive_ttft_p99", "interactive TTFT p99 s", "{:.2f}", 1),
           ("batch_tok_s", "batch tok/s", "{:.1f}", 1))


def ratio(a: list[float], b: list[float]) -> str:
    if not a or not b:
        return "-"
    return f"{statistics.median(a) / statistics.median(b):.2f}"


def table(report: dict[str, Any]) -> str:
    lim = report["limits"]
    bw = max(lim["copy_1t"], lim["copy_2t"]) * 1e9
    lines = [f"machine: {report['machine']}",
             f"memory bandwidth (numpy copy, read+write): {lim['copy_1t']:.1f} GB/s 1 thread, "
             f"{lim['copy_2t']:.1f} GB/s 2 threads; numpy float32 matmul peak "
             f"{lim['matmul_f32_gflops']:.0f} GFLOP/s", ""]
    for label, m in report["models"].items():
        runs, facts = m["runs"], m["facts"]
        names = list(runs)
        lines.append(f"{label} ({facts['weight_bytes'] / 2**20:.0f} MiB weights, "
                     f"{facts['kv_bytes_per_token'] / 1024:.1f} KiB KV/token), max_tokens "
                     f"{report['max_tokens']}, {len(runs[names[0]])} run(s): median [min - max]")
        head = f"{'workload':9s} {'metric':24s} " + " ".join(f"{n:>24s}" for n in names)
        lines += [head + ("   ratio" if len(names) == 2 else ""), "-" * len(head)]
        for w in [k for k in runs[names[0]][0] if isinstance(runs[names[0]][0][k], dict)
                  and k != "prefill"]:
            for key, label_, fmt, scale in METRICS:
                vals = {n: [r[w][key] * scale for r in runs[n] if key in r[w]] for n in names}
                if not vals[names[0]]:
                    continue
                row = f"{w:9s} {label_:24s} " + " ".join(
                    f"{spread(vals[n], fmt):>24s}" for n in names)
                if len(names) == 2:
                    row += f"   {ratio(vals[names[0]], vals[names[1]])}"
                lines.append(row)
        lines += ["", "physical limits (medians over runs):"]
        for n in names:
            ctx = statistics.median(r["plain-1"]["prompt_tokens"] for r in runs[n])
            ctx += report["max_tokens"] / 2
            for w, batch in (("plain-1", 1), ("plain-4", 4), ("plain-16", SLOTS)):
                itl = statistics.median(r[w]["itl_p50"] for r in runs[n])
                got, bound = batch / itl, decode_bound(bw, facts, batch, ctx)
                lines.append(f"  {n:12s} decode {w:8s} B={batch}: {got:6.1f} tok/s of a "
                             f"{bound:7.0f} tok/s bandwidth bound ({100 * got / bound:.1f}%)")
            pf = min((r["prefill"] for r in runs[n]), key=lambda p: p["ttft"])
            flops = 2 * facts["matmul_params"] * pf["prompt_tokens"] / pf["ttft"] / 1e9
            lines.append(f"  {n:12s} prefill {pf['prompt_tokens']} tokens in "
                         f"{pf['ttft']:.3f} s: {flops:.1f} GFLOP/s, "
                         f"{100 * flops / lim['matmul_f32_gflops']:.0f}% of the f32 matmul peak")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 run, fewer requests")
    ap.add_argument("--runs", type=int, help="runs per server (default 2; --quick: 1)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per answer (64)")
    ap.add_argument("--no-llama-server", action="store_true", help="tailrace's side only")
    ap.add_argument("--engine-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of tailrace's engine (YAML value), e.g. prefill_chunk=64")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--table", metavar="FILE", help="only print the table of a saved --json")
    args = ap.parse_args()
    args.runs = args.runs or (1 if args.quick else 2)
    for kv in args.engine_set:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            ap.error(f"--engine-set wants KEY=VALUE, got {kv!r}")
        ENGINE_SETTINGS[key] = yaml.safe_load(value)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    report = run_all(args)
    print()
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
