"""The ``tailrace`` command line: run, plan, demo, ingest, eval, serve, route fit, profile.

Bad input (unreadable file, invalid YAML, unknown operator, cycle, bad JSONL line)
prints one line naming the file:line or stage and the fix, and exits with status 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import asdict
from typing import Any

from .. import __version__
from ..api.pipeline import Pipeline
from ..api.records import ErrorRecord
from ..compiler import FORMATS, compile_pipeline
from ..errors import PlanError, RunInterrupted, TailraceError
from ..observability import format_stats
from ..runtime import run as run_plan

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tailrace",
        description="Run LLM inference pipelines as compiled dataflows under tail-latency SLOs.")
    ap.add_argument("--version", action="version", version=f"tailrace {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser("run", help="run a pipeline: JSONL in, JSONL out, stats on stderr")
    r.add_argument("pipeline", help="pipeline YAML file")
    r.add_argument("--input", "-i", default="-", help="input JSONL file (default: stdin)")
    r.add_argument("--output", "-o", default="-", help="output JSONL file (default: stdout)")
    r.add_argument("--metrics-json", metavar="FILE", help="write the run's stats as JSON")
    r.add_argument("--trace-out", metavar="FILE",
                   help="write a request trace: one JSON line per input record as it ends "
                        "(arrival, tokens, latency, outcome; docs/cli.md)")
    r.add_argument("--runtime", default="local", choices=["local", "ray"],
                   help="executor: local (one process) or ray (stage replicas as Ray actors)")
    r.add_argument("--address", metavar="ADDR",
                   help="with --runtime ray: the cluster (HOST:PORT, ray://HOST:PORT or auto; "
                        "default: start a local Ray)")
    r.add_argument("--admission", choices=["simultaneous", "fcfs", "slo"],
                   help="admission policy at the door (uses the pipeline's slo:)")
    r.add_argument("--max-in-flight", type=int, default=8,
                   help="records admitted at once by fcfs/slo (default 8)")
    r.add_argument("--no-fuse", action="store_true", help="run every operator as its own stage")
    r.add_argument("--quiet", "-q", action="store_true", help="no stats table on stderr")

    pl = sub.add_parser("plan", help="print the compiled plan without running it")
    pl.add_argument("pipeline", help="pipeline YAML file")
    pl.add_argument("--format", "-f", default="text", choices=FORMATS)
    pl.add_argument("--no-fuse", action="store_true", help="show the plan without fusion")

    d = sub.add_parser("demo", help="RAG over Wikipedia end to end: index, answers, stats")
    d.add_argument("--limit", type=int, help="index only the first N documents (quick try)")

    g = sub.add_parser("ingest", help="build a vector index over your files (or the bundled "
                                      "corpus)")
    g.add_argument("paths", nargs="*", metavar="PATH",
                   help="files and folders (recursive) of .txt .md .html .pdf .jsonl .json "
                        ".csv (default: the bundled Wikipedia corpus)")
    g.add_argument("--index", help="index name or directory (default: wiki; required with PATH)")
    g.add_argument("--embedder", default="minilm-l6-int8",
                   help="embedding model: minilm-l6-int8 | minilm-l3")
    g.add_argument("--kind", default="flat", choices=["flat", "hnsw"], help="faiss index type")
    g.add_argument("--corpus", help="corpus file (default: the bundled Wikipedia summaries)")
    g.add_argument("--limit", type=int, help="index only the first N documents")
    g.add_argument("--include", action="append", metavar="GLOB",
                   help="only files matching GLOB (path or name; repeatable)")
    g.add_argument("--exclude", action="append", metavar="GLOB",
                   help="skip files matching GLOB (path or name; repeatable)")
    g.add_argument("--text-columns", metavar="A,B",
                   help="CSV/JSONL fields holding the text (default: text)")
    g.add_argument("--metadata-columns", metavar="C,D",
                   help="CSV/JSONL fields kept as metadata (default: all other fields)")
    g.add_argument("--chunk-tokens", type=int, default=200,
                   help="tokens per chunk, measured with the embedder's tokenizer (default 200)")
    g.add_argument("--overlap", type=int, default=32,
                   help="tokens repeated from the previous chunk (default 32)")
    g.add_argument("--runtime", default="local", choices=["local", "ray"],
                   help="run the ingest pipeline locally or on Ray")
    g.add_argument("--plan", action="store_true",
                   help="print the ingest pipeline's plan and run nothing")
    g.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    g.add_argument("--quiet", "-q", action="store_true", help="only the summary line")

    e = sub.add_parser("eval", help="retrieval recall/MRR and answer accuracy on FanOutQA")
    e.add_argument("pipeline", nargs="?", help="pipeline YAML (default: the demo's, "
                   "wiki-qa-escalate: each strategy's accuracy and spend)")
    e.add_argument("--k", type=int, default=10, help="retrieval depth for recall/MRR")
    e.add_argument("--limit", type=int, help="evaluate only the first N questions")
    e.add_argument("--retrieval-only", action="store_true", help="skip answer generation")
    e.add_argument("--mode", choices=["dense", "sparse", "hybrid", "all"],
                   help="retrieve mode(s) to measure (default: the pipeline's; all: each)")
    e.add_argument("--fusion", metavar="K=V,...",
                   help="hybrid fusion, e.g. k=60,dense=1,sparse=0.5,candidates=50")
    e.add_argument("--llm", help="override the generation model (e.g. gemma3-270m)")
    e.add_argument("--json", metavar="FILE", help="also write the report as JSON")

    from .profile import add_parser as add_profile
    from .route_fit import add_parser as add_route
    from .serve import add_parser as add_serve
    from .simulate import add_parser as add_simulate

    add_serve(sub)
    add_simulate(sub)
    add_profile(sub)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="show tracebacks")
    add_route(sub)  # its --debug is on its verbs
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help(sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.command == "serve":
            from .serve import serve

            return serve(args)
        if args.command == "simulate":
            from .simulate import simulate

            return simulate(args)
        if args.command == "route":
            from .route_fit import route

            return route(args)
        if args.command == "profile":
            from .profile import profile

            return profile(args)
        if args.command == "demo":
            from .demo import demo

            return demo(limit=args.limit)
        return {"run": _run, "plan": _plan, "ingest": _ingest, "eval": _eval}[args.command](args)
    except TailraceError as e:
        if args.debug:
            traceback.print_exc()
        print(f"tailrace: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # e.g. `tailrace run ... | head`
        return 0


def load_plan(args: argparse.Namespace) -> Any:
    """Compile the pipeline file ``args.pipeline`` (fused unless ``args.no_fuse``); dotted
    paths resolve from the current directory and the file's own directory, as ``python -m``
    would."""
    for d in (os.path.dirname(os.path.abspath(args.pipeline)), os.getcwd()):
        if d not in sys.path:
            sys.path.insert(0, d)
    return compile_pipeline(Pipeline.from_yaml(args.pipeline), fuse=not args.no_fuse)


def _columns(raw: str | None, opt: str) -> tuple[str, ...] | None:
    if raw is None:
        return None
    names = tuple(c.strip() for c in raw.split(","))
    if not all(names):
        raise TailraceError(f"{opt}: give comma-separated column names like a,b, got {raw!r}")
    return names


def _ingest(args: argparse.Namespace) -> int:
    from .ingest import ingest

    if not args.paths:
        file_opts = [o for o, v in (("--include", args.include), ("--exclude", args.exclude),
                                    ("--text-columns", args.text_columns),
                                    ("--metadata-columns", args.metadata_columns),
                                    ("--plan", args.plan or None)) if v]
        if file_opts or args.runtime != "local":
            raise TailraceError(f"{file_opts[0] if file_opts else '--runtime'} applies to "
                                "files: give PATH... (files or folders to ingest)")
        ingest(index=args.index or "wiki", embedder=args.embedder, kind=args.kind,
               corpus=args.corpus, limit=args.limit, force=args.force, quiet=args.quiet)
        return 0
    from ..stores.loaders import Columns
    from .ingest_files import ingest_files

    if args.corpus or args.limit:
        raise TailraceError(f"{'--corpus' if args.corpus else '--limit'} applies to the "
                            "bundled corpus; with PATH... every file found is ingested")
    if not args.index and not args.plan:
        raise TailraceError("--index: name the index for your files (e.g. --index my-docs); "
                            "the default 'wiki' holds the bundled corpus")
    columns = Columns(_columns(args.text_columns, "--text-columns") or (),
                      _columns(args.metadata_columns, "--metadata-columns"))
    res = ingest_files(args.paths, index=args.index or "plan", embedder=args.embedder,
                       kind=args.kind, include=args.include, exclude=args.exclude,
                       columns=columns, chunk_tokens=args.chunk_tokens, overlap=args.overlap,
                       runtime=args.runtime, force=args.force, quiet=args.quiet,
                       plan_only=args.plan, stream=sys.stderr)
    if isinstance(res, str):
        print(res)
        return 0
    return 1 if res.errors else 0


def _eval(args: argparse.Namespace) -> int:
    from importlib import resources

    from .evaluate import evaluate, format_report

    path = args.pipeline
    if path is None:
        from .demo import PIPELINE

        with resources.as_file(resources.files("tailrace.demo") / PIPELINE) as p:
            path = str(p)
    modes = (("dense", "sparse", "hybrid") if args.mode == "all" else
             (args.mode,) if args.mode else None)
    report = evaluate(path, k=args.k, limit=args.limit, answers=not args.retrieval_only,
                      llm_model=args.llm, modes=modes, fusion=_fusion_arg(args.fusion))
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(report), f, indent=2)
    return 0


def _fusion_arg(text: str | None) -> dict | None:
    """``--fusion k=60,dense=1,sparse=0.5`` as a mapping (numbers parsed); PlanError if
    malformed (the keys and values are checked by the evaluation)."""
    if text is None:
        return None
    out: dict[str, float | int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[key.strip()] = int(value) if value.strip().isdigit() else float(value)
        except ValueError:
            raise PlanError(f"--fusion: '{part}' is not KEY=NUMBER; give e.g. "
                            "k=60,dense=1,sparse=0.5") from None
    return out


def _plan(args: argparse.Namespace) -> int:
    print(load_plan(args).render(args.format))
    return 0


def _run(args: argparse.Namespace) -> int:
    from .jsonl import JsonlReader, JsonlWriter

    if args.address and args.runtime != "ray":
        raise TailraceError("--address names a Ray cluster: add --runtime ray")
    if args.trace_out and args.runtime == "ray":
        raise TailraceError("--trace-out is not available with --runtime ray (records a "
                            "stage drops are not reported to the driver); run with "
                            "--runtime local to record a trace")
    plan = load_plan(args)
    writer = JsonlWriter(args.output)
    reader = JsonlReader(args.input, writer.write_error)
    n_errors = 0

    def on_error(err: ErrorRecord) -> None:
        nonlocal n_errors
        n_errors += 1
        writer.write_error(err)

    interrupted = False
    gate = None
    if args.admission:
        from .serve import build_gate

        gate = build_gate(args.admission, [plan], args.max_in_flight)
    trace = None
    if args.trace_out:  # the trace's zero: the run's start
        from ..runtime.trace_out import TraceWriter

        try:
            trace = TraceWriter.open(args.trace_out)
        except TailraceError:
            writer.close()
            raise
    try:
        result: Any = run_plan(plan, input=reader, output=writer.write, errors=on_error,
                               runtime=args.runtime, admission=gate,
                               trace=trace,
                               **({"address": args.address} if args.address else {}))
    except RunInterrupted as e:
        interrupted = True
        result = e.result
    finally:
        writer.close()
        if trace is not None:
            trace.close()
    if args.metrics_json:
        with open(args.metrics_json, "w", encoding="utf-8") as f:
            json.dump(result.stats.to_dict(), f, indent=2)
    if not args.quiet:
        print(format_stats(result.stats), file=sys.stderr)
        if getattr(result.stats, "actor_restarts", 0):
            print(f"ray: {result.stats.actor_restarts} actor restart(s); replayed records "
                  "were de-duplicated", file=sys.stderr)
        if n_errors:
            print(f"{n_errors} record(s) failed; their error records are in the output",
                  file=sys.stderr)
    if interrupted:
        print("tailrace: interrupted; output so far was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    if reader.problems:
        for line in reader.problems[:5]:
            print(f"tailrace: error: {line}", file=sys.stderr)
        if len(reader.problems) > 5:
            print(f"tailrace: error: ... and {len(reader.problems) - 5} more bad input lines",
                  file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
