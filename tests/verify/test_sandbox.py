"""The verify sandbox refuses what it must and always says how a program ended: loops
are killed, allocations hit the memory limit, writes outside its directory, sockets and
new processes are refused, output is bounded, an early exit is not a pass."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tailrace.verify.sandbox import Limits, run_program

FAST = Limits(timeout_s=2.0, memory_mb=256)


def run(source: str, limits: Limits = FAST):
    return asyncio.run(run_program(source, limits))


HUMANEVAL = '''
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False


def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0], 0.3) == True
    assert candidate([1.0, 2.0, 3.0], 0.5) == False


check(has_close_elements)
'''


def test_a_passing_humaneval_program_passes():
    r = run(HUMANEVAL)
    assert (r.status, r.reason, r.returncode) == ("passed", "passed", 0)


def test_a_failing_assertion_names_its_line():
    r = run(HUMANEVAL.replace("== False", "== True"))
    assert r.status == "error"
    assert r.reason == "AssertionError at line 15: assert candidate([1.0, 2.0, 3.0], 0.5) == True"
    assert "AssertionError" in r.stderr


def test_a_loop_forever_is_killed_at_the_timeout():
    t0 = time.monotonic()
    r = run("while True:\n    pass\n", Limits(timeout_s=1.0))
    assert (r.status, r.reason) == ("timeout", "timeout after 1 s")
    assert r.returncode == -9 and time.monotonic() - t0 < 5


def test_a_program_that_closes_its_output_and_sleeps_is_still_killed():
    r = run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n", Limits(timeout_s=1))
    assert r.status == "timeout"


def test_unbounded_allocation_hits_the_memory_limit():
    r = run("xs = []\nwhile True:\n    xs.append(bytearray(10 ** 7))\n")
    assert (r.status, r.reason) == ("memory", "memory limit (256 MB)")
    assert run("x = bytearray(2 * 10 ** 9)\n").status == "memory"


def test_writes_outside_its_directory_are_refused(tmp_path):
    target = tmp_path / "evil.txt"
    for how in (f"open({str(target)!r}, 'w').write('x')",
                f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
                f"import shutil\nshutil.copyfile(__file__, {str(target)!r})"):
        r = run(how + "\n")
        assert r.status == "refused", (how, r)
        assert r.reason.startswith("refused: ") and str(target) in r.reason
    assert not target.exists()


def test_removing_or_renaming_outside_is_refused(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    for how in (f"import os\nos.remove({str(keep)!r})",
                f"import os\nos.rename({str(keep)!r}, 'mine.txt')",
                f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
        assert run(how + "\n").status == "refused", how
    assert keep.read_text() == "precious"


def test_its_own_directory_is_writable_and_removed_afterwards():
    r = run("import os, tempfile\nopen('a.txt', 'w').write('x')\nos.rename('a.txt', 'b.txt')\n"
            "os.remove('b.txt')\ntempfile.mkstemp()\nprint(os.getcwd())\n")
    assert r.status == "passed", r
    assert not os.path.exists(r.stdout.strip())


@pytest.mark.parametrize("how,what", [
    ("import socket\nsocket.socket()", "socket"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "socket"),
    ("import _socket\n_socket.socket()", "socket"),  # past the patched module: the audit hook
    ("import urllib.request\nurllib.request.urlopen('http://x')", "urllib"),
])
def test_sockets_are_refused(how, what):
    r = run(how + "\n")
    assert (r.status, r.reason) == ("refused", f"refused: {what}"), r


@pytest.mark.parametrize("how,what", [
    ("import os\nos.fork()", "os.fork"),
    ("import os\nos.system('true')", "os.system"),
    ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
    ("import subprocess\nsubprocess.run(['true'])", "subprocess"),
    ("import os\nos.kill(os.getppid(), 9)", "os.kill"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "setrlimit"),
    ("import ctypes\nctypes.CDLL(None).system(b'true')", "ctypes"),
    ("import ctypes\nctypes.string_at(id(1), 8)", "ctypes"),
])
def test_processes_signals_and_limits_are_refused(how, what):
    r = run(how + "\n")
    assert (r.status, r.reason) == ("refused", f"refused: {what}"), r


def test_numpy_works_inside():
    pytest.importorskip("numpy")
    r = run("import numpy as np\nassert np.arange(4).sum() == 6\n")
    assert r.status == "passed", r


def test_a_refusal_caught_by_the_program_still_explains_its_failure():
    r = run("try:\n    import socket\n    socket.socket()\nexcept OSError:\n    pass\n"
            "assert False\n")
    assert (r.status, r.reason) == ("refused", "refused: socket")


def test_output_is_bounded():
    r = run("while True:\n    print('x' * 1000)\n", Limits(timeout_s=5, file_mb=1))
    assert (r.status, r.reason) == ("output", "output or file size limit (1 MB)")
    assert len(r.stdout) == Limits().max_output
    r = run("print('y' * 100_000)\n")
    assert r.status == "passed" and r.stdout == "y" * Limits().max_output


@pytest.mark.parametrize("how", ["import sys\nsys.exit(0)", "import os\nos._exit(0)",
                                 "raise SystemExit"])
def test_exiting_before_the_tests_ran_is_not_a_pass(how):
    r = run(how + "\nassert False, 'the tests'\n")
    assert r.status == "exit" and not r.passed
    assert r.reason.startswith("exited before the end"), r


def test_a_syntax_error_names_its_line():
    r = run("x = 1\ndef f(:\n")
    assert r.status == "error" and r.reason.startswith("SyntaxError at line 2")


def _children() -> set[int]:
    """The pids of this process's children that run in a sandbox directory."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and "tailrace-verify-" in cwd:
            out.add(int(pid))
    return out


def test_cancelling_a_run_kills_the_program():
    async def main():
        task = asyncio.ensure_future(run_program("import time\ntime.sleep(60)\n",
                                                 Limits(timeout_s=30)))
        for _ in range(100):
            await asyncio.sleep(0.05)
            running = _children()
            if running:
                break
        assert running, "the program never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return running

    t0 = time.monotonic()
    running = asyncio.run(main())
    assert time.monotonic() - t0 < 10
    assert not any(os.path.exists(f"/proc/{pid}") for pid in running)


def test_runs_share_the_loop_concurrently():
    async def main():
        return await asyncio.gather(*(run_program("import time\ntime.sleep(0.5)\n", FAST)
                                      for _ in range(4)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert [r.status for r in results] == ["passed"] * 4
    assert time.monotonic() - t0 < 1.9  # not 4 x 0.5 s one after another
