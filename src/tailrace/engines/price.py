"""Provider prices: what an engine's calls cost, from the tokens they really used.

An ``engines:`` spec may declare ``price: {prompt_per_1k, completion_per_1k}`` (any
currency unit, per 1,000 tokens) and ``latency: {first_token_ms, per_token_ms}`` hints.
Neither reaches the engine: ``strip`` takes them off before an engine is created, and
the operators that call the engine (``generate``, ``route``) price each call with
``Price.cost``; ``embed`` prices an ONNX embedder's calls by the tokens its own
tokenizer counts (prompt tokens only). The ``openai`` backend's embedding calls report
no token counts here, so ``check`` refuses a price there at compile time
(docs/routing.md, "Prices").

>>> p = Price(0.5, 1.5)
>>> p.cost(1000, 2000), p.bound(200, 64)
(3.5, 0.196)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..errors import EngineError

#: spec keys about the provider, never passed to the engine
KEYS = ("price", "latency")
_PRICE = ("prompt_per_1k", "completion_per_1k")
_LATENCY = ("first_token_ms", "per_token_ms")


class Price(NamedTuple):
    """Per 1,000 prompt and completion tokens."""

    prompt_per_1k: float
    completion_per_1k: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """What a call that used these tokens cost."""
        return (prompt_tokens * self.prompt_per_1k
                + completion_tokens * self.completion_per_1k) / 1000.0

    def bound(self, prompt_tokens: int, max_tokens: int) -> float:
        """The most a call with this prompt and ``max_tokens`` can cost (rounded up to
        1e-9 so that float noise never lets a call pass a budget it cannot)."""
        return math.ceil(self.cost(prompt_tokens, max_tokens) * 1e9) / 1e9


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def check(name: str, spec: dict[str, Any], kind: str) -> None:
    """EngineError unless ``spec``'s ``price``/``latency`` are well formed and its engine
    (used for ``kind``) reports the token counts a price needs."""
    where = f"engine '{name}'"
    price = spec.get("price")
    if price is not None:
        if not isinstance(price, dict) or not price or set(price) - set(_PRICE) or \
                not all(_number(price[k]) for k in price):
            raise EngineError(f"{where}: price must be {{prompt_per_1k: N, completion_per_1k: "
                              f"N}} with numbers >= 0 (any currency unit), got {price!r}")
        if kind == "embed" and spec.get("backend") != "onnx":
            raise EngineError(f"{where}: price needs the token counts of each call, and "
                              f"backend '{spec.get('backend')}' reports none for embeddings; "
                              "remove price from this engine")
        if kind == "embed" and price.get("completion_per_1k"):
            raise EngineError(f"{where}: an embedding has no completion tokens; give only "
                              "price: {prompt_per_1k: N}")
    latency = spec.get("latency")
    if latency is not None and (not isinstance(latency, dict) or set(latency) - set(_LATENCY)
                                or not all(_number(latency[k]) for k in latency)):
        raise EngineError(f"{where}: latency must be {{first_token_ms: N, per_token_ms: N}} "
                          f"with numbers >= 0, got {latency!r}")


def price_of(spec: Any) -> Price | None:
    """The ``Price`` an engine spec declares, or None (unpriced: its calls cost nothing)."""
    p = spec.get("price") if isinstance(spec, dict) else None
    if not p:
        return None
    return Price(float(p.get("prompt_per_1k", 0.0)), float(p.get("completion_per_1k", 0.0)))


def strip(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` without the provider keys (what the engine is created from)."""
    return {k: v for k, v in spec.items() if k not in KEYS} if any(k in spec for k in KEYS) \
        else spec
