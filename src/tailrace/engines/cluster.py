"""The ``cluster:`` key of an engine spec: replicas of one engine spread over a Ray cluster.

Each replica holds one engine (the spec without ``cluster:``); the Ray runtime serves
them as one Ray Serve deployment (``tailrace.runtime.ray.engine_serve``; the keys:
docs/ray.md, "Engine replicas across the cluster"). This module only checks the
mapping, at compile time and without Ray: the local runtime refuses such a spec when it
opens it (``opener.open_engine``), since it has no cluster to place on.
"""

from __future__ import annotations

from typing import Any

from ..api.pipeline import is_int
from ..errors import EngineError

#: how many replicas: a fixed count, or bounds Serve's autoscaler keeps the count within
COUNT_KEYS = ("replicas", "min_replicas", "max_replicas")
#: how the autoscaler reacts (only with ``min_replicas``/``max_replicas``)
AUTOSCALING_KEYS = ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s",
                    "look_back_period_s")
#: what each replica reserves on its node (Ray actor options)
PLACEMENT_KEYS = ("num_cpus", "num_gpus", "memory", "resources")
CLUSTER_KEYS = COUNT_KEYS + AUTOSCALING_KEYS + PLACEMENT_KEYS + ("max_ongoing_requests",)

#: requests in flight per replica the autoscaler aims for (above Serve's 2: an engine that
#: batches serves several at once at little cost each)
TARGET_ONGOING_REQUESTS = 4.0
#: requests one replica takes at once (the rest wait in Serve's router for a free one);
#: the same as an engine actor's concurrency
MAX_ONGOING_REQUESTS = 64
#: CPUs a replica reserves unless ``num_cpus`` says (Serve's default)
NUM_CPUS = 1.0


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_cluster(name: str, cluster: Any) -> None:
    """Validate engine ``name``'s ``cluster:`` mapping; EngineError names the key."""
    where = f"engine '{name}': cluster"
    if not isinstance(cluster, dict):
        raise EngineError(f"{where} must be a mapping like {{replicas: 2, num_cpus: 1}} or "
                          f"{{min_replicas: 1, max_replicas: 4}}, got {cluster!r}")
    unknown = sorted(str(k) for k in cluster if k not in CLUSTER_KEYS)
    if unknown:
        raise EngineError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(CLUSTER_KEYS)}")
    for key in ("replicas", "min_replicas", "max_replicas", "max_ongoing_requests"):
        v = cluster.get(key)
        if v is not None and (not is_int(v) or v < 1):
            raise EngineError(f"{where}.{key} must be a positive integer, got {v!r}")
    bounds = [k for k in ("min_replicas", "max_replicas") if k in cluster]
    if "replicas" in cluster and bounds:
        raise EngineError(f"{where}: give replicas: N (a fixed count) or min_replicas and "
                          "max_replicas (autoscaled), not both")
    if len(bounds) == 1:
        missing = ({"min_replicas", "max_replicas"} - set(bounds)).pop()
        raise EngineError(f"{where}: {bounds[0]} needs {missing} too (the autoscaler's "
                          "bounds)")
    if bounds and cluster["min_replicas"] > cluster["max_replicas"]:
        raise EngineError(f"{where}.min_replicas ({cluster['min_replicas']}) must not exceed "
                          f"max_replicas ({cluster['max_replicas']})")
    scaling = [k for k in AUTOSCALING_KEYS if k in cluster]
    if scaling and not bounds:
        raise EngineError(f"{where}: {', '.join(scaling)} tune autoscaling; give "
                          "min_replicas and max_replicas to make it autoscale")
    for key in ("target_ongoing_requests", "look_back_period_s"):
        v = cluster.get(key)
        if v is not None and (not _is_num(v) or v <= 0):
            raise EngineError(f"{where}.{key} must be a positive number, got {v!r}")
    for key in ("upscale_delay_s", "downscale_delay_s", "num_cpus", "num_gpus"):
        v = cluster.get(key)
        if v is not None and (not _is_num(v) or v < 0):
            raise EngineError(f"{where}.{key} must be a non-negative number, got {v!r}")
    memory = cluster.get("memory")
    if memory is not None and (not is_int(memory) or memory < 0):
        raise EngineError(f"{where}.memory must be a non-negative integer (bytes), got "
                          f"{memory!r}")
    res = cluster.get("resources")
    if res is not None:
        if not isinstance(res, dict):
            raise EngineError(f"{where}.resources must be a mapping like {{accel: 1}}, got "
                              f"{res!r}")
        for k, v in res.items():
            if not _is_num(v) or v < 0:
                raise EngineError(f"{where}.resources.{k} must be a non-negative number, "
                                  f"got {v!r}")


def serve_options(cluster: dict[str, Any]) -> dict[str, Any]:
    """The Ray Serve deployment options of a (checked) ``cluster:`` mapping:
    ``num_replicas`` or ``autoscaling_config``, ``max_ongoing_requests`` and the replicas'
    ``ray_actor_options`` (``num_cpus``, ``num_gpus``, ``memory``, ``resources``)."""
    actor: dict[str, Any] = {"num_cpus": float(cluster.get("num_cpus", NUM_CPUS))}
    if cluster.get("num_gpus"):
        actor["num_gpus"] = float(cluster["num_gpus"])
    if cluster.get("memory"):
        actor["memory"] = int(cluster["memory"])
    if cluster.get("resources"):
        actor["resources"] = {str(k): float(v) for k, v in cluster["resources"].items()}
    out: dict[str, Any] = {
        "max_ongoing_requests": int(cluster.get("max_ongoing_requests", MAX_ONGOING_REQUESTS)),
        "ray_actor_options": actor}
    if "min_replicas" in cluster:
        auto: dict[str, Any] = {
            "min_replicas": cluster["min_replicas"], "max_replicas": cluster["max_replicas"],
            "target_ongoing_requests": float(cluster.get("target_ongoing_requests",
                                                         TARGET_ONGOING_REQUESTS))}
        for key in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s"):
            if key in cluster:
                auto[key] = float(cluster[key])
        out["autoscaling_config"] = auto
    else:
        out["num_replicas"] = int(cluster.get("replicas", 1))
    return out
