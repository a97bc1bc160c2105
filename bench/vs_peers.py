"""tailrace vs Haystack and LangGraph: one lone query, and one streaming run's throughput.

The same work on every side: a record ``{"x": i}`` goes through four steps that each hand
it on unchanged, then comes back to the caller.

- tailrace: ``source(fields=["x"])`` -> four no-op ``map``s -> ``sink()``, compiled as
  ``tailrace serve`` compiles it (fused by default). A lone query is
  ``await service.submit(record)`` on a started ``PipelineService`` from the caller's
  event loop, one at a time; the service runs on its own thread and loop
  (``start()``), and, where ``start(loop)`` exists (issue 12), also as tasks on the
  caller's loop, as `tailrace serve` now hosts it: both are measured, the latter is the
  headline figure.
- Haystack (``haystack-ai``): four ``@component``s returning their input, connected in a
  ``Pipeline``; a query is ``pipeline.run({"a": {"value": record}})``.
- LangGraph (``langgraph``): a ``StateGraph`` (TypedDict state ``{x: int}``) of four
  nodes returning the state unchanged, ``START -> a -> b -> c -> d -> END``; a query is
  ``graph.invoke(record)``.

Each query's answer is checked to be the record sent. Figures, per round: p50 and p99
of the per-query latency (``perf_counter`` around the call). Throughput: tailrace's
``tr.run`` of N records through the same pipeline, one streaming run (records/s of the
whole run, compile and start included), against the peers' per-query loops (queries/s
over one round), and the ratio. Rounds alternate tailrace / Haystack / LangGraph, each
side repeated; the table shows median [min - max] over the rounds.

The peers live in their own virtualenv, ``~/.cache/tailrace-peers/venv`` (or
``$TAILRACE_PEERS_DIR/venv``), created on first use with ``python -m venv`` and
``pip install haystack-ai langgraph`` (current releases; versions are printed); their
loops run in child processes of that venv's python (this file, ``--peer-worker``) that
answer in JSON. If the install fails, or with ``--no-peers``, the peers are skipped with
a message and tailrace's figures are still printed.

    python bench/vs_peers.py              # 5 rounds (~30 s once the peers are installed)
    python bench/vs_peers.py --quick      # 3 short rounds
    python bench/vs_peers.py --json out.json
    python bench/vs_peers.py --reinstall-peers   # fresh venv with the latest releases
    python bench/vs_peers.py --keep-cpus-awake   # diagnostic: see below

What a 2-core machine cannot show: every side runs one query at a time, so this is the
per-query floor of each framework's Python path, not throughput under concurrency.
Such a lone query (no other request waiting, nothing else ready on the caller's loop)
runs tailrace's fused stage on the caller's own stack both ways the service is started
(issue 23, docs/design.md "Lone-query latency"): on the caller's loop without a task
switch, and on its own thread by borrowing the idle run while the service's loop waits,
so it crosses no thread. Before that, the own-thread service crossed two threads per
query (caller loop -> service loop -> caller), whose wake-ups depend on the OS
scheduler of this small, shared VM: on an idle VM a wake-up of a thread whose vCPU has
halted cost ~200 us (450-510 us p50 idle vs 65 us with the other core busy, issue 23).
A query that finds the run busy still takes that path. ``--keep-cpus-awake`` runs a
busy loop (lowest priority, one process) for the whole run, to tell that wake-up cost
from the Python work.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PEER_PACKAGES = ("haystack-ai", "langgraph")
PEERS = ("haystack", "langgraph")
STEPS = ("a", "b", "c", "d")


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank); nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(lat_s: list[float], wall_s: float) -> dict:
    """p50/p99 in us and queries/s of one round of timed queries."""
    return {"n": len(lat_s), "p50_us": pct(lat_s, 0.5) * 1e6, "p99_us": pct(lat_s, 0.99) * 1e6,
            "mean_us": statistics.fmean(lat_s) * 1e6, "per_s": len(lat_s) / wall_s}


# -- the peers (child processes in the peers' venv; no tailrace import here) ----------------

def build_haystack() -> tuple[Any, str]:
    """Four identity components in a Haystack Pipeline; returns (query function, version)."""
    import importlib.metadata

    from haystack import Pipeline, component

    @component
    class Noop:
        @component.output_types(value=dict)
        def run(self, value: dict) -> dict:
            return {"value": value}

    pipe = Pipeline()
    for name in STEPS:
        pipe.add_component(name, Noop())
    for a, b in itertools.pairwise(STEPS):
        pipe.connect(f"{a}.value", f"{b}.value")
    run = pipe.run
    first, last = STEPS[0], STEPS[-1]

    def query(record: dict) -> dict:
        return run({first: {"value": record}})[last]["value"]

    return query, importlib.metadata.version("haystack-ai")


def build_langgraph() -> tuple[Any, str]:
    """Four identity nodes in a LangGraph StateGraph; returns (query function, version)."""
    import importlib.metadata
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        x: int

    def noop(state: State) -> State:
        return state

    g = StateGraph(State)
    for name in STEPS:
        g.add_node(name, noop)
    g.add_edge(START, STEPS[0])
    for a, b in itertools.pairwise(STEPS):
        g.add_edge(a, b)
    g.add_edge(STEPS[-1], END)
    return g.compile().invoke, importlib.metadata.version("langgraph")


def peer_worker(which: str) -> int:
    """Child mode: build one peer, then for each line ``N`` on stdin time N queries (after
    a short warm-up) and print one JSON line; ``quit`` or EOF ends."""
    query, version = {"haystack": build_haystack, "langgraph": build_langgraph}[which]()
    for i in range(200):  # warm-up: first-call caches, lazy imports
        assert query({"x": i}) == {"x": i}
    print(json.dumps({"ready": True, "version": version,
                      "python": sys.version.split()[0]}), flush=True)
    perf = time.perf_counter
    for line in sys.stdin:
        if line.strip() in ("", "quit"):
            break
        n = int(line)
        for i in range(50):
            query({"x": i})
        lat: list[float] = []
        append = lat.append
        t_start = perf()
        for i in range(n):
            record = {"x": i}
            t0 = perf()
            out = query(record)
            append(perf() - t0)
            if out != record:
                print(json.dumps({"error": f"{which} answered {out!r} for {record!r}"}),
                      flush=True)
                return 1
        print(json.dumps(summary(lat, perf() - t_start)), flush=True)
    return 0


class Peer:
    """A peer worker child process (started once, driven round by round)."""

    def __init__(self, python: Path, which: str) -> None:
        self.which = which
        env = {**os.environ, "HAYSTACK_TELEMETRY_ENABLED": "False",
               "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([str(python), __file__, "--peer-worker", which],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        hello = self._read()
        self.version = hello["version"]
        self.python = hello["python"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.which} worker exited (status {self.proc.wait()})")
        got = json.loads(line)
        if "error" in got:
            raise RuntimeError(got["error"])
        return got

    def round(self, n: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def peers_python(reinstall: bool) -> tuple[Path | None, str]:
    """The peers' venv python, creating the venv on first use; (None, why) if it cannot."""
    base = Path(os.environ.get("TAILRACE_PEERS_DIR",
                               Path.home() / ".cache" / "tailrace-peers")).expanduser()
    venv = base / "venv"
    python = venv / "bin" / "python"
    marker = venv / ".tailrace-peers-installed"
    if marker.exists() and python.exists() and not reinstall:
        return python, ""
    base.mkdir(parents=True, exist_ok=True)
    log = base / "install.log"
    print(f"vs_peers: installing {' '.join(PEER_PACKAGES)} into {venv} (first use; "
          f"log: {log}) ...", flush=True)
    with open(log, "w") as f:
        try:
            cmd = [sys.executable, "-m", "venv", "--clear", str(venv)]
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, timeout=300)
            cmd = [str(python), "-m", "pip", "install", "--upgrade", *PEER_PACKAGES]
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, timeout=1200)
        except (OSError, subprocess.SubprocessError) as e:
            what = (f"exit status {e.returncode}" if isinstance(e, subprocess.CalledProcessError)
                    else str(e))
            return None, (f"could not install {' '.join(PEER_PACKAGES)} into {venv} ({what}); "
                          f"see {log}")
    marker.write_text(" ".join(PEER_PACKAGES) + "\n")
    return python, ""


