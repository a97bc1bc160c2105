"""tailrace vs SAGE's public runtime (PyPI ``isage-kernel``), same pipeline, same records.

The shape is source -> map -> map -> map -> sink with no-op maps over the same N
integers, on each system's local (one-process) runtime:

- SAGE ``isage-kernel==0.2.5.3``, installed by this script into its own virtualenv
  (``~/.cache/tailrace-bench/sage-venv``; created with ``python -m venv`` and pip on the
  first run, reused afterwards), ``LocalEnvironment`` with ``from_batch`` -> ``map`` x3 ->
  ``sink``. SAGE sleeps 10 ms after every record its source emits (``TaskContext`` sets
  ``delay = 0.01`` and the task loop calls ``time.sleep(self.delay)`` after each spout
  packet); the measured runs remove it by wrapping ``TaskContext.__init__`` so that
  ``delay`` is 0 (the installed files are not edited; the script checks that the two
  source lines are where it expects them and stops otherwise). One run keeps the sleep,
  to show SAGE as shipped.
- tailrace, unfused (each operator its own stage, as SAGE runs each operator as its own
  task) and fused (the default).

Each run is a fresh process of its own. Both are timed the same way, inside the run:
from the moment the source hands out its first record to the moment the sink receives
the last, divided by N (so neither side's start-up, nor SAGE's 1 s completion poll in
``submit(autostop=True)``, is counted); the whole run call is printed beside it. Runs
alternate (SAGE, tailrace, SAGE, ...); median [min - max] over the repeats.

    python bench/vs_sage.py                 # N = 3,000, 5 repeats (~2 minutes after install)
    python bench/vs_sage.py --n 1000 --repeat 3 --no-shipped
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SAGE_PIN = "isage-kernel==0.2.5.3"
VENV = Path(os.environ.get("TAILRACE_BENCH_CACHE", Path.home() / ".cache" / "tailrace-bench")
            ) / "sage-venv"
#: Where SAGE keeps its per-record source sleep (package-relative path, expected line).
SLEEP_SITES = [("sage/kernel/runtime/context/task_context.py", "self.delay = 0.01"),
               ("sage/kernel/runtime/task/base_task.py", "time.sleep(self.delay)")]
HOW_REMOVED = ("TaskContext.__init__ (sage/kernel/runtime/context/task_context.py) sets "
               "delay = 0.01 and BaseTask._worker_loop (sage/kernel/runtime/task/base_task.py) "
               "calls time.sleep(self.delay) after every record a source emits; the measured "
               "SAGE runs wrap TaskContext.__init__ to set delay = 0.0 afterwards "
               "(monkeypatch in the run's process; the installed files are untouched)")


# -- the runs (each in a child process) -------------------------------------------------
def child_sage(n: int, no_sleep: bool) -> dict:
    """One SAGE run; returns its figures (runs inside the SAGE virtualenv)."""
    from sage.kernel.runtime.context.task_context import TaskContext

    patched: list[float] = []
    if no_sleep:
        original = TaskContext.__init__

        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            patched.append(self.delay)
            self.delay = 0.0

        TaskContext.__init__ = init  # type: ignore[method-assign]
    from sage.common.core.functions.sink_function import SinkFunction
    from sage.kernel.api.local_environment import LocalEnvironment

    stamps: dict[str, float] = {"n": 0}

    class Numbers:
        def __iter__(self):
            stamps["first"] = time.perf_counter()
            yield from range(n)

    class Sink(SinkFunction):
        def execute(self, data):
            stamps["n"] += 1
            stamps["last"] = time.perf_counter()

    env = LocalEnvironment("vs_sage")
    env.set_console_log_level("WARNING")
    env.from_batch(Numbers()).map(noop).map(noop).map(noop).sink(Sink)
    t0 = time.perf_counter()
    env.submit(autostop=True)
    wall = time.perf_counter() - t0
    return {"records": int(stamps["n"]), "us": (stamps["last"] - stamps["first"]) / n * 1e6,
            "wall_s": wall, "contexts_patched": len(patched),
            "delay_before_patch": sorted(set(patched))}


def child_tailrace(n: int, fuse: bool) -> dict:
    """One tailrace run (local runtime) timed like the SAGE one."""
    import tailrace as tr

    stamps: dict[str, float] = {"n": 0}

    class Numbers:
        def __iter__(self):
            stamps["first"] = time.perf_counter()
            yield from range(n)

    def sink(x):
        stamps["n"] += 1
        stamps["last"] = time.perf_counter()

    p = tr.Pipeline("vs_sage")
    p.source(Numbers()).map(noop).map(noop).map(noop).sink(sink)
    t0 = time.perf_counter()
    tr.run(p, fuse=fuse)
    wall = time.perf_counter() - t0
    return {"records": int(stamps["n"]), "us": (stamps["last"] - stamps["first"]) / n * 1e6,
            "wall_s": wall}


def noop(x):
    return x


# -- the driver ---------------------------------------------------------------------------
def sage_python() -> Path:
    return VENV / "bin" / "python"


def installed_version() -> str | None:
    """The isage-kernel version in the SAGE virtualenv, or None."""
    if not sage_python().exists():
        return None
    r = subprocess.run([str(sage_python()), "-c", "import importlib.metadata as m, sage.kernel;"
                        "print(m.version('isage-kernel'))"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def install() -> None:
    """Create the SAGE virtualenv and pip-install the pinned isage-kernel (progress shown)."""
    want = SAGE_PIN.split("==")[1]
    have = installed_version()
    if have == want:
        print(f"SAGE: {SAGE_PIN} already installed in {VENV}", flush=True)
        return
    if not sage_python().exists():
        print(f"SAGE: creating a virtualenv at {VENV}", flush=True)
        VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    log = VENV / "pip-install.log"
    print(f"SAGE: pip install {SAGE_PIN} into {VENV} (log: {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen([str(sage_python()), "-m", "pip", "install", "--progress-bar",
                                 "off", SAGE_PIN], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if line.startswith(("Collecting ", "Successfully installed")):
                print(f"  {line.strip()[:100]}", flush=True)
        rc = proc.wait()
    if rc != 0 or installed_version() != want:
        raise SystemExit(f"vs_sage: cannot install {SAGE_PIN} (pip exit status {rc}); see "
                         f"{log}. No SAGE figure can be measured here.")


def check_sleep_sites() -> None:
    """Stop unless SAGE's per-record sleep is where HOW_REMOVED says it is."""
    r = subprocess.run([str(sage_python()), "-c", "import sage.kernel, os; "
                        "print(os.path.dirname(os.path.dirname(sage.kernel.__file__)))"],
                       capture_output=True, text=True, check=True)
    root = Path(r.stdout.strip()).parent
    for rel, line in SLEEP_SITES:
        if line not in (root / rel).read_text():
            raise SystemExit(f"vs_sage: '{line}' not found in {root / rel}: this SAGE version "
                             "keeps its source sleep elsewhere; the script needs updating")


