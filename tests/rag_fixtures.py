"""Shared fixtures for tests that use the real embedded stack on a small corpus slice."""

import os

import pytest

SLICE = 300  # documents: titles sort digits first, so "2001: A Space Odyssey" is in it


@pytest.fixture(scope="session")
def tailrace_home(tmp_path_factory):
    """A private TAILRACE_HOME with a 'wiki' index over the first 300 documents."""
    home = tmp_path_factory.mktemp("tailrace_home")
    old = os.environ.get("TAILRACE_HOME")
    os.environ["TAILRACE_HOME"] = str(home)
    from tailrace.cli.ingest import ingest

    ingest(index="wiki", limit=SLICE, quiet=True)
    yield home
    if old is None:
        os.environ.pop("TAILRACE_HOME", None)
    else:
        os.environ["TAILRACE_HOME"] = old


LLM = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 2,
       "n_ctx": 2048, "n_seq_max": 8}
EMBEDDER = {"backend": "onnx", "model": "minilm-l6-int8", "n_threads": 2}
