"""Fakes for engines on the Ray cluster: a token-counting generation engine, an engine
actor that knows its backend, and a signal actor to hold the engine until the test says.

The engine actor runs in another process, where a test's ``monkeypatch`` of ``BACKENDS``
does not reach: ``cluster_engine`` creates the named actor from ``FakeBackendActor``
(which registers ``backend: counter`` in its own process first), and the ``ClusterEngine``
it returns finds that actor by name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tailrace.engines import Generation, GenerationRequest
from tailrace.engines import models as registry
from tailrace.errors import EngineError
from tailrace.runtime.ray.engines import (
    NAMESPACE,
    ClusterEngine,
    EngineActor,
    actor_name,
    actor_options,
)

#: how long the engine waits for a signal before it fails (a broken stream: no hang)
HOLD_TIMEOUT_S = 60.0
#: tokens an "endless" request produces at most if nobody stops it
ENDLESS_CAP = 1_000_000


class CounterEngine:
    """Generates ``t0 t1 t2 ...`` (``max_tokens`` pieces, one per token) for each request.

    hold:       a ``Signal`` actor's name: after request 0's first piece the engine waits
                for it (``Signal.send``) before going on.
    fail_after: raise EngineError after this many pieces of a request.
    die_once:   a file path: the first call (no such file yet) creates it and kills the
                actor's process.
    A request whose ``on_token`` returns False ends "cancelled", as the protocol says; a
    request with ``max_tokens=0`` is endless (until cancelled, or ``ENDLESS_CAP``).
    """

    chat = True
    context_length = 4096

    def __init__(self, model: str = "counter", hold: str | None = None,
                 fail_after: int | None = None, die_once: str | None = None) -> None:
        self.model = model
        self.hold = hold
        self.fail_after = fail_after
        self.die_once = die_once
        self.log: list[Generation] = []  # every generation it finished, in order

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Any = None) -> list[Generation]:
        if self.die_once and not Path(self.die_once).exists():
            Path(self.die_once).write_text("died")
            os._exit(1)
        out = []
        for i, r in enumerate(requests):
            n = r.max_tokens or ENDLESS_CAP
            pieces, reason = [], "length"
            for k in range(n):
                if self.fail_after is not None and k == self.fail_after:
                    raise EngineError(f"counter engine failed after {k} tokens")
                piece = f"t{k} "
                pieces.append(piece)
                if on_token is not None and on_token(i, piece) is False:
                    reason = "cancelled"
                    break
                if self.hold and i == 0 and k == 0:
                    wait_for(self.hold)
            out.append(Generation("".join(pieces), 1, len(pieces), reason))
            self.log.append(out[-1])
        return out

    def close(self) -> None:
        pass


class PrefixEngine:
    """Remembers the prompts it rendered; reports the longest prefix one of them shares
    with a request (4 characters a token) as ``extra["cached_tokens"]``, and which engine
    it is (``extra["replica"]``: one per pool replica)."""

    chat = True
    context_length = 100_000

    def __init__(self, model: str = "prefix") -> None:
        self.model, self.seen = model, []

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: Any = None) -> list[Generation]:
        out = []
        for r in requests:
            text = "".join(f"<{m['role']}>{m['content']}" for m in r.messages or ())
            shared = max((len(os.path.commonprefix([text, s])) for s in self.seen), default=0)
            self.seen.append(text)
            out.append(Generation("ok", len(text) // 4, 1, "stop",
                                  {"cached_tokens": shared // 4, "replica": id(self)}))
        return out

    def close(self) -> None:
        pass


class Signal:
    """A Ray actor (threaded) that ``wait`` blocks on until ``send``."""

    def __init__(self) -> None:
        import threading

        self.event = threading.Event()

    def wait(self, timeout: float) -> bool:
        return self.event.wait(timeout)

    def send(self) -> None:
        self.event.set()


def signal(name: str) -> Any:
    """A new named ``Signal`` actor (kill it with ``ray.kill`` when done)."""
    import ray

    return ray.remote(Signal).options(name=name, namespace=NAMESPACE,
                                      max_concurrency=4, num_cpus=0).remote()


def wait_for(name: str) -> None:
    import ray

    sig = ray.get_actor(name, namespace=NAMESPACE)
    if not ray.get(sig.wait.remote(HOLD_TIMEOUT_S)):
        raise EngineError(f"counter engine: nobody sent signal {name!r} (was the first "
                          "piece streamed?)")


class FakeBackendActor(EngineActor):
    """``EngineActor`` that makes ``backend: counter`` known in its process first."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        registry.BACKENDS["counter"] = (__name__, "CounterEngine", ("generate",))
        registry.BACKENDS["prefix"] = (__name__, "PrefixEngine", ("generate",))
        super().__init__(name, spec)


def counter_spec(**kw: Any) -> dict[str, Any]:
    return {"backend": "counter", "model": "counter", **kw}


_OWNERS: dict[str, Any] = {}


def cluster_engine(name: str, spec: dict[str, Any]) -> ClusterEngine:
    """A ``ClusterEngine`` on a ``FakeBackendActor`` named as the runtime names it."""
    import ray

    remote: Any = ray.remote(FakeBackendActor)
    actor = remote.options(**actor_options(name, spec)).remote(name, spec)
    ray.get(actor.describe.remote())  # registered under its name before the handle looks
    _OWNERS[actor_name(name, spec)] = actor  # the creator's handle keeps the actor alive
    return ClusterEngine(name, spec)


def actor_state(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """What engine ``name``'s actor holds: its open streams and its engine's ``log``."""
    import ray

    def state(actor: Any) -> dict[str, Any]:
        return {"streams": len(actor._streams), "log": list(actor.engine.log)}

    return ray.get(_OWNERS[actor_name(name, spec)].__ray_call__.remote(state))


def actor_pool_statistics(name: str, spec: dict[str, Any]) -> Any:
    """``statistics()`` of the engine pool engine ``name``'s actor hosts."""
    import ray

    return ray.get(_OWNERS[actor_name(name, spec)].__ray_call__.remote(
        lambda actor: actor.engine.statistics()))


def kill_engine(name: str, spec: dict[str, Any], restart: bool = False) -> None:
    import ray

    ray.kill(ray.get_actor(actor_name(name, spec), namespace=NAMESPACE),
             no_restart=not restart)
    if not restart:
        _OWNERS.pop(actor_name(name, spec), None)
