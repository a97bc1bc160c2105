"""Engines shared by the cluster: one Ray actor per named engine, used by every stage.

A stage on Ray opens its engines with its host's opener (``host.open_shared_engine``): a
``ClusterEngine``, a handle on the named actor ``tailrace-engine-NAME`` (namespace
``tailrace``), created by the first stage that needs it and found by every later one, so
the model loads once per cluster. The actor is threaded: concurrent calls reach the
engine together. Tokens are counted in the stage's process (``token_counter``). With an
``on_token``, ``generate`` is a Ray streaming generator whose yields join the pieces
queued since the last one (docs/ray.md, "Tokens stream from engine actors"). A spec with
``cluster:`` is a Ray Serve deployment instead (``engine_serve.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import random
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ...engines.base import Generation, GenerationRequest, TokenCallback
from ...engines.opener import open_engine
from ...engines.tokens import token_counter
from ...errors import EngineError
from ...registry import Registry

NAMESPACE = "tailrace"
#: calls one engine actor serves at once (a continuous-batching engine merges them)
ACTOR_CONCURRENCY = 64
#: unconsumed yields a streaming call may have in flight before its generator waits
#: (pieces produced meanwhile are joined into the next yield)
STREAM_WINDOW = 2
#: seconds between a streaming call's yields after the first (pieces produced meanwhile
#: are joined): at most 50 Ray objects a second per call, each ~1.5 ms of CPU on this
#: machine, caller and actor together (bench/ray_stream.py)
STREAM_INTERVAL_S = 0.02
#: a streamed call whose actor died before any piece was handed on is tried this often
STREAM_RETRIES = 2


def engine_info(engine: Any) -> dict[str, Any]:
    """What a handle needs to know of an engine: model, context length, dim, chat."""
    def attr(key: str, default: Any) -> Any:
        try:  # e.g. an OpenAI generation engine has no embedding dim to tell
            return getattr(engine, key, default)
        except Exception:  # noqa: BLE001
            return default

    return {"model": attr("model", ""), "context_length": attr("context_length", None),
            "dim": attr("dim", None), "chat": attr("chat", True)}


class _Stream:
    """One streaming call in the actor: pieces queued by request, cancellations, outcome."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: dict[int, list[str]] = {}  # request index -> pieces not yet yielded
        self.cancelled: set[int] = set()
        self.stop_all = False  # the caller left: every sequence stops
        self.done = False
        self.result: list[Generation] | None = None
        self.error: BaseException | None = None

    def on_token(self, i: int, piece: str) -> bool:
        with self.cond:
            if self.stop_all or i in self.cancelled:
                return False
            if not self.pending:  # wake the generator for the first piece only
                self.cond.notify()
            self.pending.setdefault(i, []).append(piece)
        return True

    def take(self, not_before: float) -> tuple[list[tuple[int, str]], bool]:
        """(the pieces queued since the last take, joined per request; finished?), waiting
        until there is one or the other, and for more pieces until ``not_before``
        (``time.monotonic``) unless the generation ends first."""
        with self.cond:
            while not self.pending and not self.done:
                self.cond.wait()
            while not self.done and (left := not_before - time.monotonic()) > 0:
                self.cond.wait(left)
            pieces = [(i, "".join(ps)) for i, ps in self.pending.items()]
            self.pending = {}
            return pieces, self.done


class EngineActor:
    """The actor body: opens the engine (or pool) once and serves calls on threads."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        self.engine = open_engine(spec, name)
        self._streams: dict[int, _Stream] = {}

    def describe(self) -> dict[str, Any]:
        return engine_info(self.engine)

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        return self.engine.generate(requests)

    def stream(self, call_id: int, requests: list[GenerationRequest], interval: float = 0.0
               ) -> Iterator[tuple[list[tuple[int, str]], list[Generation] | None]]:
        """A streaming generator: ``(pieces, None)`` as pieces are produced (``pieces``:
        ``[(request index, text), ...]``, in order per request; the first at once, later
        ones at most one per ``interval`` seconds), then ``(pieces, generations)`` last.
        ``cancel(call_id, i)`` stops request ``i``."""
        s = self._streams[call_id] = _Stream()

        def work() -> None:
            try:
                s.result = self.engine.generate(requests, s.on_token)
            except BaseException as e:  # noqa: BLE001 - raised to the caller below
                s.error = e
            with s.cond:
                s.done = True
                s.cond.notify()

        threading.Thread(target=work, name=f"tailrace-stream-{call_id}", daemon=True).start()
        try:
            last = float("-inf")
            while True:
                pieces, done = s.take(last + interval)
                if done:
                    break
                last = time.monotonic()
                yield pieces, None
            if s.error is not None:
                raise s.error
            yield pieces, s.result
        finally:  # finished, failed or closed early: nothing keeps generating for it
            with s.cond:
                s.stop_all = True
            self._streams.pop(call_id, None)

    def cancel(self, call_id: int, index: int | None = None) -> None:
        """Stop request ``index`` of streaming call ``call_id`` (None: all of them)."""
        s = self._streams.get(call_id)
        if s is not None:
            with s.cond:
                if index is None:
                    s.stop_all = True
                else:
                    s.cancelled.add(index)

    def embed(self, texts: list[str]) -> Any:
        return self.engine.embed(texts)


def actor_name(name: str, spec: dict[str, Any]) -> str:
    """The cluster-wide actor name of engine ``name`` with ``spec`` (spec-hashed, so two
    pipelines giving one name to different engines do not share by mistake)."""
    clean = {k: v for k, v in spec.items() if not k.startswith("_")}
    digest = hashlib.sha1(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()
    return f"tailrace-engine-{name}-{digest[:10]}"


def actor_options(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The Ray options of engine ``name``'s actor: named (found if it exists), threaded,
    restarted when it dies; whole-batch calls are retried on the restarted actor."""
    return {"name": actor_name(name, spec), "namespace": NAMESPACE, "get_if_exists": True,
            "max_concurrency": ACTOR_CONCURRENCY, "num_cpus": 0, "max_restarts": -1,
            "max_task_retries": 2}


