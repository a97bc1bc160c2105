"""The hub actor and an ingress replica's handles on it: the one place a served request
crosses between the HTTP face and the pipelines on Ray, so both sides of the crossing
(method names, what a reply holds, how a stream and a cancellation travel) live here.

``HubActor`` (``tailrace-hub-APP``) holds every pipeline's ``PipelineService`` and their
ONE admission gate: the call that hands a request over is the one admitted, so SLO
policies see every waiting request at no extra round trip. The request crosses as its
data (``tailrace/request.py``), errors as values (``ServiceError`` pickles whole); a
cancelled call stops the generation. docs/ray.md, "Serving on a cluster".
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from ...request import Request
from ...runtime.ray.credits import encode
from ..errors import ServiceError, ServiceUnavailable
from ..hub import ServingHub
from ..service import Cancel, PipelineService

NAMESPACE = "tailrace"
#: unconsumed yields a streamed request may have in flight to its replica
STREAM_WINDOW = 4
#: calls the hub actor serves at once (every request of every replica is one)
HUB_CONCURRENCY = 8192
#: seconds between an ingress replica's readiness polls of the hub
POLL_S = 0.5
#: seconds a replica reuses one snapshot of the hub's figures (a /metrics scrape reads
#: every pipeline's statistics: one actor call for all of them)
FIGURES_TTL_S = 0.25


def hub_name(app: str) -> str:
    """The hub actor's name for Serve application ``app``."""
    return f"tailrace-hub-{app}"


class HubActor:
    """The actor body: a ``ServingHub`` of ``plans`` behind the one gate ``gate_factory``
    builds here (None: admit all); ``placement``: ``{pipeline: {stage id: options}}``."""

    def __init__(self, plans: list[Any], gate_factory: Callable[[], Any] | None = None,
                 max_pending: int = 1024, timeout_s: float = 300.0,
                 placement: dict[str, dict] | None = None) -> None:
        from ...runtime.ray import ActiveRuns

        gate = gate_factory() if gate_factory is not None else None
        placement = placement or {}
        self.runs = ActiveRuns()  # the runs of this hub's services
        self.hub = ServingHub([PipelineService(
            p, admission=gate, max_pending=max_pending, timeout_s=timeout_s, runtime="ray",
            placement=placement.get(p.name), runs=self.runs) for p in plans], gate=gate)

    async def start(self) -> list[str]:
        """Start every pipeline's run on this actor's loop; returns their names."""
        self.hub.start(asyncio.get_running_loop())
        return list(self.hub.services)

    def ready(self) -> dict[str, tuple[bool, str | None]]:
        """Per pipeline: (ready, why it failed or None)."""
        return {name: (s.ready, None if s.failure is None
                       else f"{type(s.failure).__name__}: {s.failure}")
                for name, s in self.hub.services.items()}

    async def submit(self, msg: bytes) -> bytes:
        """Run one record: ``msg`` is ``encode((pipeline, record, request))``; answers
        ``encode((True, (output, reply)))`` or ``encode((False, ServiceError))``. One bytes
        each way: Ray pickles each argument of another type on its own (bench/serve_ray.py)."""
        name, record, request = pickle.loads(msg)
        try:
            out = await self.hub.services[name].submit(record, request=request)
            return encode((True, (out, request.reply)))
        except ServiceError as e:
            return encode((False, e))

    async def stream(self, name: str, record: dict, request: Request) -> Any:
        """A streaming generator: ``(None, text)`` for the pieces produced since the last
        yield, then ``(True, (output, reply))`` or ``(False, ServiceError)``. Closed
        early (the caller cancelled or died), it stops the generation."""
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = Cancel()
        task = asyncio.ensure_future(self.hub.services[name].submit(
            record, on_token=pieces.put_nowait, cancel=cancel, request=request))
        try:
            while True:
                getter = asyncio.ensure_future(pieces.get())
                await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                parts = [getter.result()] if getter.done() and not getter.cancelled() else []
                while not pieces.empty():
                    parts.append(pieces.get_nowait())
                if parts:
                    yield None, "".join(parts)
                if task.done() and pieces.empty():
                    break
            try:
                yield True, (task.result(), request.reply)
            except ServiceError as e:
                yield False, e
        finally:
            if not task.done():  # the caller left: nothing keeps generating for it
                cancel.set()
                task.cancel()

    def figures(self) -> dict[str, Any]:
        """What ``/metrics`` and ``/dashboard`` show: per pipeline its readiness and
        statistics, the gate's and the engine pools' statistics."""
        stats = getattr(self.hub.gate, "statistics", None)
        return {"services": {name: {"stats": s.stats(), "pending": s.pending,
                                    "queued": s.queued, "unrouted": s.unrouted}
                             for name, s in self.hub.services.items()},
                "gate": stats() if callable(stats) else None, "pools": self.hub.pools()}

    def actors(self) -> list[dict[str, Any]]:
        """The runs' stage actors (``ActiveRuns.describe``): to inspect or kill one."""
        return self.runs.describe()

    async def drain(self, timeout: float = 30.0) -> None:
        """Stop taking requests, answer those in the pipelines, end the runs."""
        await self.hub.aclose(timeout)


