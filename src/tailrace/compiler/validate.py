"""Compile-time checks of a pipeline: operators, parameters, contracts, graph, fields.

Every failure is a ``PlanError`` naming the stage, its location and the likely fix.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..api.pipeline import CONTRACT_KEYS, Pipeline, StageSpec, did_you_mean, is_int, is_real
from ..errors import PlanError, TailraceError
from ..operators import OpDef, known_ops, lookup, resolve
from ..operators.registry import LinkContext


def _err(spec: StageSpec, msg: str) -> PlanError:
    return PlanError(msg, where=spec.where, stage=spec.id)


def check_op(spec: StageSpec) -> OpDef:
    try:
        return lookup(spec.op)
    except LookupError:
        raise _err(spec, f"unknown operator '{spec.op}'{did_you_mean(spec.op, known_ops())} "
                   f"(known: {', '.join(known_ops())}; or a dotted path to a "
                   "tailrace.Operator subclass)") from None
    except ValueError as e:
        raise _err(spec, f"operator '{spec.op}': {e}") from None


def check_params(spec: StageSpec, op: OpDef) -> dict[str, Any]:
    """Validate the stage's parameters; return them with defaults and fns resolved."""
    by_name = {p.name: p for p in op.params}
    out: dict[str, Any] = {}
    for k in spec.params:
        if k not in by_name:
            allowed = ", ".join(by_name) or "none"
            raise _err(spec, f"unknown parameter '{k}' for operator '{op.name}'"
                       f"{did_you_mean(k, list(by_name))} (its parameters: {allowed}; "
                       f"contract keys: {', '.join(CONTRACT_KEYS)})")
    for p in op.params:
        v = spec.params.get(p.name)
        if v is None:
            if p.required:
                raise _err(spec, f"operator '{op.name}' needs '{p.name}' ({p.doc or p.want})")
            out[p.name] = p.default
            continue
        if not (p.callable and callable(v)) and (
                not isinstance(v, p.types)
                or (isinstance(v, bool) and object not in p.types and bool not in p.types)):
            raise _err(spec, f"'{p.name}' must be {p.want or p.types[0].__name__}, got {v!r}")
        out[p.name] = v
        if p.check is not None and not p.check(v):
            raise _err(spec, f"'{p.name}' must be {p.want}, got {v!r}")
        if p.callable:
            try:
                out[p.name] = resolve(v)
            except ValueError as e:
                raise _err(spec, f"'{p.name}': {e}") from None
            if op.name in SYNC_ONLY and inspect.iscoroutinefunction(out[p.name]):
                raise _err(spec, f"'{p.name}' is an async function, but '{op.name}' calls it "
                           "synchronously (a coroutine would count as its answer); pass a "
                           "plain function, or do the async work in a map")
    return out


#: Operators that call their ``fn`` synchronously (only ``map`` awaits a coroutine).
SYNC_ONLY = frozenset({"filter", "flat_map", "key_by", "branch", "stateful"})


PLACEMENT_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "strategy", "where")
PLACEMENT_STRATEGIES = ("pack", "spread")
#: where a stage runs on Ray: in the driver's process or in a stage-host actor
PLACEMENT_WHERE = ("driver", "host")


