"""The llama.cpp engine (``llama-cpp-python``): one GGUF model, one multi-sequence
context, continuous batching on the engine's own thread.

One job per module: ``engine`` (``LlamaCppEngine`` and its decode loop), ``scheduler``,
``decoder`` (one decode step), ``prefix_cache``, ``sampling``, ``grammar`` (structured
output), ``vocab`` (the ``llama_cpp`` module, tokens, the chat template); docs/engines.md
("How the engine is built") says how they fit.
"""

from .engine import MAX_SEQUENCES, LlamaCppEngine
from .vocab import llama_lib

__all__ = ["MAX_SEQUENCES", "LlamaCppEngine", "llama_lib"]
