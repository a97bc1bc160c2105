"""The ``llama_cpp`` module, loaded once per process with its backends initialised.

llama.cpp logs to stderr by default; its messages go to Python logging instead (errors
only), through one ctypes callback that must stay referenced while it is installed.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from ...errors import EngineError

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