# -- tailrace --------------------------------------------------------------------------------

def noop(record: dict) -> dict:
    return record


def four_maps() -> Any:
    import tailrace as tr

    p = tr.Pipeline("four")
    s = p.source(fields=["x"])
    for name in STEPS:
        s = s.map(noop, id=name)
    s.sink()
    return p


def loop_hosting() -> bool:
    """True if ``PipelineService.start`` can host the run on the caller's loop
    (``start(loop)``, as `tailrace serve` does since the issue-12 work)."""
    import inspect

    from tailrace.serving import PipelineService

    return "loop" in inspect.signature(PipelineService.start).parameters


class TailraceLone:
    """A started ``PipelineService`` on the four maps; rounds of lone queries.

    on_loop: False: the service runs on its own thread and loop (``start()``); True: on
             the caller's loop (``start(loop)``, how `tailrace serve` hosts it now).
    """

    def __init__(self, on_loop: bool = False) -> None:
        import asyncio

        from tailrace.serving import PipelineService

        self.on_loop = on_loop
        self.loop = asyncio.new_event_loop()  # the caller's loop (uvicorn's, under serve)
        self.svc = PipelineService(four_maps())
        if on_loop:
            self.loop.run_until_complete(self._start_here())
        else:
            self.svc.start()
            if not self.svc.wait_ready(60):
                raise SystemExit(f"vs_peers: the service did not start: {self.svc.failure}")
        self.loop.run_until_complete(self._queries(200, timed=False))

    async def _start_here(self) -> None:
        import asyncio

        self.svc.start(asyncio.get_running_loop())
        deadline = time.monotonic() + 60
        while not self.svc.ready:
            if self.svc.failure is not None or time.monotonic() > deadline:
                raise SystemExit(f"vs_peers: the service did not start: {self.svc.failure}")
            await asyncio.sleep(0.01)

    async def _queries(self, n: int, timed: bool = True) -> dict:
        submit, perf = self.svc.submit, time.perf_counter
        lat: list[float] = []
        append = lat.append
        t_start = perf()
        for i in range(n):
            record = {"x": i}
            t0 = perf()
            out = await submit(record)
            append(perf() - t0)
            if out != record:
                raise SystemExit(f"vs_peers: tailrace answered {out!r} for {record!r}")
        return summary(lat, perf() - t_start) if timed else {}

    def round(self, n: int) -> dict:
        self.loop.run_until_complete(self._queries(50, timed=False))
        return self.loop.run_until_complete(self._queries(n))

    def close(self) -> None:
        if self.on_loop:
            self.loop.run_until_complete(self.svc.aclose())
        else:
            self.svc.stop()
        self.loop.close()


