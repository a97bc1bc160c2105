"""The llama.cpp engine (``llama-cpp-python``): one GGUF model, one multi-sequence
context, continuous batching on the engine's own thread.

One job per module: ``engine`` the public ``LlamaCppEngine`` (load, ``generate``, close)
and its decode loop, which only orchestrates; ``scheduler`` what is scheduled (named
states) and which sequences hold the slots (priorities, preemption, prefill budget; no
model needed); ``decoder`` one decode step (the batch, sampling, finishing);
``prefix_cache`` which KV stream a sequence starts in; ``sampling`` token choice and
streamed text; ``grammar`` structured output; ``vocab`` the ``llama_cpp`` module (loaded
once), tokens and the chat template.
"""

from .engine import MAX_SEQUENCES, LlamaCppEngine
from .vocab import llama_lib

__all__ = ["MAX_SEQUENCES", "LlamaCppEngine", "llama_lib"]
