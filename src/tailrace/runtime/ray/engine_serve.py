"""Engine replicas spread over the cluster: an engine spec with ``cluster:`` is a Ray Serve
deployment, one replica = one engine, autoscaled by Serve between declared bounds.

The first stage host that opens such a spec (a ``ServeEngine``) asks the cluster's
``Deployer`` actor (one call at a time, so hosts opening it together create it once) to
run the Serve application ``actor_name(name, spec)``; later openers find it by that
name. Serve places, restarts and autoscales the replicas and routes each call to the
less loaded of two. One Serve call per request, so a batch spreads over replicas and a
request can be cancelled alone (docs/ray.md, "Engine replicas across the cluster").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...engines.base import Generation, GenerationRequest, TokenCallback
from ...engines.cluster import serve_options
from ...engines.opener import open_engine
from ...errors import EngineError
from .engines import NAMESPACE, EngineHandle, actor_name, engine_info

#: the deployment of an engine's Serve application (the application is the engine's)
DEPLOYMENT = "engine"
#: the prefix of every tailrace engine's Serve application (``actor_name``)
APP_PREFIX = "tailrace-engine-"
#: times Serve tries to open a replica's engine before the deployment fails
CONSTRUCTOR_RETRIES = 3
#: seconds a failed deployment is not tried again (the run's other hosts fail at once)
FAILED_HOLD_S = 30.0
#: the replicas' Serve logging: warnings only, no access log line per request
LOGGING = {"log_level": "WARNING", "enable_access_log": False}


class _Pieces:
    """One streamed request in a replica: pieces the engine thread queues for the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[str] = []
        self.stop = False  # the call ended (cancelled, closed): the engine stops
        self.wake = asyncio.Event()

    def on_token(self, i: int, piece: str) -> bool:
        if self.stop:
            return False
        with self.lock:
            first = not self.pending
            self.pending.append(piece)
        if first:  # one wake per yield, not per token
            self.loop.call_soon_threadsafe(self.wake.set)
        return True

    def take(self) -> str:
        with self.lock:
            text, self.pending = "".join(self.pending), []
        self.wake.clear()
        return text


class EngineReplica:
    """The body of a Serve replica: one engine, its calls on a thread pool of the
    deployment's ``max_ongoing_requests`` threads (a batching engine merges them)."""

    def __init__(self, name: str, spec: dict[str, Any], threads: int) -> None:
        self.engine = open_engine(spec, name)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"tailrace-{name}")

    def describe(self) -> dict[str, Any]:
        return {**engine_info(self.engine), "pid": os.getpid()}

    async def generate(self, request: GenerationRequest) -> Generation:
        loop = asyncio.get_running_loop()
        gens = await loop.run_in_executor(self.pool, self.engine.generate, [request])
        return gens[0]

    async def stream(self, request: GenerationRequest, interval: float = 0.0
                     ) -> AsyncIterator[tuple[str, Generation | None]]:
        """``(piece, None)`` as the engine produces them (the first at once, later ones at
        most one per ``interval`` seconds, joined), then ``(piece, generation)`` last.
        Cancelling the call stops the engine's sequence."""
        loop = asyncio.get_running_loop()
        p = _Pieces(loop)
        job = loop.run_in_executor(self.pool, self.engine.generate, [request], p.on_token)
        try:
            last = float("-inf")
            while True:
                woken = asyncio.ensure_future(p.wake.wait())
                await asyncio.wait((woken, job), return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                if not job.done() and (left := last + interval - loop.time()) > 0:
                    await asyncio.wait((job,), timeout=left)
                text = p.take()
                if job.done():
                    break
                if text:
                    last = loop.time()
                    yield text, None
            yield text, job.result()[0]
        finally:  # finished, failed or cancelled: nothing keeps generating for it
            p.stop = True

    async def embed(self, texts: list[str]) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.engine.embed, texts)