def tailrace_in_run(n: int) -> dict:
    """Context: lone records inside ONE ``tr.run`` (no service, no thread hop): the run's
    source yields a record and waits until the sink has it (as bench/overhead.py)."""
    import asyncio

    import tailrace as tr

    lat: list[float] = []
    arrived = asyncio.Event()

    async def feed():
        for i in range(n + 50):
            arrived.clear()
            t0 = time.perf_counter()
            yield {"x": i}
            await arrived.wait()
            if i >= 50:  # the first 50: warm-up
                lat.append(time.perf_counter() - t0)

    t_start = time.perf_counter()
    tr.run(four_maps(), input=feed(), output=lambda r: arrived.set())
    return summary(lat, time.perf_counter() - t_start)


def tailrace_stream(n: int) -> dict:
    """One streaming ``tr.run`` of n records through the four maps; records/s."""
    import tailrace as tr

    records = [{"x": i} for i in range(n)]
    out: list = []
    t0 = time.perf_counter()
    result = tr.run(four_maps(), input=records, output=out)
    wall = time.perf_counter() - t0
    if len(out) != n or result.errors or out[-1] != records[-1]:
        raise SystemExit(f"vs_peers: tr.run gave {len(out)} outputs of {n}, "
                         f"{len(result.errors)} errors")
    return {"n": n, "wall_s": wall, "per_s": n / wall}


