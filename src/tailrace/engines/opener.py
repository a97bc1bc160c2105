"""Opening engines by spec: checked at compile time, created once per process and shared.

``check_spec`` validates an ``engines:`` spec without loading anything (unknown backend
or model, missing package: one line with the fix); ``open_engine`` creates the engine on
first use and shares it in the process. A spec with ``replicas: N`` or ``endpoints:
[URL, ...]`` names an engine pool (``pool.EnginePool``), one per engine name; one with
``cluster:`` is opened by the Ray runtime only. Operators reach ``open_engine`` through
their ``BuildContext`` (docs/architecture.md), never directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import EngineError
from ..registry import Registry
from . import price as provider
from .cluster import check_cluster
from .models import backend, create_engine, model_info, model_path
from .pool import check_options, close_pools, get_pool, pool_statistics

#: spec keys that configure an engine pool (``tailrace.engines.pool.EnginePool`` arguments)
POOL_KEYS = ("replicas", "endpoints", "dispatch", "max_batch_size", "max_wait_ms",
             "max_batch_tokens", "max_retries", "health_timeout_s", "max_in_flight",
             "isolation", "max_restarts", "affinity_slack")


def is_pool(spec: Any) -> bool:
    """Does ``spec`` describe a pool of replicas (``replicas:`` or ``endpoints:``)?"""
    return isinstance(spec, dict) and ("replicas" in spec or "endpoints" in spec)


def split_pool(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine spec each replica opens, the pool's options) of a pool spec."""
    base = {k: v for k, v in spec.items() if k not in POOL_KEYS and k not in provider.KEYS
            and not k.startswith("_")}
    options = {k: spec[k] for k in POOL_KEYS if k in spec}
    if "endpoints" in options:
        options["endpoints"] = list(options["endpoints"])
    return base, options


def _check_pool(name: str, spec: dict[str, Any], kind: str) -> None:
    replicas, endpoints = spec.get("replicas"), spec.get("endpoints")
    if replicas is not None and endpoints is not None:
        raise EngineError(f"engine '{name}': give either replicas: N (embedded engines) or "
                          "endpoints: [URL, ...] (remote servers), not both")
    if replicas is not None and (type(replicas) is not int or replicas < 1):
        raise EngineError(f"engine '{name}': replicas must be a positive integer (engine "
                          f"processes in its pool), got {replicas!r}")
    if endpoints is not None and (not isinstance(endpoints, list) or not endpoints or
                                  not all(isinstance(e, str) and e for e in endpoints)):
        raise EngineError(f"engine '{name}': endpoints must be a non-empty list of base URLs "
                          f"like [http://127.0.0.1:8001/v1], got {endpoints!r}")
    base, options = split_pool(spec)
    if endpoints is not None:
        base = {**base, "base_url": endpoints[0]}
    check_spec(name, base, kind)
    check_options(name, base, options)


def check_spec(name: str, spec: Any, kind: str) -> None:
    """Validate an engine spec without loading it; EngineError says what to fix."""
    if not isinstance(spec, dict):
        raise EngineError(f"engine '{name}' must be a mapping like "
                          "{backend: llama_cpp, model: smollm2-135m-instruct}")
    provider.check(name, spec, kind)
    spec = provider.strip(spec)
    if "cluster" in spec:
        check_cluster(name, spec["cluster"])
        stray = [k for k in POOL_KEYS if k in spec]
        if stray:
            raise EngineError(f"engine '{name}': {', '.join(stray)} configure a pool in one "
                              "process; with cluster: give its replicas there, like "
                              "cluster: {replicas: 2}")
        check_spec(name, {k: v for k, v in spec.items() if k != "cluster"}, kind)
        return
    if is_pool(spec):
        _check_pool(name, spec, kind)
        return
    stray = [k for k in POOL_KEYS if k in spec]
    if stray:
        raise EngineError(f"engine '{name}': {', '.join(stray)} configure an engine pool; add "
                          "replicas: N (or endpoints: [URL, ...]) to make it one")
    backend_name = spec.get("backend")
    kinds = backend(backend_name, f"engine '{name}'")[2]
    if kind not in kinds:
        raise EngineError(f"engine '{name}' (backend '{backend_name}') cannot {kind}; it serves: "
                          f"{', '.join(kinds)}")
    if backend_name == "collab":
        from .collab import check_spec as check_collab

        check_collab(name, spec)
        return
    if backend_name == "openai":
        if not spec.get("base_url") or not spec.get("model"):
            raise EngineError(f"engine '{name}': the openai backend needs 'base_url' and "
                              "'model'")
        return
    if spec.get("path"):
        if not Path(spec["path"]).exists():
            raise EngineError(f"engine '{name}': model file not found: {spec['path']}")
        return
    model_path(model_info(spec.get("model", ""), str(backend_name)), assemble=False)


_ENGINES: Registry[Any] = Registry("engines")


def open_engine(spec: dict[str, Any], name: str | None = None) -> Any:
    """The engine for ``spec``, created once per process and shared; a pool spec
    (``replicas``/``endpoints``) opens the shared, started pool of the engine's ``name``
    instead (default: the spec's ``_name``, which stages' linking sets)."""
    if "cluster" in spec:
        raise EngineError(f"engine '{name or spec.get('_name') or 'engine'}': cluster: places "
                          "its replicas on a Ray cluster; run with --runtime ray (runtime="
                          "\"ray\"), or remove cluster: to open it in this process")
    if is_pool(spec):
        base, options = split_pool(spec)
        return get_pool(name or spec.get("_name") or "engine", base, **options)
    spec = {k: v for k, v in spec.items() if not k.startswith("_") and k not in provider.KEYS}
    return _ENGINES.get(json.dumps(spec, sort_keys=True, default=str), lambda: create_engine(spec))


def statistics() -> dict[str, Any]:
    """``statistics()`` of every engine pool and every shared engine that keeps statistics
    in this process, by name; may be empty."""
    out: dict[str, Any] = {}
    for key, eng in _ENGINES.items():
        if callable(getattr(eng, "statistics", None)):
            out[str(getattr(eng, "name", None) or getattr(eng, "model", key))] = eng.statistics()
    out.update(pool_statistics())
    return out


def close_all() -> None:
    """Close every cached engine and engine pool (tests, shutdown)."""
    _ENGINES.close_all()
    close_pools()
