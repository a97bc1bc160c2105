"""``tailrace profile PIPELINE.yaml --out P.json``: measure a pipeline's engines and
stages on the real engines and the local runtime, for ``tailrace simulate --profile``
(docs/profile.md; the measuring itself: ``tailrace.simulate.measure``).

The input records come from ``--input`` (JSONL); without it, a pipeline that takes
questions (``source: {fields: [question]}``, e.g. the bundled wiki-qa) gets the bundled
FanOutQA questions, and one with a ``sample.jsonl`` beside it gets that.
"""

from __future__ import annotations

import argparse
import os
import sys
from itertools import islice
from pathlib import Path
from typing import Any

from ..errors import InputError, RunInterrupted, TailraceError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure a pipeline's stages and engines for the "
                                       "capacity simulator (tailrace simulate)")
    p.add_argument("pipeline", help="pipeline YAML file")
    p.add_argument("--out", "-o", required=True, metavar="FILE",
                   help="the profile to write (JSON)")
    p.add_argument("--input", "-i", metavar="FILE.jsonl",
                   help="input records to run the stages on (default: the pipeline's "
                        "bundled sample, if it has an obvious one)")
    p.add_argument("--records", type=int, default=64,
                   help="input records to use (default 64)")
    p.add_argument("--repeat", type=int, default=2,
                   help="times each engine shape and each stage run is measured (default 2)")
    p.add_argument("--n-seq-max", type=int, metavar="N",
                   help="slots (sequences decoded at once) of an OpenAI-compatible server "
                        "(openai backend; default 8): not visible from the client")
    p.add_argument("--quick", action="store_true",
                   help="fewer engine shapes: a rough profile in seconds (tests, a try)")
    p.set_defaults(no_fuse=False)


def _n(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _check_out(path: str) -> None:
    """Fail before measuring when ``--out`` cannot be written."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise TailraceError(f"--out {path}: is a directory; give a file name like "
                            f"{os.path.join(path, 'profile.json')}")
    if not parent.is_dir():
        raise TailraceError(f"--out {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise TailraceError(f"--out {path}: cannot write there (permission denied)")


def read_records(path: str, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` records of a JSONL file; InputError naming a bad line."""
    from .jsonl import JsonlReader

    problems: list[Any] = []
    reader = JsonlReader(path, problems.append)
    records = list(islice(iter(reader), limit))
    if reader.problems:
        raise InputError(reader.problems[0])
    if not records:
        raise InputError(f"{path}: no records in it")
    return records


def default_records(plan: Any, path: str, limit: int) -> tuple[list[dict[str, Any]], str]:
    """The pipeline's obvious sample input, and what it is; TailraceError if none."""
    source = next((s for s in plan.stages if s.ops[0].op.kind == "source"), None)
    fields = list(source.ops[0].params.get("fields") or ()) if source is not None else []
    if fields == ["question"]:
        from ..stores.corpus import read_fanoutqa

        qs = read_fanoutqa(None, limit)
        return [{"question": q.question} for q in qs], \
            f"{_n(len(qs), 'FanOutQA dev question')} (bundled; --input to give your own)"
    sample = Path(path).resolve().with_name("sample.jsonl")
    if sample.is_file():
        recs = read_records(str(sample), limit)
        return recs, f"{_n(len(recs), 'record')} of {sample} (--input to give your own)"
    raise InputError(f"--input: give the records to profile pipeline '{plan.name}' with "
                     "(a JSONL file of its input records, like `tailrace run` reads); it "
                     "has no bundled sample")


def profile(args: argparse.Namespace) -> int:
    from ..runtime import run as run_plan
    from ..simulate.measure import Settings, format_report, profile_pipeline
    from .main import load_plan

    if args.records < 1 or args.repeat < 1:
        raise TailraceError("--records and --repeat must be at least 1")
    if args.n_seq_max is not None and args.n_seq_max < 1:
        raise TailraceError("--n-seq-max must be at least 1")
    if not Path(args.pipeline).is_file():
        raise InputError(f"{args.pipeline}: no such pipeline file")
    _check_out(args.out)
    plan = load_plan(args)
    if args.input:
        records = read_records(args.input, args.records)
        source = f"{_n(len(records), 'record')} of {args.input}"
    else:
        records, source = default_records(plan, args.pipeline, args.records)
    print(f"profiling '{plan.name}' on {source}", file=sys.stderr)

    def run(p: Any, recs: list) -> Any:  # outputs and error records kept in the result
        return run_plan(p, input=recs)

    settings = Settings(records=args.records, repeat=args.repeat, n_seq_max=args.n_seq_max,
                        quick=args.quick)
    try:
        report = profile_pipeline(plan, records, run, settings, source, sys.stderr)
    except (RunInterrupted, KeyboardInterrupt):
        print("tailrace: interrupted; no profile written", file=sys.stderr)
        return 130
    try:
        report.profile.save(args.out)
    except OSError as e:
        raise TailraceError(f"--out {args.out}: cannot write the profile ({e.strerror})") \
            from None
    print(format_report(report))
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0