# -- report ----------------------------------------------------------------------------------

def spread(rounds: list[dict], key: str, fmt: str = "{:.1f}") -> str:
    xs = [r[key] for r in rounds]
    return (f"{fmt.format(statistics.median(xs))} "
            f"[{fmt.format(min(xs))} - {fmt.format(max(xs))}]")


def med(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def report(res: dict) -> None:
    n, k = res["n_lone"], res["repeats"]
    print(f"\nvs_peers: four no-op steps, record {{'x': i}}; {k} rounds, alternating sides; "
          "median [min - max] over the rounds")
    print(f"tailrace {res['versions']['tailrace']} from {res['tailrace_from']}; "
          f"CPython {sys.version.split()[0]}; {os.cpu_count()} CPUs; load average "
          f"{res['load'][0]:.2f} before, {res['load'][1]:.2f} after"
          + ("; --keep-cpus-awake (a nice-19 busy loop ran meanwhile)"
             if res.get("keep_cpus_awake") else ""))
    print(f"\n1. lone query, one at a time ({n} timed queries a round, after a warm-up), us")
    print(f"   {'system':<68} {'p50 us':>22} {'p99 us':>24}")
    v = res["versions"]["tailrace"]
    head = "tailrace_on_loop" if "tailrace_on_loop" in res["lone"] else "tailrace"
    if head == "tailrace_on_loop":
        name = f"tailrace {v}: PipelineService.submit, service on the caller's loop"
        print(f"   {name:<68} {spread(res['lone'][head], 'p50_us'):>22} "
              f"{spread(res['lone'][head], 'p99_us'):>24}")
    rows = [("tailrace", f"tailrace {v}: PipelineService.submit, service on its own thread"),
            ("haystack", f"Haystack {res['versions'].get('haystack', '?')}: Pipeline.run"),
            ("langgraph", f"LangGraph {res['versions'].get('langgraph', '?')}: graph.invoke")]
    for key, name in rows:
        if key in res["lone"]:
            rs = res["lone"][key]
            print(f"   {name:<68} {spread(rs, 'p50_us'):>22} {spread(rs, 'p99_us'):>24}")
        else:
            print(f"   {name:<68} {'skipped':>22}")
    if res["skipped"]:
        print(f"   peers skipped: {res['skipped']}")
    rs = res["lone"]["tailrace_in_run"]
    print(f"   {'(context) tailrace: lone record inside one tr.run, no service':<68} "
          f"{spread(rs, 'p50_us'):>22} {spread(rs, 'p99_us'):>24}")
    tr50 = med(res["lone"][head], "p50_us")
    where = "the caller's loop" if head == "tailrace_on_loop" else "its own thread"
    target = 18 if head == "tailrace_on_loop" else 100
    print(f"   tailrace lone p50 {tr50:.1f} us, service on {where} (target <= {target} us; "
          f"on its own thread {med(res['lone']['tailrace'], 'p50_us'):.1f} us, target "
          "<= 100 us)", end="")
    for key in PEERS:
        if key in res["lone"]:
            print(f"; {med(res['lone'][key], 'p50_us') / tr50:.1f}x under {key}", end="")
    print(" (target: 10x under Haystack)")
    s = res["stream"]
    print(f"\n2. throughput, records/s: tailrace one streaming tr.run of {s[0]['n']:,} "
          "records (compile + start included) vs the peers' per-query loops")
    print(f"   {'system':<68} {'records/s':>24} {'stream / it':>12}")
    tr_s = med(s, "per_s")
    print(f"   {'tailrace: tr.run(pipeline, input=records, output=list)':<68} "
          f"{spread(s, 'per_s', '{:,.0f}'):>24}")
    print(f"   {'tailrace: PipelineService.submit, one at a time':<68} "
          f"{spread(res['lone'][head], 'per_s', '{:,.0f}'):>24} "
          f"{tr_s / med(res['lone'][head], 'per_s'):>11.0f}x")
    for key, name in rows[1:]:
        if key in res["lone"]:
            rs = res["lone"][key]
            print(f"   {name + ', one at a time':<68} {spread(rs, 'per_s', '{:,.0f}'):>24} "
                  f"{tr_s / med(rs, 'per_s'):>11.0f}x")
    print("   (target: a streaming run >= 100x the peers' per-query loops)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="rounds per side (default 5)")
    ap.add_argument("--n", type=int, default=2000, help="timed lone queries per round")
    ap.add_argument("--stream-n", type=int, default=1_000_000,
                    help="records in tailrace's streaming run")
    ap.add_argument("--quick", action="store_true", help="3 rounds, fewer records")
    ap.add_argument("--no-peers", action="store_true", help="tailrace only")
    ap.add_argument("--reinstall-peers", action="store_true",
                    help="recreate the peers' venv with the latest releases")
    ap.add_argument("--keep-cpus-awake", action="store_true",
                    help="run a nice-19 busy loop meanwhile (diagnostic: vCPU wake-up cost)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    ap.add_argument("--peer-worker", choices=PEERS, help=argparse.SUPPRESS)  # internal
    args = ap.parse_args()
    if args.peer_worker:
        return peer_worker(args.peer_worker)
    if args.quick:
        args.repeats, args.n, args.stream_n = 3, 1000, 200_000

    import tailrace

    res: dict[str, Any] = {"n_lone": args.n, "repeats": args.repeats, "skipped": "",
                           "versions": {"tailrace": tailrace.__version__},
                           "tailrace_from": str(Path(tailrace.__file__).parent),
                           "lone": {"tailrace": [], "tailrace_in_run": []}, "stream": []}
    peers: list[Peer] = []
    if args.no_peers:
        res["skipped"] = "--no-peers"
    else:
        python, why = peers_python(args.reinstall_peers)
        try:
            if python is not None:
                for which in PEERS:
                    peers.append(Peer(python, which))
                    res["versions"][which] = peers[-1].version
                    res["lone"][which] = []
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            why = f"a peer worker failed to start: {e}"
            for p in peers:
                p.close()
            peers = []
        if why:
            res["skipped"] = why
            for which in PEERS:
                res["lone"].pop(which, None)
            print(f"vs_peers: peers skipped: {why}", file=sys.stderr)
    load0 = os.getloadavg()[0]
    if loop_hosting():
        res["lone"]["tailrace_on_loop"] = []
    spinner = None
    if args.keep_cpus_awake:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                   preexec_fn=lambda: os.nice(19))
        res["keep_cpus_awake"] = True
    lone = TailraceLone()
    hosted = TailraceLone(on_loop=True) if "tailrace_on_loop" in res["lone"] else None
    try:
        for r in range(args.repeats):
            res["lone"]["tailrace"].append(lone.round(args.n))
            if hosted is not None:
                res["lone"]["tailrace_on_loop"].append(hosted.round(args.n))
            for p in peers:
                res["lone"][p.which].append(p.round(args.n))
            res["lone"]["tailrace_in_run"].append(tailrace_in_run(args.n))
            res["stream"].append(tailrace_stream(args.stream_n))
            print(f"vs_peers: round {r + 1}/{args.repeats}: tailrace p50 "
                  f"{res['lone']['tailrace'][-1]['p50_us']:.1f} us (own thread)"
                  + (f", {res['lone']['tailrace_on_loop'][-1]['p50_us']:.1f} us (caller's "
                     "loop)" if hosted is not None else "")
                  + "".join(f", {p.which} {res['lone'][p.which][-1]['p50_us']:.1f} us"
                            for p in peers)
                  + f"; stream {res['stream'][-1]['per_s']:,.0f} records/s", flush=True)
    finally:
        lone.close()
        if hosted is not None:
            hosted.close()
        for p in peers:
            p.close()
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    res["load"] = (load0, os.getloadavg()[0])
    report(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
