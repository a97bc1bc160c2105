"""Render a Plan as text, JSON-able dict, or a Mermaid flowchart."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..operators import qualname

FORMATS = ("text", "json", "mermaid")


def _param(name: str, v: Any) -> Any:
    if name in ("data", "target"):
        return None if v is None else f"<{type(v).__name__}>"
    if callable(v):
        return qualname(v)
    if isinstance(v, tuple):
        return list(v)
    return v


def plan_to_dict(plan: Any) -> dict[str, Any]:
    stages = []
    for s in plan.stages:
        ops = []
        for o in s.ops:
            params = {k: _param(k, v) for k, v in o.params.items()
                      if v is not None and not k.startswith("_")}
            ops.append({"id": o.id, "op": o.op.name, "state": o.op.state,
                        "params": params, "contract": asdict(o.contract)})
        stages.append({"id": s.id, "ops": ops, "upstream": list(s.upstream),
                       "replicas": s.replicas, "max_replicas": s.max_replicas or s.replicas,
                       "mode": s.mode, "queue": s.queue,
                       "execution": asdict(s.execution) if s.execution else None})
    edges = [{"from": e.src, "to": e.dst, "bound": e.bound} for e in plan.edges]
    return {"pipeline": plan.name, "fused": plan.fused, "stages": stages, "edges": edges}


def _text(plan: Any) -> str:
    n_ops = sum(len(s.ops) for s in plan.stages)
    lines = [f"plan '{plan.name}': {len(plan.stages)} stages from {n_ops} operators"
             f"{'' if plan.fused else ' (fusion off)'}"]
    for s in plan.stages:
        extra = [s.mode]
        if s.elastic:
            extra.append(f"replicas={s.replicas}..{s.max_replicas} (autoscaled on Ray)")
        elif s.replicas > 1:
            extra.append(f"replicas={s.replicas}")
        lines.append(f"  {s.id}  [{', '.join(extra)}]")
        if s.execution is not None:
            b = s.ops[0].contract.batch
            why = " (the engine batches: batch.max_wait_ms unused)" if b and b.max_wait_ms and \
                not s.execution.max_wait_ms else ""
            lines.append(f"    runs: {s.execution.describe()}{why}")
        for o in s.ops:
            params = ", ".join(f"{k}={_param(k, v)}" for k, v in o.params.items()
                               if v is not None and k not in ("data", "target")
                               and not k.startswith("_"))
            c = o.contract
            cs = [f"{k}={v}" for k, v in (("timeout_ms", c.timeout_ms), ("retries", c.retries),
                                          ("batch", c.batch)) if v]
            suffix = f" {' '.join(cs)}" if cs else ""
            lines.append(f"    - {o.id}: {o.op.name}({params}){suffix}")
        for u in s.upstream:
            lines.append(f"    <- {u}  (queue {s.queue})")
    return "\n".join(lines)


def _mermaid(plan: Any) -> str:
    def node(sid: str) -> str:
        return "n_" + "".join(c if c.isalnum() else "_" for c in sid)

    lines = ["flowchart LR"]
    for s in plan.stages:
        label = "<br/>".join(f"{o.id}: {o.op.name}" for o in s.ops)
        if s.elastic:
            label += f"<br/>x{s.replicas}..{s.max_replicas}"
        elif s.replicas > 1:
            label += f"<br/>x{s.replicas}"
        lines.append(f'  {node(s.id)}["{label}"]')
    for e in plan.edges:
        src, _, port = e.src.partition(".")
        tag = f"{port} / {e.bound}" if port else str(e.bound)
        lines.append(f"  {node(src)} -->|{tag}| {node(e.dst)}")
    return "\n".join(lines)


def render(plan: Any, fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps(plan_to_dict(plan), indent=2, default=str)
    if fmt == "mermaid":
        return _mermaid(plan)
    if fmt == "text":
        return _text(plan)
    raise ValueError(f"unknown plan format '{fmt}'; choose one of: {', '.join(FORMATS)}")