def launch(python: str, args: list[str], timeout: float) -> dict:
    """Run this file as a child (``--child ...``); its last stdout line is its JSON."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if python != sys.executable:  # SAGE's interpreter must not see this venv's packages
        env.pop("PYTHONPATH", None)
    here = Path(__file__).resolve()
    r = subprocess.run([python, str(here), "--child", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=here.parent)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = (r.stderr or r.stdout).strip().splitlines()[-8:]
        raise SystemExit(f"vs_sage: the {args[0]} run failed (exit status {r.returncode}):\n  "
                         + "\n  ".join(tail))
    return json.loads(lines[-1])


def spread(xs: list[float], digits: int) -> str:
    return (f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f} - "
            f"{max(xs):.{digits}f}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="records per run (both systems)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each configuration")
    ap.add_argument("--no-shipped", action="store_true",
                    help="skip the run of SAGE as shipped (with its 10 ms source sleep)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, n, flag = args.child[0], int(args.child[1]), args.child[2] == "1"
        out = child_sage(n, flag) if kind == "sage" else child_tailrace(n, flag)
        print(json.dumps(out))
        return 0
    try:
        install()
        check_sleep_sites()
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"vs_sage: cannot set up {SAGE_PIN} here: {e}. No SAGE figure can "
                         "be measured on this machine.") from None
    n = args.n
    timeout = 120 + n * 0.05  # SAGE as shipped takes ~11 ms a record
    print(f"vs_sage: source -> map -> map -> map -> sink, no-op maps, N={n:,} records, "
          f"{args.repeat} repeats, each run a fresh process; {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()} on {platform.machine()}")
    print(f"SAGE's 10 ms source sleep: {HOW_REMOVED}")
    print("per-record cost = (sink receives the last record - source hands out the first) "
          "/ N, the same clock on both sides; median [min - max] us")
    res: dict[str, list[dict]] = {"sage": [], "unfused": [], "fused": []}
    for r in range(args.repeat):
        s = launch(str(sage_python()), ["sage", str(n), "1"], timeout)
        if s["records"] != n or not s["contexts_patched"]:
            raise SystemExit(f"vs_sage: SAGE run {r}: {s['records']} of {n} records reached "
                             f"the sink, {s['contexts_patched']} task contexts patched")
        res["sage"].append(s)
        for key, fuse in (("unfused", "0"), ("fused", "1")):
            t = launch(sys.executable, ["tailrace", str(n), fuse], timeout)
            if t["records"] != n:
                raise SystemExit(f"vs_sage: tailrace run {r}: {t['records']} of {n} records")
            res[key].append(t)
        print(f"  repeat {r + 1}/{args.repeat}: SAGE {s['us']:.1f} us/record, tailrace "
              f"unfused {res['unfused'][-1]['us']:.3f}, fused {res['fused'][-1]['us']:.3f}",
              flush=True)
    rows = [("SAGE isage-kernel 0.2.5.3, source sleep removed", res["sage"], 1),
            ("tailrace, local runtime, unfused (4 channel hops)", res["unfused"], 3),
            ("tailrace, local runtime, fused (the default)", res["fused"], 3)]
    print(f"\n{'configuration':<52} {'us per record':>26} {'whole run s':>22}")
    for name, runs, d in rows:
        print(f"{name:<52} {spread([x['us'] for x in runs], d):>26} "
              f"{spread([x['wall_s'] for x in runs], 2):>22}")
    sage_us = statistics.median(x["us"] for x in res["sage"])
    for key in ("unfused", "fused"):
        print(f"SAGE / tailrace {key}, medians: "
              f"{sage_us / statistics.median(x['us'] for x in res[key]):,.0f}x")
    print("whole run: SAGE's includes its job start, stop and a completion poll every 1 s; "
          "tailrace's includes compiling and starting the run")
    if not args.no_shipped:
        s = launch(str(sage_python()), ["sage", str(n), "0"], timeout)
        print(f"SAGE as shipped (10 ms source sleep kept), one run: {s['us']:.1f} us/record "
              f"({s['records']} records)")
    print("what this shows: per-record runtime overhead on a no-op chain in one process, "
          "each run alone in a fresh process, the systems alternating; not model work, not "
          "distributed runs; on a shared machine the absolute figures are noisy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