class RemoteService:
    """An ingress replica's handle on one pipeline of the hub actor; what ``create_app``
    needs of a ``PipelineService`` (``submit``, ``ready``, ``stats``, ...); the stage
    queues live in the stage actors (``stats()`` has their peaks)."""

    started = True

    def __init__(self, link: _HubLink, name: str, plan: Any) -> None:
        self.link = link
        self.name = name
        self.plan = plan

    @property
    def ready(self) -> bool:
        return self.link.ready.get(self.name, False)

    @property
    def failure(self) -> BaseException | None:
        why = self.link.failures.get(self.name)
        return None if why is None else ServiceUnavailable(why)

    async def submit(self, record: dict, on_token: Callable[[str], Any] | None = None,
                     cancel: Cancel | threading.Event | None = None, *,
                     request: Request | None = None) -> dict:
        """As ``PipelineService.submit``, through the hub actor: the request crosses as
        its data (``tailrace/request.py``), its reply comes back into it."""
        from ray.exceptions import RayError

        actor = self.link.actor
        req = request if request is not None else Request()
        try:
            if on_token is None:
                ref = actor.submit.remote(encode((self.name, record, req)))
                try:
                    ok, value = pickle.loads(await ref)
                except asyncio.CancelledError:
                    _cancel(ref)
                    raise
            else:
                ok, value = await self._stream(actor, record, req, on_token, cancel)
        except RayError as e:
            raise ServiceUnavailable(f"pipeline '{self.name}': the hub actor failed "
                                     f"({type(e).__name__}); this request is lost") from None
        if not ok:
            raise value
        out, req.reply = value
        return out

    async def _stream(self, actor: Any, record: dict, req: Request,
                      on_token: Callable[[str], Any],
                      cancel: Cancel | threading.Event | None) -> tuple[bool, Any]:
        gen = actor.stream.options(num_returns="streaming",
                                   _generator_backpressure_num_objects=STREAM_WINDOW
                                   ).remote(self.name, record, req)
        finished = False
        try:
            async for ref in gen:
                ok, value = await ref
                if ok is None:
                    on_token(value)
                    if cancel is not None and cancel.is_set():  # e.g. the relay overflowed
                        break
                    continue
                finished = True
                return ok, value
            raise ServiceUnavailable(f"pipeline '{self.name}': the stream ended without an "
                                     "answer")
        finally:
            if not finished:
                _cancel(gen)

    def stats(self) -> Any:
        return self.link.figures()["services"][self.name]["stats"]

    async def aclose(self, timeout: float = 30.0) -> None:
        """The hub's owner (``ClusterServer``) drains the pipelines, not a replica."""

    def stop(self, timeout: float = 30.0) -> None:
        """As ``aclose``."""


def _cancel(ref: Any) -> None:
    import ray

    with contextlib.suppress(Exception):  # already finished, or the actor is gone
        ray.cancel(ref)


class _HubLink:
    """A replica's connection to the hub actor: readiness polled in the background,
    figures fetched on demand (cached ``FIGURES_TTL_S``)."""

    def __init__(self, actor: Any, names: list[str]) -> None:
        self.actor = actor
        self.ready: dict[str, bool] = dict.fromkeys(names, False)
        self.failures: dict[str, str | None] = dict.fromkeys(names)
        self._figures: tuple[float, dict] | None = None
        self._lock = threading.Lock()
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def refresh(self) -> None:
        """Read the hub's readiness now."""
        from ray.exceptions import RayError

        try:
            state = await self.actor.ready.remote()
            for name, (ok, why) in state.items():
                self.ready[name], self.failures[name] = ok, why
        except RayError as e:
            for name in self.ready:
                self.ready[name] = False
                self.failures[name] = f"the hub actor is unreachable ({type(e).__name__})"

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.refresh()

    def figures(self) -> dict[str, Any]:
        """The hub's figures (a blocking call: ``/metrics`` and ``/dashboard/data`` are
        plain routes, run in worker threads)."""
        import ray

        with self._lock:
            now = time.monotonic()
            if self._figures is None or now - self._figures[0] > FIGURES_TTL_S:
                self._figures = (now, ray.get(self.actor.figures.remote(), timeout=10))
            return self._figures[1]


class _RemoteGate:
    """The hub's gate as ``/metrics`` reads it (``statistics()``)."""

    def __init__(self, link: _HubLink) -> None:
        self.link = link

    def statistics(self) -> Any:
        return self.link.figures()["gate"]


class RemoteHub(ServingHub):
    """An ingress replica's hub: remote services, the hub's gate and pool figures."""

    def __init__(self, link: _HubLink, services: list[RemoteService], gated: bool,
                 **options: Any) -> None:
        super().__init__(services, gate=_RemoteGate(link) if gated else None,  # type: ignore[arg-type]
                         **options)
        self.link = link

    def pools(self) -> dict[str, Any]:
        return dict(self.link.figures()["pools"])


def remote_hub(app_name: str, plans: list[Any], gated: bool,
               options: dict[str, Any]) -> RemoteHub:
    """An ingress replica's ``RemoteHub`` on the hub actor of Serve application
    ``app_name`` (runs in the replica; call ``hub.link.refresh`` and ``hub.link.start``
    on its loop before serving). Arguments as ``ingress.build_ingress_app``."""
    import ray

    actor = ray.get_actor(hub_name(app_name), namespace=NAMESPACE)
    link = _HubLink(actor, [p.name for p in plans])
    return RemoteHub(link, [RemoteService(link, p.name, p) for p in plans], gated, **options)
