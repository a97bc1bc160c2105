"""Engine protocols: what generation and embedding backends provide.

Backends live in their own modules and import their heavy dependency (llama_cpp,
onnxruntime, openai) only when an engine is created. Engines are thread-safe to call
from one worker thread at a time; the runtime calls them from ``blocking`` stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class GenerationRequest:
    """One generation call: a raw completion ``prompt`` (base models), or chat ``messages``
    ``[{"role": "user", "content": ...}]`` (chat models; the engine applies the model's chat
    template)."""

    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    max_tokens: int = 64  # most tokens to generate
    temperature: float = 0.0  # 0 means greedy (deterministic)
    stop: tuple[str, ...] = ()  # strings that end generation (not included in the text)
    seed: int | None = None
    logprobs: bool = False  # report the sampled tokens' mean log-probability as
    # ``Generation.extra["mean_logprob"]`` (engines that can)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much mass
    presence_penalty: float = 0.0  # subtracted from a token's logit once it was generated
    frequency_penalty: float = 0.0  # subtracted per time a token was generated
    response_format: dict[str, Any] | None = None  # structured output: a constraint checked
    # by ``structured.check_response_format`` (its forms: that module); None: free text.
    # Engines whose ``response_formats`` lacks its type refuse the request
    priority: int = 0  # the request's admission class (higher is more urgent): engines
    # that schedule (llama.cpp) start, prefill and preempt by it
    deadline: float | None = None  # wall-clock seconds (time.time()) it is due by;
    # earlier first within a class
    session: str | None = None  # the caller's session (conversation) id: an engine pool with
    # ``dispatch: prefix_affinity`` sends a session's requests to the replica that served it
    tools: Any = None  # the client tools it offers (``tool_calls.ToolSpec``), or None:
    # engines with ``tool_calls = True`` answer a call in ``tool_calls``' text form;
    # ``messages`` may then hold assistant ``tool_calls`` and ``tool`` results


@dataclass(frozen=True)
class Generation:
    """The result of one request: text, token counts and why it stopped."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens) |
    # "cancelled" (the caller stopped it)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


#: ``on_token(request_index, text_piece)``: called as each piece is produced; returning
#: ``False`` asks the engine to stop that request (its caller went away).
TokenCallback = Callable[[int, str], bool | None]


@runtime_checkable
class GenerationEngine(Protocol):
    """Text generation backend."""

    model: str  # the model name it was created with (e.g. "smollm2-135m-instruct")
    context_length: int  # tokens of context per sequence
    # optional class attribute ``response_formats: frozenset[str]``: the
    # ``GenerationRequest.response_format`` types it enforces (absent: none)

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes in this model's tokenizer."""

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        """Run a batch of requests together; results in request order.

        Raises ``ContextOverflow`` (for the whole batch) if a prompt plus its
        max_tokens exceeds ``context_length``; callers check with ``count_tokens``.
        """

    def close(self) -> None:
        """Free the model."""


@runtime_checkable
class EmbeddingEngine(Protocol):
    """Text embedding backend: batch of texts -> float32 matrix, rows L2-normalised."""

    model: str
    dim: int

    def embed(self, texts: Sequence[str]) -> Any:
        """A ``numpy.ndarray`` of shape ``(len(texts), dim)``, dtype float32."""

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes in this model's tokenizer (before truncation)."""

    def close(self) -> None:
        """Free the model."""
