"""Fakes for engine replicas on Ray Serve (``cluster:`` specs): a counting engine that
tells which replica process served each request, a replica class that knows it, and
helpers to find and kill replicas.

Serve replicas run in processes a test's ``monkeypatch`` does not reach:
``serve_engine`` gives ``ServeEngine`` the replica class ``FakeReplica``, which registers
``backend: counter`` in its own process before it opens the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tailrace.engines import Generation, GenerationRequest
from tailrace.engines import models as registry
from tailrace.runtime.ray.engine_serve import APP_PREFIX, EngineReplica, ServeEngine
from tests.runtime.ray_engine_fakes import CounterEngine


class PidCounterEngine(CounterEngine):
    """``CounterEngine`` whose generations say which process made them
    (``extra["pid"]``); ``delay``: seconds it takes per token."""

    def __init__(self, model: str = "counter", delay: float = 0.0, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.delay = delay

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Any = None) -> list[Generation]:
        def tick(i: int, piece: str) -> Any:
            time.sleep(self.delay)
            return on_token(i, piece) if on_token is not None else None

        slow = on_token is not None or self.delay
        gens = super().generate(requests, tick if slow else None)
        return [replace(g, extra={"pid": os.getpid()}) for g in gens]


class FakeReplica(EngineReplica):
    """``EngineReplica`` that makes ``backend: counter`` known in its process first."""

    def __init__(self, name: str, spec: dict[str, Any], threads: int) -> None:
        registry.BACKENDS["counter"] = (__name__, "PidCounterEngine", ("generate",))
        super().__init__(name, spec, threads)

    def log(self) -> list[Generation]:
        """Every generation this replica's engine finished, in order."""
        return list(self.engine.log)


def serve_engine(name: str, spec: dict[str, Any]) -> ServeEngine:
    """A ``ServeEngine`` on ``FakeReplica`` replicas, named as the runtime names it."""
    return ServeEngine(name, spec, body=FakeReplica)


def replica_actors(eng: ServeEngine) -> list[str]:
    """The names of the live replica actors of ``eng``'s deployment."""
    from ray.util import list_named_actors

    return [e["name"] for e in list_named_actors(all_namespaces=True)
            if e.get("namespace") == "serve" and e["name"].startswith(
                f"SERVE_REPLICA::{eng.app}#")]


def running_replicas(eng: ServeEngine) -> int:
    from ray import serve

    app = serve.status().applications.get(eng.app)
    dep = app.deployments.get("engine") if app else None
    return sum(n for s, n in (dep.replica_states if dep else {}).items()
               if getattr(s, "value", s) == "RUNNING")


__all__ = ["APP_PREFIX", "FakeReplica", "PidCounterEngine", "replica_actors",
           "running_replicas", "serve_engine"]