def _one_line(e: BaseException) -> str:
    """The last line of an error's message (Serve's carry a traceback before it)."""
    cause = getattr(e, "cause", None)
    lines = [ln for ln in str(cause or e).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


class Deployer:
    """A Ray actor (one per cluster; calls one at a time) that creates engine deployments,
    so stage hosts opening one engine together create it once. A deployment that failed
    is deleted at once (no replica keeps trying to open the engine) and not tried again
    for ``FAILED_HOLD_S``: the other hosts of the run get the same error without a wait."""

    def __init__(self) -> None:
        self.failed: dict[str, tuple[float, EngineError]] = {}  # app -> (when, error)

    def ensure(self, app: str, name: str, spec: dict[str, Any],
               body: type = EngineReplica) -> dict[str, Any]:
        """Run engine ``name``'s application ``app`` unless it runs; its ``describe()``.

        spec: the engine spec with its ``cluster:`` mapping; body: the replica class."""
        from ray import serve

        when, error = self.failed.get(app, (float("-inf"), None))
        if error is not None and time.monotonic() - when < FAILED_HOLD_S:
            raise error
        serve.start(proxy_location="Disabled")  # engines need no HTTP; no-op if running
        status = serve.status().applications.get(app)
        deadline = time.monotonic() + FAILED_HOLD_S
        while status is not None and status.status == "DELETING":  # a failed one, going
            if time.monotonic() > deadline:
                raise EngineError(f"engine '{name}': its failed deployment {app} is still "
                                  "being deleted; try again, or serve.delete it")
            time.sleep(0.2)
            status = serve.status().applications.get(app)
        if status is None or status.status == "DEPLOY_FAILED":
            options = serve_options(spec["cluster"])
            base = {k: v for k, v in spec.items() if k != "cluster"}
            make: Any = serve.deployment
            deployment = make(body, name=DEPLOYMENT, **options,
                              max_constructor_retry_count=CONSTRUCTOR_RETRIES)
            try:
                serve.run(deployment.bind(name, base, options["max_ongoing_requests"]),
                          name=app, route_prefix=None, logging_config=LOGGING)
            except Exception as e:  # noqa: BLE001 - the engine could not be opened
                failed = serve.status().applications.get(app)
                dep = failed.deployments.get(DEPLOYMENT) if failed else None
                why = _one_line(RuntimeError(dep.message)) if dep and dep.message else \
                    _one_line(e)
                serve.delete(app, _blocking=False)  # no replica keeps trying to open it
                err = EngineError(f"engine '{name}' failed to start on the cluster: {why}")
                self.failed[app] = (time.monotonic(), err)
                raise err from None
        info: dict[str, Any] = serve.get_app_handle(app).describe.remote().result()
        return info


def _deployer() -> Any:
    """The cluster's ``Deployer`` (detached, like Serve's controller: a handle dropped by
    the process that made it must not end it while another process calls it)."""
    import ray

    remote: Any = ray.remote(Deployer)
    return remote.options(name="tailrace-deployer", namespace=NAMESPACE, get_if_exists=True,
                          lifetime="detached", num_cpus=0, max_restarts=-1).remote()


def _died(e: BaseException) -> bool:
    """Did the replica die under the call (retried while nothing was handed on)?"""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return isinstance(e, (RayActorError, ActorUnavailableError, ReplicaUnavailableError))


def _engine_error(e: BaseException) -> BaseException:
    """The engine's own error inside a Ray task error, or the error itself."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, EngineError) else e


class ServeEngine(EngineHandle):
    """A stage's handle on an engine's Serve deployment; speaks the engine protocols.

    name: the engine's name; spec: its spec with ``cluster:``; body: the replica class
    (tests give one that knows a fake backend)."""

    def __init__(self, name: str, spec: dict[str, Any], body: type = EngineReplica) -> None:
        import ray

        super().__init__(name, spec)
        self.app = actor_name(name, self._spec)
        try:
            info: dict[str, Any] = ray.get(_deployer().ensure.remote(
                self.app, name, self._spec, body))
        except Exception as e:  # noqa: BLE001 - an EngineError from the deployer, or Ray's
            err = _engine_error(e)
            if not isinstance(err, EngineError):
                err = EngineError(f"engine '{name}' failed to start on the cluster: "
                                  f"{_one_line(e)}")
            raise err from None
        self._describe(info)
        self._handle: Any = None
        self._lock = threading.Lock()

    def handle(self) -> Any:
        """The Serve handle on the deployment (made on first use, in a caller's thread)."""
        with self._lock:
            if self._handle is None:
                from ray import serve

                self._handle = serve.get_deployment_handle(DEPLOYMENT, self.app)
            return self._handle

    def _call(self, method: str, arg: Any) -> Any:
        """A plain call, tried again on another replica if its replica died."""
        for attempt in itertools.count():
            try:
                return getattr(self.handle(), method).remote(arg).result()
            except Exception as e:  # noqa: BLE001 - sorted below
                if not _died(e):
                    raise _engine_error(e) from None
                if attempt >= self.retries:
                    raise EngineError(f"engine '{self.name}': its replica died under the call "
                                      f"({type(e).__name__}); tried {attempt + 1} times"
                                      ) from None
        raise AssertionError("unreachable")

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        if on_token is None:
            h = self.handle()
            first = [h.generate.remote(r) for r in requests]  # all at once, over replicas
            out: list[Generation] = []
            try:
                for r, resp in zip(requests, first, strict=True):
                    try:
                        out.append(resp.result())
                    except Exception as e:  # noqa: BLE001
                        if not _died(e):
                            raise _engine_error(e) from None
                        out.append(self._call("generate", r))
                return out
            finally:
                for resp in first[len(out) + 1:]:  # failed: the rest need not run
                    _cancel(resp)
        return self._stream(list(requests), on_token)

    def _stream(self, requests: list[GenerationRequest],
                on_token: TokenCallback) -> list[Generation]:
        """Streaming calls, one per request, read by a thread each; this thread hands the
        pieces on, cancels refused requests, and cancels all if it leaves early."""
        events: queue.SimpleQueue = queue.SimpleQueue()  # (index, call, piece, gen, error)
        calls: dict[int, Any] = {}
        handed: dict[int, list[str]] = {i: [] for i in range(len(requests))}
        tries = dict.fromkeys(range(len(requests)), 0)
        out: dict[int, Generation] = {}
        h = self.handle().options(stream=True)

        def start(i: int) -> None:
            call = calls[i] = h.stream.remote(requests[i], self.interval)
            threading.Thread(target=_read, args=(i, call, events.put), daemon=True,
                             name=f"tailrace-{self.name}-read").start()

        for i in range(len(requests)):
            start(i)
        try:
            while len(out) < len(requests):
                i, call, piece, gen, error = events.get()
                if i in out or call is not calls[i]:
                    continue  # refused already, or an attempt given up
                if error is not None:
                    if not _died(error):
                        raise _engine_error(error) from None
                    if handed[i] or tries[i] >= self.retries:
                        raise EngineError(
                            f"engine '{self.name}': its replica died while streaming "
                            f"({type(error).__name__}); the generation is lost") from None
                    tries[i] += 1
                    start(i)
                    continue
                if piece:
                    handed[i].append(piece)
                    if on_token(i, piece) is False:
                        out[i] = self._cancelled(requests[i], "".join(handed[i]))
                        call.cancel()
                        continue
                if gen is not None:
                    out[i] = gen
            return [out[i] for i in range(len(requests))]
        finally:
            for i, call in calls.items():  # left early: stop the replicas' work
                if i not in out:
                    _cancel(call)

    def _cancelled(self, request: GenerationRequest, text: str) -> Generation:
        prompt = request.prompt if request.prompt is not None else " ".join(
            str(m.get("content", "")) for m in request.messages or ())
        return Generation(text, self.count_tokens(prompt), self.count_tokens(text),
                          "cancelled")

    def embed(self, texts: Sequence[str]) -> Any:
        return self._call("embed", list(texts))


def _read(i: int, call: Any, put: Callable[[tuple], None]) -> None:
    """Read streaming call ``call`` of request ``i`` to its end, putting each item."""
    try:
        for piece, gen in call:
            put((i, call, piece, gen, None))
    except BaseException as e:  # noqa: BLE001 - the caller decides
        put((i, call, "", None, e))


def _cancel(call: Any) -> None:
    with contextlib.suppress(Exception):  # finished or gone already
        call.cancel()


def cluster_pool_statistics() -> dict[str, dict[str, Any]]:
    """Each engine deployment on the cluster, by engine name: its Serve status, replicas
    running and ongoing requests per replica (as Serve's router probes them); empty when
    Serve does not run."""
    import ray
    from ray import serve
    from ray.util import list_named_actors

    out: dict[str, dict[str, Any]] = {}
    apps = {a: s for a, s in serve.status().applications.items() if a.startswith(APP_PREFIX)}
    if not apps:
        return out
    replicas: dict[str, list[str]] = {}
    for entry in list_named_actors(all_namespaces=True):
        app, sep, rest = entry["name"].removeprefix("SERVE_REPLICA::").partition("#")
        if entry.get("namespace") == "serve" and sep and app in apps:
            replicas.setdefault(app, []).append(entry["name"])
    for app, status in apps.items():
        dep = status.deployments.get(DEPLOYMENT)
        ongoing: dict[str, int] = {}
        for actor in replicas.get(app, []):
            try:
                handle: Any = ray.get_actor(actor, namespace="serve")
                n: Any = ray.get(handle.get_num_ongoing_requests.remote(), timeout=5)
                ongoing[actor.rsplit("#", 1)[-1]] = int(n)
            except Exception:  # noqa: BLE001,S112 - stopping or dead: not counted
                continue
        out[app[len(APP_PREFIX):-11]] = {
            "app": app, "status": str(getattr(status.status, "value", status.status)),
            "replicas": sum(n for state, n in (dep.replica_states if dep else {}).items()
                            if getattr(state, "value", state) == "RUNNING"),
            "ongoing": ongoing}
    return out


def shutdown_serve_engines() -> int:
    """Delete every tailrace engine deployment on the cluster; returns how many."""
    from ray import serve

    apps = [a for a in serve.status().applications if a.startswith(APP_PREFIX)]
    for app in apps:
        serve.delete(app)
    return len(apps)
