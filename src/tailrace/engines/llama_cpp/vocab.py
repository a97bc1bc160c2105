"""The ``llama_cpp`` module, loaded once; a model's vocabulary: text to tokens, tokens to
text, the chat template.

llama.cpp logs to stderr by default; ``llama_lib`` routes its messages to Python logging
(errors only) through one ctypes callback that must stay referenced while installed.
``LlamaVocab`` loads a GGUF file's vocabulary alone (``vocab_only``: a few MB,
milliseconds), so stages in a pool's process count prompt tokens exactly while its
replicas run the weights in other processes.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Sequence
from typing import Any

from ...errors import EngineError
from ..base import GenerationRequest

_BACKEND_LOCK = threading.Lock()
_BACKEND_READY = False
_LOG = logging.getLogger("tailrace.engines.llama_cpp")
_LOG_STATE = {"level": 0}
_LOG_CALLBACK: Any = None  # the ctypes callback; must stay referenced while installed


def _on_llama_log(level: int, text: bytes | None, _user: Any) -> None:
    """llama.cpp's log messages go to Python logging, errors only (ggml level 4)."""
    if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous message
        _LOG_STATE["level"] = level
    if _LOG_STATE["level"] == 4 and text:
        _LOG.error("llama.cpp: %s", text.decode("utf-8", errors="replace").rstrip())


def llama_lib() -> Any:
    """The ``llama_cpp`` module, its backends initialised once per process and its stderr
    logging silenced; EngineError with the install command if it is missing."""
    global _BACKEND_READY, _LOG_CALLBACK
    try:
        import llama_cpp as lib
    except ImportError:
        raise EngineError("the llama_cpp backend needs llama-cpp-python; install it "
                          "with: pip install llama-cpp-python") from None
    with _BACKEND_LOCK:
        if not _BACKEND_READY:
            _LOG_CALLBACK = lib.llama_log_callback(_on_llama_log)
            lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
            lib.llama_backend_init()
            _BACKEND_READY = True
    return lib


class Vocab:
    """The vocabulary of a loaded ``llama_model``; the model outlives it.

    ``pieces`` caches each token's bytes (None: an end-of-generation token) for the
    decode loop, the only thread that calls ``piece``.
    """

    def __init__(self, lib: Any, model: Any, name: str):
        """lib: the ``llama_cpp`` module. model: a ``llama_model`` pointer. name: the
        model's name, for error messages."""
        self._lib, self._model, self.name = lib, model, name
        self.ptr = lib.llama_model_get_vocab(model)
        self.n_tokens = int(lib.llama_vocab_n_tokens(self.ptr))
        self.pieces: dict[int, bytes | None] = {}  # token -> piece, None for EOG
        self.template = self.meta("tokenizer.chat_template")
        self._formatter: Any = None

    def meta(self, key: str) -> str | None:
        """The model file's metadata value ``key`` (None if it has none)."""
        size = 1 << 14
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def count(self, text: str) -> int:
        """Tokens ``text`` takes as a raw prompt (with BOS)."""
        data = text.encode("utf-8")
        n = self._lib.llama_tokenize(self.ptr, data, len(data), None, 0, True, True)
        return -n if n < 0 else n

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        data = text.encode("utf-8")
        lib = self._lib
        cap = len(data) + 8
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(self.ptr, data, len(data), buf, cap, add_special, True)
        if n < 0:
            cap = -n
            buf = (lib.llama_token * cap)()
            n = lib.llama_tokenize(self.ptr, data, len(data), buf, cap, add_special, True)
            if n < 0:
                raise EngineError(f"llama.cpp failed to tokenize a text of {len(data)} bytes")
        return buf[:n]

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """Chat ``messages`` as the prompt text the model's chat template makes of them."""
        if not self.template:
            raise EngineError(f"model '{self.name}' has no chat template; send a 'prompt' "
                              "instead of 'messages'")
        if self._formatter is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            lib, vocab = self._lib, self.ptr

            def text(tok: int) -> str:
                if tok < 0:
                    return ""
                return lib.llama_vocab_get_text(vocab, tok).decode("utf-8", errors="replace")

            self._formatter = Jinja2ChatFormatter(
                template=self.template, eos_token=text(lib.llama_vocab_eos(vocab)),
                bos_token=text(lib.llama_vocab_bos(vocab)), add_generation_prompt=True)
        try:
            return self._formatter(messages=[dict(m) for m in messages]).prompt
        except Exception as e:
            raise EngineError(f"model '{self.name}': chat template failed: {e}") from e

    def prompt(self, req: GenerationRequest) -> list[int]:
        """The prompt tokens of ``req``: its ``messages`` through the chat template, or
        its raw ``prompt`` (with BOS)."""
        if req.messages is not None:
            tokens = self.tokenize(self.render(req.messages), add_special=False)
        elif req.prompt is not None:
            tokens = self.tokenize(req.prompt, add_special=True)
        else:
            raise EngineError("a generation request needs 'prompt' or 'messages'")
        if not tokens:
            raise EngineError("the prompt is empty (it has no tokens)")
        return tokens

    def piece(self, tok: int) -> bytes | None:
        """The bytes of token ``tok``; None for end-of-generation tokens (cached)."""
        lib = self._lib
        if lib.llama_vocab_is_eog(self.ptr, tok):
            piece = None
        else:
            buf = ctypes.create_string_buffer(64)
            n = lib.llama_token_to_piece(self.ptr, tok, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lib.llama_token_to_piece(self.ptr, tok, buf, -n, 0, False)
            piece = buf.raw[:max(n, 0)]
        self.pieces[tok] = piece
        return piece


class LlamaVocab:
    """Token counting with the vocabulary of the GGUF model file ``path``; thread-safe."""

    def __init__(self, path: str):
        lib = llama_lib()
        self._lock = threading.Lock()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        model = lib.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise EngineError(f"llama.cpp could not read the vocabulary of {path}")
        self.vocab = Vocab(lib, model, path)  # the model stays loaded for the counter's life

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes as a raw prompt (with BOS), as ``LlamaCppEngine`` counts."""
        with self._lock:
            return self.vocab.count(text)
