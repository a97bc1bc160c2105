"""A llama.cpp model's tokenizer alone: counts tokens without loading the weights.

An engine pool runs its llama.cpp replicas in other processes; stages in this process
still count prompt tokens exactly (refine budgets, the context-overflow check). Loading a
GGUF file with ``vocab_only`` reads its vocabulary only (a few MB, milliseconds).
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import EngineError
from .llama_cpp import llama_lib


class LlamaVocab:
    """Token counting with the vocabulary of the GGUF model file ``path``; thread-safe."""

    def __init__(self, path: str):
        self._lib = lib = llama_lib()
        self._lock = threading.Lock()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        self._model: Any = lib.llama_model_load_from_file(path.encode(), params)
        if not self._model:
            raise EngineError(f"llama.cpp could not read the vocabulary of {path}")
        self._vocab = lib.llama_model_get_vocab(self._model)

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes as a raw prompt (with BOS), as ``LlamaCppEngine`` counts."""
        lib, data = self._lib, text.encode("utf-8")
        with self._lock:
            if self._model is None:
                raise EngineError("the tokenizer is closed")
            n = lib.llama_tokenize(self._vocab, data, len(data), None, 0, True, True)
        return -n if n < 0 else n

    def close(self) -> None:
        """Free the vocabulary."""
        with self._lock:
            if self._model is not None:
                self._lib.llama_model_free(self._model)
                self._model = None
