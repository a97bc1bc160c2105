"""Start llama-cpp-python's OpenAI-compatible server as a subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"

#: Runs ``llama_cpp.server`` with ggml's extra CPU buffer types (AMX tiles, repacked weights)
#: turned off. With them, llama-cpp-python 0.3.36 built on this AMX-capable VM segfaults in
#: any decode of more than one token, and the server has no flag to turn them off.
NO_EXTRA_BUFTS = """\
import runpy
import llama_cpp.llama_cpp as c
_defaults = c.llama_model_default_params
def _params():
    p = _defaults()
    p.use_extra_bufts = False
    return p
c.llama_model_default_params = _params
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    """A TCP port on the loopback interface that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running server: its OpenAI API root, process and log file."""

    base_url: str
    command: list[str]
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 2000) -> str:
        """The last ``chars`` characters of the server's stdout and stderr.

        chars: how many characters to return.
        """
        return self.log.read_text(errors="replace")[-chars:]


def _models_answer(base_url: str) -> bool:
    """Whether ``GET {base_url}/models`` answers with JSON.

    base_url: the server's OpenAI API root.
    """
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=2) as resp:
            json.loads(resp.read())
            return True
    except (OSError, ValueError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def llama_server(model: Path, *args: str, n_ctx: int = 1024, n_threads: int = 1,
                 ready_s: float = 90.0, extra_bufts: bool = False) -> Iterator[Server]:
    """Run llama-cpp-python's OpenAI-compatible server for ``model`` until the block ends.

    model: the GGUF model file.
    args: extra server flags, e.g. ``"--embedding", "true"``.
    n_ctx: the context window the server gives the model.
    n_threads: CPU threads for inference.
    ready_s: the most seconds to wait for ``GET /v1/models`` to answer.
    extra_bufts: run plain ``python -m llama_cpp.server`` (else via ``NO_EXTRA_BUFTS``).
    """
    port = free_port()
    start = ["-m", "llama_cpp.server"] if extra_bufts else ["-c", NO_EXTRA_BUFTS]
    command = [sys.executable, *start, "--model", str(model),
               "--host", HOST, "--port", str(port), "--n_ctx", str(n_ctx),
               "--n_threads", str(n_threads), "--n_threads_batch", str(n_threads), *args]
    with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        server = Server(f"http://{HOST}:{port}/v1", command, proc, log)
        try:
            deadline = time.monotonic() + ready_s
            while not _models_answer(server.base_url):
                if proc.poll() is not None:
                    raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}:\n"
                                       f"{server.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama_cpp.server not ready after {ready_s:g}s:\n"
                                       f"{server.log_tail()}")
                time.sleep(0.2)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