class EngineHandle:
    """What a stage's handles on a cluster engine (an actor, a Serve deployment) share:
    the engine's figures (``engine_info``, told by where it runs), tokens counted in the
    stage's own process, and no ``close`` (``shutdown_engines`` stops the engine)."""

    interval = STREAM_INTERVAL_S  # a streaming call's seconds between yields
    retries = STREAM_RETRIES  # a streamed call whose engine died before any piece

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        self.name = name
        self._spec = {k: v for k, v in spec.items() if not k.startswith("_")}
        self._count: Any = None

    def _describe(self, info: dict[str, Any]) -> None:
        self.model: str = info["model"]
        self.context_length: int | None = info["context_length"]
        self.dim: int | None = info["dim"]
        self.chat: bool = info["chat"]

    def count_tokens(self, text: str) -> int:
        if self._count is None:
            self._count = token_counter({k: v for k, v in self._spec.items()
                                         if k != "cluster"})
        return int(self._count(text))

    def close(self) -> None:
        """The engine is the cluster's: stages do not stop it."""


class ClusterEngine(EngineHandle):
    """A stage's handle on a shared engine actor; speaks the engine protocols."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        import ray

        super().__init__(name, spec)
        self._renew()
        try:
            self._describe(ray.get(self._actor.describe.remote()))
        except Exception as e:  # the engine could not be opened in its actor
            raise EngineError(f"engine '{name}' failed to start on the cluster: "
                              f"{getattr(e, 'cause', None) or e}") from None

    def _renew(self) -> None:
        """The named actor: found if alive (or restarting), else created. An actor is
        owned by the process that created it and dies with it, whatever its restarts:
        when that stage host dies, the next caller creates it anew."""
        import ray

        remote: Any = ray.remote(EngineActor)
        self._actor: Any = remote.options(**actor_options(self.name, self._spec)).remote(
            self.name, self._spec)

    def _call(self, method: str, *args: Any) -> Any:
        """A whole call; on an actor that died for good (its owner, another stage host,
        died with it), once more on a renewed one."""
        import ray
        from ray.exceptions import ActorDiedError

        try:
            return ray.get(getattr(self._actor, method).remote(*args))
        except ActorDiedError:
            self._renew()
            return ray.get(getattr(self._actor, method).remote(*args))

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        if on_token is None:  # nothing to stream to: one whole-batch call
            return self._call("generate", list(requests))
        from ray.exceptions import ActorDiedError, RayActorError

        for attempt in itertools.count():
            delivered = [False]
            try:
                return self._stream(list(requests), on_token, delivered)
            except RayActorError as e:
                if isinstance(e, ActorDiedError):
                    self._renew()  # dead for good (or restarting: the same actor again)
                if delivered[0] or attempt >= self.retries:
                    raise EngineError(
                        f"engine '{self.name}': its actor died while streaming "
                        f"({type(e).__name__}); the generation is lost") from None
        raise AssertionError("unreachable")

    def _stream(self, requests: list[GenerationRequest], on_token: TokenCallback,
                delivered: list[bool]) -> list[Generation]:
        """One streaming call: hands pieces to ``on_token`` as they come, tells the actor
        of each request it refuses, and cancels the rest if it leaves early."""
        import ray

        call_id = random.getrandbits(62)  # unique among the actor's callers' calls
        refs = self._actor.stream.options(
            num_returns="streaming", max_task_retries=0,
            _generator_backpressure_num_objects=STREAM_WINDOW).remote(
            call_id, requests, self.interval)
        refused: set[int] = set()
        finished = False
        try:
            for ref in refs:
                pieces, gens = ray.get(ref)
                for i, piece in pieces:
                    if i in refused:
                        continue
                    delivered[0] = True
                    if on_token(i, piece) is False:
                        refused.add(i)
                        self._actor.cancel.remote(call_id, i)
                if gens is not None:
                    finished = True
                    return list(gens)
            raise EngineError(f"engine '{self.name}': its stream ended without generations")
        finally:
            if not finished:  # left early (an error, or on_token raised): stop the engine
                with contextlib.suppress(Exception):  # the actor may be gone
                    self._actor.cancel.remote(call_id, None)

    def embed(self, texts: Sequence[str]) -> Any:
        return self._call("embed", list(texts))


_HANDLES: Registry[Any] = Registry("cluster engine handles")


def open_cluster_engine(name: str, spec: dict[str, Any]) -> Any:
    """The stage process's handle on engine ``name`` (one per name and spec): a
    ``ClusterEngine``, or with ``cluster:`` in the spec an ``engine_serve.ServeEngine``
    (replicas spread over the cluster)."""
    if "cluster" in spec:
        from .engine_serve import ServeEngine

        return _HANDLES.get(actor_name(name, spec), lambda: ServeEngine(name, spec))
    return _HANDLES.get(actor_name(name, spec), lambda: ClusterEngine(name, spec))


def shutdown_engines() -> int:
    """Kill every tailrace engine actor and delete every engine deployment (``cluster:``)
    on the cluster; returns how many (tests, teardown)."""
    import ray
    from ray.util import list_named_actors

    from .engine_serve import shutdown_serve_engines

    killed = shutdown_serve_engines()
    for entry in list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry["name"].startswith("tailrace-engine-"):
            ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE))
            killed += 1
    return killed
