"""bench/vs_llama_server.py's pure parts: statistics, the decode bound, the served pipeline
YAML, the table from a made-up report, and llama_server_build's cache (a found binary is not
rebuilt) and flags (nothing that downloads). Nothing here is timed or served."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import tailrace as tr

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


build = load("llama_server_build")
bench = load("vs_llama_server")


def test_percentiles_and_spread():
    assert bench.pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert bench.pct([float(i) for i in range(100)], 0.99) == 99.0
    assert bench.pct([], 0.5) != bench.pct([], 0.5)  # nan
    assert bench.spread([2.0, 1.0, 4.0]) == "2.0 [1.0 - 4.0]"
    assert bench.spread([5.0]) == "5.0"
    assert bench.spread([]) == "-"


def test_decode_bound_counts_weights_once_per_step_and_kv_per_sequence():
    facts = {"weight_bytes": 100e6, "kv_bytes_per_token": 20e3}
    assert bench.decode_bound(10e9, facts, 1, 0) == 100.0
    # 1000 tokens of context: 20 MB of KV per sequence, read once a step
    assert abs(bench.decode_bound(10e9, facts, 1, 1000) - 10e9 / 120e6) < 1e-9
    assert abs(bench.decode_bound(10e9, facts, 4, 1000) - 40e9 / 180e6) < 1e-9


def test_the_served_pipeline_is_valid_and_matches_llama_servers_slots(tmp_path):
    path = bench.tailrace_yaml(tmp_path / "chat.yaml", {"model": "smollm2-135m-instruct"})
    p = tr.Pipeline.from_yaml(str(path))
    engine = p.engines["llm"]
    assert engine["n_threads"] == bench.THREADS and engine["n_seq_max"] == bench.SLOTS
    assert engine["n_ctx"] == bench.CTX
    text = path.read_text()
    assert "priorities: [interactive, batch]" in text and "messages: _messages" in text


def test_requests_carry_only_fields_both_servers_accept():
    req = bench.body(bench.story_prompt(3), 64)
    assert set(req) == {"model", "messages", "max_tokens", "temperature", "stream",
                        "stream_options"}
    assert req["temperature"] == 0 and req["messages"][0]["role"] == "system"
    assert bench.story_prompt(1) != bench.story_prompt(2)


def test_the_table_from_a_report():
    row = {"tok_s": 100.0, "ttft_p50": 0.2, "ttft_p99": 0.4, "itl_p50": 0.04, "itl_p99": 0.09,
           "cpu_s_per_1k": 20.0, "peak_rss_mb": 300.0, "tokens_per_answer": 64.0,
           "prompt_tokens": 50.0}
    run = {w: dict(row) for w in ("plain-1", "plain-4", "plain-16")}
    run["prefill"] = {"ttft": 0.5, "prompt_tokens": 500}
    slower = {w: {**row, "tok_s": 80.0} for w in ("plain-1", "plain-4", "plain-16")}
    slower["prefill"] = run["prefill"]
    report = {"machine": "m", "max_tokens": 64,
              "limits": {"copy_1t": 10.0, "copy_2t": 20.0, "matmul_f32_gflops": 100.0},
              "models": {"smollm2": {"facts": {"weight_bytes": 96e6, "kv_bytes_per_token": 23040,
                                               "matmul_params": 1e8},
                                     "runs": {"tailrace": [slower, slower],
                                              "llama-server": [run, run]}}}}
    text = bench.table(report)
    assert "plain-4   tok/s" in text and "0.80" in text  # tailrace / llama-server
    assert "20.0 GB/s 2 threads" in text and "bandwidth bound" in text
    assert "prefill 500 tokens in 0.500 s: 200.0 GFLOP/s" in text


def test_a_built_binary_is_found_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    binary = build.binary_path()
    assert binary.is_relative_to(tmp_path / "tailrace" / "llama-server")
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    monkeypatch.setattr(build.subprocess, "run", None)  # any build step would fail
    assert build.ensure_llama_server(say=lambda _: None) == binary


def test_the_build_flags_switch_off_every_download():
    flags = set(build.CMAKE_FLAGS)
    for off in ("LLAMA_CURL", "LLAMA_OPENSSL", "LLAMA_USE_PREBUILT_UI", "LLAMA_BUILD_UI"):
        assert f"-D{off}=OFF" in flags
    assert "-DLLAMA_BUILD_SERVER=ON" in flags and "-DCMAKE_BUILD_TYPE=Release" in flags
