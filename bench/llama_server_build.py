"""Build llama.cpp's own ``llama-server`` from the sources tailrace already installs.

Why: bench/vs_llama_server.py compares tailrace's engine with the server users would pick
instead. The fair opponent is the *same* llama.cpp: the sources vendored in the
llama-cpp-python sdist of the installed version, built with the wheel's CPU flags
(GGML_NATIVE, OpenMP, llamafile kernels, Release). Nothing is downloaded except that sdist,
through pip from the package registry; the web UI (which would fetch prebuilt assets from
the internet) is switched off.

Everything lives under ``~/.cache/tailrace/llama-server/<version>/``: the sdist, the
unpacked sources, the cmake build dir and ``bin/llama-server``. A second call finds the
binary and builds nothing. A failed step returns None with a message; the caller carries on
without llama-server.

    python bench/llama_server_build.py          # build (or find) it, print the path
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    # the wheel's CPU build: llama_print_system_info() reports AVX512..., OPENMP, LLAMAFILE
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DGGML_LLAMAFILE=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # ON would download the UI from a Hugging Face bucket
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)


def llama_cpp_version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def cache_dir(version: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "tailrace" / "llama-server" / version


def binary_path(version: str | None = None) -> Path:
    return cache_dir(version or llama_cpp_version()) / "bin" / "llama-server"


def _run(cmd: list[str], log_file: Path) -> bool:
    with open(log_file, "ab") as fh:
        fh.write(("\n$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode == 0


def _sdist(cache: Path, version: str, say: Callable[[str], None], log: Path) -> Path | None:
    name = f"llama_cpp_python-{version}.tar.gz"
    target = cache / name
    if target.exists():
        return target
    say(f"llama-server: fetching the llama-cpp-python {version} sdist (pip download)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={version}", "-d", str(cache)]
    if not _run(cmd, log) or not target.exists():
        say(f"llama-server: pip download failed (see {log})")
        return None
    return target


def _unpack(sdist: Path, cache: Path, version: str) -> Path:
    src = cache / "src"
    llama = src / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (llama / "tools" / "server" / "CMakeLists.txt").exists():
        return llama
    shutil.rmtree(src, ignore_errors=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(src, filter="data")
    return llama


def ensure_llama_server(say: Callable[[str], None] = print, jobs: int = 2) -> Path | None:
    """The path of a llama-server built from the installed version's sources, or None."""
    version = llama_cpp_version()
    cache = cache_dir(version)
    binary = cache / "bin" / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            say(f"llama-server: {tool} not found; cannot build")
            return None
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "build.log"
    started = time.monotonic()
    sdist = _sdist(cache, version, say, log)
    if sdist is None:
        return None
    try:
        llama = _unpack(sdist, cache, version)
    except (OSError, tarfile.TarError) as exc:
        say(f"llama-server: unpacking {sdist} failed: {exc}")
        return None
    build = cache / "build"
    say(f"llama-server: configure ({build}, log {log})")
    if not _run(["cmake", "-S", str(llama), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS], log):
        say(f"llama-server: cmake configure failed (see {log})")
        return None
    say(f"llama-server: build -j {jobs} (several minutes on 2 cores)")
    if not _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], log):
        say(f"llama-server: build failed (see {log})")
        return None
    built = build / "bin" / "llama-server"
    if not built.exists():
        say(f"llama-server: build finished but {built} is missing (see {log})")
        return None
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)
    say(f"llama-server: done in {time.monotonic() - started:.0f} s -> {binary}")
    return binary


if __name__ == "__main__":
    path = ensure_llama_server()
    print(path if path else "llama-server: not available")
    sys.exit(0 if path else 1)