def placement_problem(opts: Any) -> str | None:
    """What is wrong with a stage's placement options, or None if they are valid.

    opts: e.g. ``{"num_cpus": 1, "strategy": "spread"}``.
    """
    if not isinstance(opts, dict):
        return (f"placement options must be a mapping like {{num_cpus: 1, strategy: spread}}, "
                f"got {opts!r}")
    bad = sorted(set(opts) - set(PLACEMENT_KEYS))
    if bad:
        return (f"unknown placement option(s) {', '.join(map(str, bad))}; known: "
                f"{', '.join(PLACEMENT_KEYS)}")
    if opts.get("strategy", "pack") not in PLACEMENT_STRATEGIES:
        return (f"placement strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                f"got {opts['strategy']!r}")
    if opts.get("where", "host") not in PLACEMENT_WHERE:
        return (f"placement where must be one of {', '.join(PLACEMENT_WHERE)}, "
                f"got {opts['where']!r}")
    res = opts.get("resources") or {}
    if not isinstance(res, dict):
        return f"placement resources must be a mapping like {{accel: 1}}, got {res!r}"
    checks = [(k, opts.get(k, 0), False) for k in ("num_cpus", "num_gpus")]
    checks += [("memory", opts.get("memory", 0), True)]
    checks += [(f"resources.{k}", v, False) for k, v in res.items()]
    for key, v, integer in checks:
        if not (is_int(v) if integer else is_real(v)) or v < 0:
            want = "a non-negative integer (bytes)" if integer else "a non-negative number"
            return f"placement {key} must be {want}, got {v!r}"
    return None


def check_contract(spec: StageSpec, op: OpDef) -> None:
    c = spec.contract
    if not is_int(c.replicas) or c.replicas < 1:
        raise _err(spec, f"'replicas' must be a positive integer, got {c.replicas!r}")
    if c.max_replicas is not None and (not is_int(c.max_replicas)
                                       or c.max_replicas < c.replicas):
        raise _err(spec, f"'replicas.max' must be an integer >= 'replicas.min' "
                   f"({c.replicas}), got {c.max_replicas!r}")
    if not is_int(c.retries) or c.retries < 0:
        raise _err(spec, f"'retries' must be a non-negative integer, got {c.retries!r}")
    if c.timeout_ms is not None and (not is_real(c.timeout_ms) or c.timeout_ms <= 0):
        raise _err(spec, f"'timeout_ms' must be a positive number, got {c.timeout_ms!r}")
    if c.queue is not None and (not is_int(c.queue) or c.queue < 1):
        raise _err(spec, f"'queue' must be a positive integer (records), got {c.queue!r}")
    if not isinstance(c.blocking, bool):
        raise _err(spec, f"'blocking' must be true or false, got {c.blocking!r}")
    if c.batch is not None:
        if not op.batchable:
            raise _err(spec, f"operator '{op.name}' does not take a 'batch' contract; "
                       "use a 'batch' stage to group records")
        if not is_int(c.batch.max_size) or c.batch.max_size < 1:
            raise _err(spec, f"'batch.max_size' must be a positive integer, "
                       f"got {c.batch.max_size!r}")
        if not is_real(c.batch.max_wait_ms) or c.batch.max_wait_ms < 0:
            raise _err(spec, f"'batch.max_wait_ms' must be a non-negative number, "
                       f"got {c.batch.max_wait_ms!r}")
    if c.placement is not None:
        problem = placement_problem(c.placement)
        if problem:
            raise _err(spec, problem)
    most = max(c.replicas, c.max_replicas or 0)
    if most > 1 and op.state != "stateless":
        raise _err(spec, f"a {op.state}-state operator cannot have replicas (got "
                   f"{most}); its state lives in one replica — remove 'replicas'")
    if op.kind in ("source", "sink") and (most > 1 or c.retries or c.timeout_ms
                                          or c.batch):
        raise _err(spec, f"'{op.kind}' stages take no replicas, retries, timeout_ms or "
                   "batch; put that work in a stage before it")


def check_graph(p: Pipeline) -> list[str]:
    """Upstream references, dangling outputs and cycles; returns a topological order."""
    specs = {s.id: s for s in p.stages}
    consumers: dict[str, list[str]] = {sid: [] for sid in specs}
    for s in p.stages:
        if s.op == "source":
            if s.upstream:
                raise _err(s, "a source has no upstream stages")
            continue
        if not s.upstream:
            raise _err(s, "stage has no upstream; give it 'after: [stage_id]'")
        for ref in s.upstream:
            sid, _, port = ref.partition(".")
            if sid not in specs:
                raise _err(s, f"'after' names unknown stage '{sid}'{did_you_mean(sid, specs)}")
            if sid == s.id:
                raise _err(s, f"cycle: {s.id} -> {s.id}; a stage cannot consume itself")
            up = specs[sid]
            if up.op == "branch":
                if port not in ("true", "false"):
                    raise _err(s, f"'{sid}' is a branch; consume '{sid}.true' or "
                               f"'{sid}.false', not '{ref}'")
            elif port:
                raise _err(s, f"'{ref}': only branch stages have ports; use '{sid}'")
            if up.op == "sink":
                raise _err(s, f"'{sid}' is a sink and has no output to consume")
            consumers[sid].append(ref)
    if not any(s.op == "source" for s in p.stages):
        raise PlanError("the pipeline has no source; start it with p.source(...)",
                        where=p.source_file)
    order = _toposort(p, specs)
    for s in p.stages:
        refs = consumers[s.id]
        if s.op == "sink":
            continue
        ports: tuple[str | None, ...] = ("true", "false") if s.op == "branch" else (None,)
        for out_port in ports:
            wanted = s.id if out_port is None else f"{s.id}.{out_port}"
            if wanted not in refs:
                label = "" if out_port is None else f" '{out_port}'"
                raise _err(s, f"output{label} has no "
                           "consumer, so its records would be dropped; add a sink (or a "
                           "stage after it)")
    return order


def _toposort(p: Pipeline, specs: dict[str, StageSpec]) -> list[str]:
    indeg = {sid: 0 for sid in specs}
    down: dict[str, list[str]] = {sid: [] for sid in specs}
    for s in p.stages:
        for ref in set(r.partition(".")[0] for r in s.upstream):
            indeg[s.id] += 1
            down[ref].append(s.id)
    ready = [sid for sid in specs if indeg[sid] == 0]
    order: list[str] = []
    while ready:
        sid = ready.pop(0)
        order.append(sid)
        for d in down[sid]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    if len(order) < len(specs):
        stuck = [sid for sid in specs if sid not in order]
        cycle = _find_cycle(stuck, specs)
        raise _err(specs[cycle[0]], "cycle: " + " -> ".join(cycle) +
                   "; pipelines are acyclic — remove one of these 'after' links")
    return order


def _find_cycle(stuck: list[str], specs: dict[str, StageSpec]) -> list[str]:
    ups = {sid: [r.partition(".")[0] for r in specs[sid].upstream] for sid in stuck}
    path: list[str] = []
    node = stuck[0]
    while node not in path:
        path.append(node)
        node = next(u for u in ups[node] if u in ups)
    return list(reversed(path[path.index(node):] + [node]))


def check_fields(p: Pipeline, order: list[str], io: dict[str, tuple]) -> None:
    """Every field a stage reads must be written upstream or provided by the source."""
    specs = {s.id: s for s in p.stages}
    ancestors: dict[str, set[str]] = {}
    avail: dict[str, set[str] | None] = {}
    writers: dict[str, list[str]] = {}
    for sid, (_, writes) in io.items():
        for f in writes or ():
            writers.setdefault(f, []).append(sid)
    for sid in order:
        s = specs[sid]
        ups = [r.partition(".")[0] for r in s.upstream]
        anc = set(ups)
        for u in ups:
            anc |= ancestors[u]
        ancestors[sid] = anc
        reads, writes = io[sid]
        if s.op == "source":
            fields = s.params.get("fields")
            avail[sid] = set(fields) if fields is not None else None
            continue
        ins = [avail[u] for u in ups]
        known = None if any(a is None for a in ins) else set.intersection(*ins)  # type: ignore
        for f in reads or ():
            if known is not None and f in known:
                continue
            if known is None and any(w in anc for w in writers.get(f, [])):
                continue
            elsewhere = [w for w in writers.get(f, []) if w not in anc and w != sid]
            if elsewhere:
                raise _err(s, f"reads field '{f}' before it exists: it is written by stage "
                           f"'{elsewhere[0]}', which does not run before this one; put this "
                           f"stage after '{elsewhere[0]}'")
            if known is not None:
                have = ", ".join(sorted(known)) or "none"
                raise _err(s, f"reads unknown field '{f}'{did_you_mean(f, known)} (fields "
                           f"available here: {have})")
        avail[sid] = None if known is None or writes is None else known | set(writes)


def link_ops(p: Pipeline, ops: dict[str, Any], io: dict[str, tuple]) -> None:
    """Run each operator's compile-time ``prepare`` (engines, indexes) in place."""
    writers: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for sid, (_, writes) in io.items():
        for f in writes or ():
            writers.setdefault(f, []).append((sid, ops[sid].op.name, ops[sid].params))
    ctx = LinkContext(dict(p.engines), writers)
    for op in ops.values():
        if op.op.prepare is None:
            continue
        try:
            op.params.update(op.op.prepare(dict(op.params), ctx))
        except (ValueError, TailraceError) as e:
            raise _err(op.spec, str(e)) from None
