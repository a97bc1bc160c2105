"""Pipeline YAML v1 -> ``Pipeline``. Structural checks here; operator checks in the compiler.

The loader keeps the line of every stage so that errors point at ``file.yaml:LINE``.
A YAML pipeline reads dict records from an implicit ``source`` stage (bound at run
time to the input JSONL) and writes every terminal stage's records to an implicit
``sink`` stage.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from ..errors import PlanError
from .pipeline import (
    CONTRACT_KEYS,
    Contract,
    Pipeline,
    ServeSpec,
    StageSpec,
    did_you_mean,
    make_contract,
    make_serve,
)

TOP_KEYS = ("version", "pipeline", "description", "slo", "engines", "source", "serve",
            "stages")
STAGE_KEYS = ("id", "op", "after")
_ID_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


class _LineLoader(yaml.SafeLoader):
    """A safe loader whose mappings remember the line each one starts on."""


class _Map(dict):
    line: int = 0


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> _Map:
    m = _Map(loader.construct_mapping(node, deep=True))
    m.line = node.start_mark.line + 1
    return m


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_pipeline(path: str) -> Pipeline:
    """Read and structurally validate a pipeline YAML file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise PlanError("no such file; check the path", where=path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read file: {e}", where=path) from None
    return loads_pipeline(text, path)


def loads_pipeline(text: str, path: str = "<string>") -> Pipeline:
    """Parse YAML text into a ``Pipeline`` (``path`` is used in error messages)."""
    try:
        doc = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise PlanError(f"invalid YAML: {e.problem}", where=f"{path}{line}") from None
    except yaml.YAMLError as e:
        raise PlanError(f"invalid YAML: {e}", where=path) from None
    if not isinstance(doc, dict):
        raise PlanError("expected a mapping with 'version', 'pipeline' and 'stages' at the "
                        "top level", where=f"{path}:1")

    def at(node: Any) -> str:
        return f"{path}:{getattr(node, 'line', 1)}"

    for key in doc:
        if key not in TOP_KEYS:
            raise PlanError(f"unknown top-level key '{key}'{did_you_mean(key, TOP_KEYS)} "
                            f"(allowed: {', '.join(TOP_KEYS)})", where=at(doc))
    version = doc.get("version")
    if version != 1:
        raise PlanError(f"unsupported version {version!r}; this tailrace reads 'version: 1'",
                        where=at(doc))
    name = doc.get("pipeline")
    if not isinstance(name, str) or not name:
        raise PlanError("'pipeline' must name the pipeline (a non-empty string)", where=at(doc))
    slo = doc.get("slo")
    if slo is not None and not isinstance(slo, dict):
        raise PlanError("'slo' must be a mapping like {p99_ms: 3000, priority: interactive}",
                        where=at(doc))
    engines = doc.get("engines") or {}
    if not isinstance(engines, dict):
        raise PlanError("'engines' must be a mapping of name -> {backend: ..., model: ...}",
                        where=at(doc))
    description = doc.get("description")
    if description is not None and not isinstance(description, str):
        raise PlanError("'description' must be a sentence saying what the pipeline does",
                        where=at(doc))
    serve = _serve(doc.get("serve"), at(doc)) if "serve" in doc else None
    p = Pipeline(name, slo=dict(slo) if slo else None, engines=dict(engines), source_file=path,
                 serve=serve, description=description)

    source = doc.get("source") or {}
    if not isinstance(source, dict) or set(source) - {"fields"}:
        raise PlanError("'source' must be a mapping like {fields: [question]}", where=at(doc))
    fields = source.get("fields")
    if fields is not None and (not isinstance(fields, list)
                               or not all(isinstance(x, str) for x in fields)):
        raise PlanError("'source.fields' must be a list of field names", where=at(source))
    src_params: dict[str, Any] = {"data": None}
    if fields is not None:
        src_params["fields"] = tuple(fields)
    p.add_stage(StageSpec("source", "source", (), src_params, Contract(), at(source or doc)))

    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise PlanError("'stages' must be a non-empty list of stages", where=at(doc))
    prev = "source"
    for raw in stages:
        spec = _stage(raw, prev, at(raw) if isinstance(raw, dict) else f"{path}")
        p.add_stage(spec)
        prev = spec.id
    terminals = _terminals(p.stages)
    if terminals:  # none only when stages form a cycle, which the compiler reports
        p.add_stage(StageSpec("sink", "sink", tuple(terminals), {"target": None}, Contract(),
                              at(doc)))
    return p


def _serve(raw: Any, where: str) -> ServeSpec:
    """The ``serve:`` block; PlanError at its line (or its ``fields:``'s) if bad."""
    line = f"{where.rpartition(':')[0]}:{raw.line}" if isinstance(raw, _Map) else where
    try:
        return make_serve(raw)
    except ValueError as e:
        for key in ("fields", "deadline_ms"):  # a nested mapping: its own line
            inner = raw.get(key) if isinstance(raw, dict) else None
            if isinstance(inner, _Map) and f"serve.{key}" in str(e):
                line = f"{where.rpartition(':')[0]}:{inner.line}"
        raise PlanError(str(e), where=line) from None


def _terminals(specs: tuple[StageSpec, ...]) -> list[str]:
    """Stage outputs nobody consumes: they feed the implicit sink (nothing is dropped)."""
    used = {u for s in specs for u in s.upstream}
    consumed = {u.split(".")[0] for u in used}
    out: list[str] = []
    for s in specs:
        if s.op == "branch":
            out += [f"{s.id}.{port}" for port in ("true", "false") if f"{s.id}.{port}" not in used]
        elif s.id not in consumed and s.op != "source":
            out.append(s.id)
    return out


def _stage(raw: Any, prev: str, where: str) -> StageSpec:
    if not isinstance(raw, dict):
        raise PlanError(f"each stage must be a mapping with 'id' and 'op', got {raw!r}",
                        where=where)
    sid = raw.get("id")
    if not isinstance(sid, str) or not _ID_RE.match(sid):
        raise PlanError(f"stage needs an 'id' made of letters, digits, '_' or '-' "
                        f"(got {sid!r})", where=where)
    if sid in ("source", "sink"):
        raise PlanError(f"'{sid}' is reserved for the implicit {sid}; rename the stage",
                        where=where, stage=sid)
    op = raw.get("op")
    if not isinstance(op, str) or not op:
        raise PlanError("stage needs an 'op' (e.g. map, filter, generate)", where=where, stage=sid)
    after = raw.get("after", [prev])
    if isinstance(after, str):
        after = [after]
    if not isinstance(after, list) or not after or not all(isinstance(a, str) for a in after):
        raise PlanError("'after' must be a stage id or a list of stage ids", where=where, stage=sid)
    params = {k: v for k, v in raw.items() if k not in STAGE_KEYS and k not in CONTRACT_KEYS}
    contract_kw = {k: v for k, v in raw.items() if k in CONTRACT_KEYS}
    batch = contract_kw.get("batch")
    if batch is not None and (not isinstance(batch, dict) or "max_size" not in batch
                              or set(batch) - {"max_size", "max_wait_ms"}):
        raise PlanError(f"'batch' must be a mapping like {{max_size: 8, max_wait_ms: 5}}, got "
                        f"{batch!r}", where=where, stage=sid)
    try:
        contract = make_contract(contract_kw)
    except TypeError as e:
        raise PlanError(str(e), where=where, stage=sid) from None
    return StageSpec(sid, op, tuple(after), params, contract, where)
