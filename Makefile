# The README's commands. Each target sets up what it needs in ./.venv by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)  ## set up and run the main job
	$(BIN)/tailrace demo

test: $(STAMP)  ## set up and run the tests
	$(BIN)/python -m pytest

bench: $(STAMP)  ## run the benchmarks and print their figures
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/backpressure.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy src/tailrace

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
