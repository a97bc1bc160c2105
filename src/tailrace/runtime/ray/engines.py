"""Engines shared by the cluster: one Ray actor per named engine, used by every stage.

On the Ray runtime a stage's ``open_engine`` (in a ``StageHost``) returns a
``ClusterEngine``: a handle on the named actor ``tailrace-engine-NAME`` in the
``tailrace`` namespace, created by the first stage that needs it and found by name by
every later one — every stage replica and every pipeline of the job shares one engine
(or one engine pool, when the spec says ``replicas:``), and the model loads once per
cluster instead of once per stage host. The actor is threaded, so concurrent calls from
many stages reach the engine together (llama.cpp decodes them in one batch).

Tokens are counted in the stage's process (``token_counter``: the model's vocabulary
only), so prompt checks cost no remote call. Streaming callbacks are not carried across
the actor boundary: a ``ClusterEngine`` returns whole generations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ...engines.base import Generation, GenerationRequest, TokenCallback
from ...engines.opener import open_engine
from ...engines.tokens import token_counter
from ...errors import EngineError
from ...registry import Registry

NAMESPACE = "tailrace"
#: calls one engine actor serves at once (a continuous-batching engine merges them)
ACTOR_CONCURRENCY = 64


class EngineActor:
    """The actor body: opens the engine (or pool) once and serves calls on threads."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        self.engine = open_engine(spec, name)

    def describe(self) -> dict[str, Any]:
        def attr(key: str, default: Any) -> Any:
            try:  # e.g. an OpenAI generation engine has no embedding dim to tell
                return getattr(self.engine, key, default)
            except Exception:  # noqa: BLE001
                return default

        return {"model": attr("model", ""), "context_length": attr("context_length", None),
                "dim": attr("dim", None), "chat": attr("chat", True)}

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        return self.engine.generate(requests)

    def embed(self, texts: list[str]) -> Any:
        return self.engine.embed(texts)


def actor_name(name: str, spec: dict[str, Any]) -> str:
    """The cluster-wide actor name of engine ``name`` with ``spec`` (spec-hashed, so two
    pipelines giving one name to different engines do not share by mistake)."""
    clean = {k: v for k, v in spec.items() if not k.startswith("_")}
    digest = hashlib.sha1(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()
    return f"tailrace-engine-{name}-{digest[:10]}"


class ClusterEngine:
    """A stage's handle on a shared engine actor; speaks the engine protocols."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        import ray

        self.name = name
        self._spec = {k: v for k, v in spec.items() if not k.startswith("_")}
        remote: Any = ray.remote(EngineActor)
        remote = remote.options(
            name=actor_name(name, self._spec), namespace=NAMESPACE, get_if_exists=True,
            max_concurrency=ACTOR_CONCURRENCY, num_cpus=0, max_restarts=-1,
            max_task_retries=2)
        self._actor: Any = remote.remote(name, self._spec)
        try:
            info: dict[str, Any] = ray.get(self._actor.describe.remote())
        except Exception as e:  # the engine could not be opened in its actor
            raise EngineError(f"engine '{name}' failed to start on the cluster: "
                              f"{getattr(e, 'cause', None) or e}") from None
        self.model: str = info["model"]
        self.context_length: int | None = info["context_length"]
        self.dim: int | None = info["dim"]
        self.chat: bool = info["chat"]
        self._count: Any = None

    def count_tokens(self, text: str) -> int:
        if self._count is None:
            self._count = token_counter(self._spec)
        return int(self._count(text))

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        import ray

        gens: list[Generation] = ray.get(self._actor.generate.remote(list(requests)))
        if on_token is not None:  # no streaming across the actor: each text in one piece
            for i, g in enumerate(gens):
                if g.text:
                    on_token(i, g.text)
        return gens

    def embed(self, texts: Sequence[str]) -> Any:
        import ray

        return ray.get(self._actor.embed.remote(list(texts)))

    def close(self) -> None:
        """The actor is the cluster's: stages do not stop it (``shutdown_engines`` does)."""


_HANDLES: Registry[ClusterEngine] = Registry("cluster engine handles")


def open_cluster_engine(name: str, spec: dict[str, Any]) -> ClusterEngine:
    """The stage process's handle on engine ``name`` (one per name and spec)."""
    return _HANDLES.get(actor_name(name, spec), lambda: ClusterEngine(name, spec))


def shutdown_engines() -> int:
    """Kill every tailrace engine actor on the cluster; returns how many (tests, teardown)."""
    import ray
    from ray.util import list_named_actors

    killed = 0
    for entry in list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry["name"].startswith("tailrace-engine-"):
            ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE))
            killed += 1
    return killed
