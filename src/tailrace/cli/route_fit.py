"""``tailrace route fit TRACE --out FILE``: fit an allocation policy on recorded outcomes.

A trace is JSONL: the output (and error) records of a budgeted ``route`` stage, whose
``route`` field (an error record's ``error.detail.route``) lists the calls it tried and
whether each answer passed
(docs/routing.md, "Fitting a policy"). Lines without one are counted and skipped; a
line that is not JSON is a one-line error naming it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import InputError, TailraceError
from ..operators.policy import fit, outcomes


def add_parser(sub: Any) -> None:
    r = sub.add_parser("route", help="allocation policies of budgeted route stages")
    verbs = r.add_subparsers(dest="verb", metavar="VERB", required=True)
    f = verbs.add_parser("fit", help="fit a policy on a trace of verified outcomes (JSONL)")
    f.add_argument("trace", help="JSONL of route output/error records (or - for stdin)")
    f.add_argument("--out", required=True, help="the policy file to write (JSON)")
    f.add_argument("--prompt-field", default="prompt",
                   help="the record field holding the prompt text (default: prompt)")
    f.add_argument("--route-field", default="route",
                   help="the field the route stage wrote its decision to (default: route)")
    f.add_argument("--engines", help="comma-separated engines to model (default: all seen)")
    f.add_argument("--epochs", type=int, default=30, help="passes over the trace (default 30)")
    f.add_argument("--embedder", metavar="MODEL",
                   help="also learn from the prompts' embeddings by this ONNX model (e.g. "
                        "minilm-l6-int8); the route stage then needs embedder: an engine of it")
    f.add_argument("--no-words", action="store_true",
                   help="do not use the prompts' words as features")
    f.add_argument("--debug", action="store_true", help="show tracebacks")
    from .route_train import add_parser as add_train

    add_train(verbs)


def read_trace(path: str, prompt_field: str, route_field: str) -> tuple[list, int]:
    """(the ``(prompt, tried)`` pairs of a trace file, lines skipped)."""
    import sys

    pairs, skipped = [], 0
    stream = sys.stdin if path == "-" else None
    try:
        f = stream or open(path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as e:
        raise InputError(f"{path}: cannot read the trace ({e.strerror})") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: not a JSON record ({e.msg})") from None
            if isinstance(rec, dict) and isinstance(rec.get("error"), dict):  # error record
                rec = {**(rec.get("input") or {}), **(rec["error"].get("detail") or {})}
            got = outcomes(rec, prompt_field, route_field) if isinstance(rec, dict) else None
            if got is None or not got[1]:
                skipped += 1
            else:
                pairs.append(got)
    return pairs, skipped


def route(args: argparse.Namespace) -> int:
    if args.verb == "train":
        from .route_train import train

        return train(args)
    pairs, skipped = read_trace(args.trace, args.prompt_field, args.route_field)
    if not pairs:
        raise TailraceError(f"{args.trace}: no line has a '{args.route_field}' field with "
                            f"tried calls and a '{args.prompt_field}' text ({skipped} lines "
                            "skipped); is it the output of a route stage with escalate:?")
    engines = [e.strip() for e in args.engines.split(",")] if args.engines else None
    embed = None
    if args.embedder:
        from ..engines import open_engine

        emb = open_engine({"backend": "onnx", "model": args.embedder})
        embed = emb.embed
    pol = fit(pairs, engines, epochs=args.epochs, words=not args.no_words, embed=embed,
              embedder=args.embedder)
    pol.save(args.out)
    calls = sum(len(t) for _, t in pairs)
    rates = ", ".join(f"{e} {sum(c['passed'] for _, t in pairs for c in t if c['engine'] == e)}"
                      f"/{pol.seen[e]}" for e in pol.engines)
    print(f"fit {args.out}: {len(pairs)} requests, {calls} calls ({rates} passed); "
          f"{skipped} lines skipped")
    return 0
