"""Counting tokens without a model: the one estimate every layer shares.

Where no tokenizer is at hand (a remote server without a tokenize endpoint, admission
predicting a prompt's size before any engine is chosen, a token budget with no engine),
tailrace counts about 4 characters per token.
"""

from __future__ import annotations

CHARS_PER_TOKEN = 4


def approx_tokens(text: str) -> int:
    """Rough token count of ``text``: 4 characters a token, at least 1.

    >>> approx_tokens(""), approx_tokens("abcd"), approx_tokens("abcdefgh")
    (1, 2, 3)
    """
    return len(text) // CHARS_PER_TOKEN + 1
