"""Counting tokens without loading a model: the one estimate every layer shares.

Where no tokenizer is at hand (a remote server without a tokenize endpoint, admission
predicting a prompt's size before any engine is chosen, a token budget with no engine),
tailrace counts about 4 characters per token. ``token_counter`` counts exactly where a
model's vocabulary can be read without its weights (llama.cpp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .models import model_info, model_path

CHARS_PER_TOKEN = 4


def approx_tokens(text: str) -> int:
    """Rough token count of ``text``: 4 characters a token, at least 1.

    >>> approx_tokens(""), approx_tokens("abcd"), approx_tokens("abcdefgh")
    (1, 2, 3)
    """
    return len(text) // CHARS_PER_TOKEN + 1


def token_counter(spec: dict[str, Any]) -> Callable[[str], int]:
    """Count tokens for ``spec``'s model in this process without loading the engine: exact
    for llama.cpp (its vocabulary only, no weights), else ``approx_tokens``."""
    if spec.get("backend") != "llama_cpp":
        return approx_tokens
    from .llama_cpp.vocab import LlamaVocab

    path = spec.get("path") or str(model_path(model_info(str(spec.get("model", "")), "llama_cpp")))
    return LlamaVocab(path).count_tokens
