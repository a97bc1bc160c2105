"""Run a Python program in a limited subprocess: the ``unit_tests`` verifier's sandbox.

``await run_program(source, limits)`` starts ``python -I -B -c BOOTSTRAP`` with
``asyncio.create_subprocess_exec`` (no thread of ours; the event loop keeps serving other
records while the program runs; Python 3.11's asyncio waits for the exit in a helper
thread of its own) and returns a ``SandboxResult`` whose ``status`` says how
the program ended. The program is never trusted to report on itself: a ``passed`` needs
the bootstrap's end-of-program note, written only after the whole program ran.

What the sandbox does:

- **Directory.** A fresh temporary directory per run (``work/`` inside it is the
  program's cwd, ``HOME`` and ``TMPDIR``), removed afterwards, whatever happened.
- **Interpreter.** ``python -I -B``: no ``PYTHON*`` variables, no user site-packages, no
  script directory on ``sys.path``, no ``.pyc`` written; a minimal environment
  (``PATH``, ``HOME``, ``TMPDIR``, ``LC_ALL``, and one thread for OpenMP/OpenBLAS/MKL
  pools); stdin is ``/dev/null``.
- **Limits, set in the child** by the bootstrap before the program runs: ``RLIMIT_AS``
  (address space: ``memory_mb``), ``RLIMIT_CPU`` (CPU seconds: the timeout plus one),
  ``RLIMIT_FSIZE`` (largest file it may write), ``RLIMIT_NOFILE`` (open files),
  ``RLIMIT_NPROC`` 0 (no new processes or threads, for a non-root user) and
  ``RLIMIT_CORE`` 0.
- **Wall clock.** After ``timeout_s`` the whole process group (the child is a session
  leader) gets ``SIGKILL``; so does it when the run is cancelled (a stage timeout).
- **Output.** stdout and stderr go to files beside ``work/`` (never through the event
  loop), each bounded by ``RLIMIT_FSIZE``: a program that prints more fails with "output
  or file size limit"; the first ``max_output`` bytes of each are kept in the result.
- **Refusals.** An audit hook (``sys.addaudithook``) refuses, by raising
  ``SandboxRefused`` (a ``PermissionError``) in the program: opening a file for writing
  outside ``work/`` (and removing, renaming, linking, ``chmod``-ing, ``shutil``-copying or
  deleting a tree there); starting processes (``subprocess``, ``os.system``, ``os.exec*``,
  ``os.spawn*``, ``os.posix_spawn``, ``os.fork``, ``pty``); sending signals
  (``os.kill``, ``os.killpg``); sockets and the network clients (``socket``, ``http``,
  ``urllib``, ``ftplib``, ``smtplib``...); ``ctypes`` looking up or calling a C function
  or reading raw memory (importing ``ctypes``, as numpy does, is allowed); and changing
  resource limits. ``socket.socket`` and its factory functions are also replaced by ones
  that raise, so a refusal reads "refused: socket" even before the audit hook sees it.
- **Verdicts.** ``passed`` (the program ran to its end), ``error`` (an exception: its
  type and the program's line), ``refused`` (an exception the sandbox raised), ``memory``,
  ``timeout`` (wall clock or CPU), ``exit`` (``sys.exit``/``os._exit`` before the end,
  whatever the status: a program that exits early has not run its tests), ``killed`` (a
  signal), ``output`` (a file or its output past ``RLIMIT_FSIZE``).

What it does NOT protect against — it is **not a security boundary** against hostile
code; it keeps honest-but-wrong generated code (infinite loops, runaway allocations,
stray file writes, accidental network use, ``sys.exit`` in the middle) from hurting the
run or the machine:

- Audit hooks are a Python-level tripwire. Native code bypasses them: ``ctypes`` or
  ``cffi`` reached some other way, a C extension from site-packages, ``_posixsubprocess``,
  writing through a file descriptor inherited or opened before, ``mmap`` tricks, or the
  program removing the refusals from the objects in its own memory.
- Reading is not restricted: the program can read every file the user running tailrace
  can read (keys, tokens, ``~/.ssh`` of the real user, the environment of other
  processes under ``/proc``) and print it into its output.
- There is no network namespace, no seccomp filter, no separate user: a bypass has the
  full network and the rights of the tailrace process. As root, ``RLIMIT_NPROC`` is
  ignored and hard limits can be raised by native code.
- ``RLIMIT_AS`` bounds address space, not resident memory of other processes; the disk
  is bounded per file (``RLIMIT_FSIZE``), not in total (the wall clock bounds it), and
  the temporary directory is in the system's ``/tmp``.

For untrusted code run it in a container or VM (gVisor, Firecracker, nsjail, a
``docker run --network none --read-only --memory ...``) and call that from a ``python``
verifier. docs/design.md, "The verify sandbox", says the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass

#: the program's file name in tracebacks (line numbers refer to it)
PROGRAM = "program.py"
#: native thread pools held to one thread (there may be no new threads: ``RLIMIT_NPROC``)
ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use.

    timeout_s:   wall-clock seconds before the process group is killed.
    memory_mb:   address space (``RLIMIT_AS``) in MiB; Python itself needs ~30.
    file_mb:     the largest file the program may write (``RLIMIT_FSIZE``).
    open_files:  most open file descriptors (``RLIMIT_NOFILE``).
    max_output:  bytes of stdout and of stderr kept in the result.
    """

    timeout_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16
    open_files: int = 64
    max_output: int = 8192


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed program ended.

    status:     passed | error | refused | memory | timeout | exit | killed | output
                (the module docstring says when each).
    reason:     one line for a verdict ("passed", "timeout after 10 s",
                "AssertionError at line 12: assert f(2) == 4", "refused: socket", ...).
    returncode: the process's exit status (negative: killed by that signal).
    stdout, stderr: the first ``Limits.max_output`` bytes of each, decoded.
    """

    status: str
    reason: str
    returncode: int | None
    stdout: str = ""
    stderr: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# The child's first code: limits, refusals, then the program; its last act writes one
# JSON note to the result file, opened before the program could refuse it anything.
BOOTSTRAP = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
work = os.path.realpath(cfg["work"])
note_fd = os.open(cfg["note"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
MEMORY_NOTE = b'{"status": "memory"}'  # written without allocating
def note(status, **kw):
    os.write(note_fd, json.dumps({"status": status, **kw}).encode())
    os.close(note_fd)
with open(cfg["program"], encoding="utf-8") as f:
    source = f.read()
def limit(what, n):
    try:
        resource.setrlimit(what, (n, n))
    except (ValueError, OSError):
        pass
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_CPU, cfg["cpu_s"])
limit(resource.RLIMIT_FSIZE, cfg["file_bytes"])
limit(resource.RLIMIT_NOFILE, cfg["open_files"])
limit(resource.RLIMIT_NPROC, 0)
limit(resource.RLIMIT_AS, cfg["memory_bytes"])

class SandboxRefused(PermissionError):
    """The verify sandbox refused an operation."""

refused = []
def refuse(what):
    refused.append(what)
    raise SandboxRefused("refused: " + what)

def inside(p):
    if isinstance(p, int):
        return True  # an open descriptor
    try:
        p = os.path.realpath(os.fsdecode(p))
    except (TypeError, ValueError):
        return False
    return p == work or p.startswith(work + os.sep) or p == os.devnull

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATHS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.link": 2,
         "os.symlink": 2, "os.truncate": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
         "os.chflags": 1, "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.copytree": 2,
         "shutil.copymode": 2, "shutil.copystat": 2, "shutil.move": 2, "shutil.chown": 1,
         "shutil.make_archive": 1, "shutil.unpack_archive": 2}
NEVER = {"subprocess.Popen": "subprocess", "os.system": "os.system", "os.exec": "os.exec",
         "os.spawn": "os.spawn", "os.posix_spawn": "os.posix_spawn", "os.fork": "os.fork",
         "os.forkpty": "os.fork", "pty.spawn": "subprocess", "os.kill": "os.kill",
         "os.killpg": "os.kill", "signal.pthread_kill": "os.kill",
         "ctypes.dlsym": "ctypes", "ctypes.dlsym/handle": "ctypes",
         "ctypes.call_function": "ctypes", "ctypes.cdata": "ctypes",
         "ctypes.string_at": "ctypes", "ctypes.wstring_at": "ctypes",
         "resource.setrlimit": "setrlimit",
         "resource.prlimit": "setrlimit", "webbrowser.open": "webbrowser"}
NET = ("socket.", "http.", "urllib.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
       "nntplib.", "telnetlib.")

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if ((mode is not None and any(c in mode for c in "wax+"))
                or (mode is None and flags & WRITE_FLAGS)) and not inside(path):
            refuse("write outside the sandbox directory: %.120s" % (path,))
    elif event in PATHS:
        for p in args[:PATHS[event]]:
            if p is not None and not inside(p):
                refuse("%s outside the sandbox directory: %.120s" % (event, p))
    elif event in NEVER:
        refuse(NEVER[event])
    elif event.startswith(NET):
        refuse("socket" if event.startswith("socket.") else event.split(".")[0])
    elif event == "sqlite3.connect" and args and args[0] not in (":memory:", b":memory:") \
            and not inside(args[0]):
        refuse("sqlite3 outside the sandbox directory")

import socket
def no_socket(*a, **k):
    refuse("socket")
class NoSocket(socket.socket):
    def __init__(self, *a, **k):
        refuse("socket")
socket.socket = socket.SocketType = NoSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd",
              "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    setattr(socket, _name, no_socket)
del _name
sys.addaudithook(hook)

def line_of(e):
    n, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == cfg["program_name"]:
            n = tb.tb_lineno
        tb = tb.tb_next
    return n

g = {"__name__": "__main__", "__file__": cfg["program_name"], "__builtins__": __builtins__}
try:
    exec(compile(source, cfg["program_name"], "exec"), g)
except SystemExit as e:
    code = e.code
    g.clear()
    note("exit", code=code if isinstance(code, (int, type(None))) else str(code)[:80])
except MemoryError:
    g.clear()
    os.write(note_fd, MEMORY_NOTE)
except BaseException as e:
    g.clear()
    try:
        import traceback
        traceback.print_exc()
    except BaseException:
        pass
    line = e.lineno if isinstance(e, SyntaxError) else line_of(e)
    kind = "refused" if isinstance(e, SandboxRefused) else "error"
    note(kind, type=type(e).__name__, line=line, message=str(e)[:300], refused=refused[:1])
else:
    g.clear()
    note("passed", refused=refused[:1])
'''


def _one_line(text: str, n: int = 200) -> str:
    """``text`` on one line, at most ``n`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _head(path: str, n: int) -> str:
    """The first ``n`` bytes of the file at ``path``, decoded."""
    with open(path, "rb") as f:
        return f.read(n).decode("utf-8", "replace")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _source_line(source: str, line: int | None) -> str:
    lines = source.splitlines()
    if line is None or not 1 <= line <= len(lines):
        return ""
    return lines[line - 1].strip()


def _reason(note: dict | None, source: str, limits: Limits, returncode: int | None,
            stderr: str) -> tuple[str, str]:
    """(status, reason) from the bootstrap's note (None: it wrote none) and the exit."""
    if note is None:  # ended without the bootstrap's last word
        if returncode is not None and returncode < 0:
            sig = -returncode
            if sig == signal.SIGXCPU:
                return "timeout", f"timeout: CPU limit of {int(limits.timeout_s) + 1} s"
            name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
            return "killed", f"killed by signal {name}"
        if "MemoryError" in stderr:
            return "memory", f"memory limit ({limits.memory_mb} MB)"
        return "exit", f"exited before the end (status {returncode})"
    status = note.get("status")
    if status == "passed":
        if returncode == 0:
            return "passed", "passed"
        return "exit", f"ran to the end but exited with status {returncode}"
    if status == "memory":
        return "memory", f"memory limit ({limits.memory_mb} MB)"
    if status == "exit":
        return "exit", _one_line(f"exited before the end (sys.exit({note.get('code')!r}))")
    kind, msg, line = note.get("type", "Error"), note.get("message") or "", note.get("line")
    if status == "refused" or (note.get("refused") and status == "error"):
        what = msg if msg.startswith("refused: ") else "refused: " + note["refused"][0]
        return "refused", _one_line(what)
    if kind == "OSError" and "File too large" in msg:
        return "output", f"output or file size limit ({limits.file_mb} MB)"
    where = f" at line {line}" if line else ""
    detail = msg or _source_line(source, line)
    return "error", _one_line(f"{kind}{where}" + (f": {detail}" if detail else ""))


async def run_program(source: str, limits: Limits = Limits()) -> SandboxResult:
    """Run the Python program ``source`` in the sandbox (see the module docstring);
    never raises for anything the program does."""
    root = tempfile.mkdtemp(prefix="tailrace-verify-")
    proc: asyncio.subprocess.Process | None = None
    try:
        work = os.path.join(root, "work")
        os.mkdir(work)
        program = os.path.join(root, PROGRAM)
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        note_path = os.path.join(root, "note.json")
        cfg = {"work": work, "note": note_path, "program": program, "program_name": PROGRAM,
               "cpu_s": int(limits.timeout_s) + 1, "memory_bytes": limits.memory_mb << 20,
               "file_bytes": limits.file_mb << 20, "open_files": limits.open_files}
        env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8",
               **dict.fromkeys(ONE_THREAD, "1")}
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-B", "-c", BOOTSTRAP, json.dumps(cfg),
                cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True)
        status = None
        try:
            exited = asyncio.ensure_future(proc.wait())
            done, _ = await asyncio.wait({exited}, timeout=limits.timeout_s)
            if exited not in done:
                status = ("timeout", f"timeout after {limits.timeout_s:g} s")
                _kill_group(proc.pid)
                await exited
        finally:
            if proc.returncode is None:  # cancelled (a stage timeout): kill, then reap
                _kill_group(proc.pid)
                await proc.wait()
            _kill_group(proc.pid)  # anything it left in its group
        stdout, stderr = (_head(p, limits.max_output) for p in (out_path, err_path))
        if status is None:
            try:
                with open(note_path, encoding="utf-8") as f:
                    note = json.loads(f.read() or "null")
            except (OSError, ValueError):
                note = None
            status = _reason(note, source, limits, proc.returncode, stderr)
        return SandboxResult(status[0], status[1], proc.returncode, stdout, stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
