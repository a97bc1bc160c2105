"""Engine specs shared by tests that use the real embedded stack (see conftest.py for
the ``tailrace_home`` fixture with its small corpus slice)."""

LLM = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 2,
       "n_ctx": 2048, "n_seq_max": 8}
EMBEDDER = {"backend": "onnx", "model": "minilm-l6-int8", "n_threads": 2}
