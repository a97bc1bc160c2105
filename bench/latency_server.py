"""Latency-model engine server: a benchmark tool, not an inference engine.

A real HTTP server speaking the OpenAI wire format (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, streaming or not) whose response *time* follows a configurable
continuous-batching model, while it does no model work at all: every wait is an
``asyncio.sleep``, so hundreds of concurrent sequences cost almost no CPU. That lets the
contention and scale-out goals of ARCHITECTURE.md §5 be measured on a 2-core machine, with
``tailrace``'s ``OpenAIEngine`` (or any OpenAI client) talking to it as to vLLM.

Run it::

    python bench/latency_server.py --port 8101 [--prefill-tps 4000] [--decode-tps 40] \\
        [--batch-slowdown 0.05] [--max-seqs 8] [--seed 0] [--jitter 0] [--host 127.0.0.1]

It prints one line, ``latency_server: listening on http://HOST:PORT/v1 ...``, once it
answers, and runs until SIGINT or SIGTERM. From Python::

    cfg = LatencyConfig(decode_tps=200, max_seqs=2)
    with start_server(cfg) as srv:        # uvicorn in a background thread, a free port
        client = openai.OpenAI(base_url=srv.url, api_key="x")
        ...
        srv.stats()                       # the same JSON as GET /stats
    with spawn(cfg) as srv:               # the same server in a subprocess
        ...

The latency model (one instance per server):

* A request holds one of ``max_seqs`` sequence slots from the start of its prefill to its
  last token; when all are held, further requests wait FIFO in the server (``queued``).
* Prefill takes ``prompt_tokens / prefill_tps`` seconds.
* Then each output token takes ``(1 / decode_tps) * (1 + batch_slowdown * (active - 1))``
  seconds, where ``active`` is the number of slots held when the token (or chunk of
  ``chunk_tokens`` tokens) starts: the rate is recomputed as sequences come and go.
* With ``jitter`` J > 0 every prefill and token time is multiplied by ``1 + U(-J, J)``,
  drawn from a ``random.Random`` seeded with ``(seed, request number)``: reproducible.

So a request alone takes ``P / prefill_tps + N / decode_tps`` seconds. Deadlines are
absolute (each token is due one token time after the previous one was due), so sleep
overshoot does not accumulate. Streaming clients get each token (chunk) when it is due.

Token accounting (deterministic, no tokenizer):

* prompt tokens = ``len(text) // 4 + 1`` (as ``tailrace.engines.openai.approx_tokens``),
  where text is the chat messages' contents joined by newlines, or the completion prompt
  (a list of token ids counts its length);
* completion tokens = ``max_tokens`` (``max_completion_tokens`` for chat; default
  ``default_max_tokens``, 16), finish reason ``"length"``. A marker ``[[len=N]]`` in the
  last message (or in the prompt) says the "model" wants N tokens: it then produces
  ``min(N, max_tokens)`` and finishes with ``"stop"`` when N <= max_tokens;
* the text is filler: ``"tok0 tok1 tok2 ..."`` (token i is ``" tok{i}"``, the first
  without the space). ``stop`` sequences, ``temperature`` and the model name are ignored
  (any model name is accepted); ``n`` must be 1.

Other endpoints: ``GET /healthz`` (``{"status": "ok"}``, answers while saturated),
``GET /stats`` (received, served, cancelled, rejected, active, queued, peak_active,
peak_queued, token totals, the config) and ``POST /stats/reset`` (zeroes the counters and
peaks; active and queued stay). There is no tokenize endpoint, so ``OpenAIEngine``
falls back to ``approx_tokens``, which is the same estimate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

#: ``[[len=N]]`` in the last message (or the prompt) sets the wanted completion length
LEN_MARKER = re.compile(r"\[\[len=(\d+)\]\]")

#: the line the CLI prints (stdout) once the server answers; ``spawn`` waits for it
READY_LINE = re.compile(r"^latency_server: listening on (http://\S+/v1)\b")


def estimate_tokens(text: str) -> int:
    """Prompt tokens the server charges for ``text``: 4 characters a token, plus one.

    text: the prompt text.

    >>> estimate_tokens(""), estimate_tokens("abcd"), estimate_tokens("abcdefgh")
    (1, 2, 3)
    """
    return len(text) // 4 + 1


def filler(start: int, count: int) -> str:
    """The text of filler tokens ``start`` .. ``start + count - 1``.

    start: index of the first token.
    count: how many tokens.

    >>> filler(0, 3) + filler(3, 2)
    'tok0 tok1 tok2 tok3 tok4'
    """
    return "".join(f" tok{i}" if i else "tok0" for i in range(start, start + count))


# ---------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class LatencyConfig:
    """The latency model and server knobs (validated on creation; ``ValueError`` if wrong).

    prefill_tps: prompt tokens prefilled per second (> 0).
    decode_tps: output tokens per second of a sequence decoding alone (> 0).
    batch_slowdown: extra token time per other active sequence, a fraction (>= 0).
    max_seqs: sequences holding a slot at once (>= 1); more requests wait FIFO.
    seed: seeds the jitter.
    jitter: relative spread of each prefill and token time, in [0, 1); 0 = deterministic.
    chunk_tokens: tokens produced (and streamed) per wake-up (>= 1); 1 = one SSE chunk each.
    default_max_tokens: completion length when a request sends no max_tokens (>= 0).
    model: the model name ``/v1/models`` lists.
    """

    prefill_tps: float = 4000.0
    decode_tps: float = 40.0
    batch_slowdown: float = 0.05
    max_seqs: int = 8
    seed: int = 0
    jitter: float = 0.0
    chunk_tokens: int = 1
    default_max_tokens: int = 16
    model: str = "latency-model"

    def __post_init__(self) -> None:
        def number(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{_flag(name)} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{_flag(name)} must be finite, got {value!r}")
            return float(value)

        def integer(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{_flag(name)} must be an integer, got {value!r}")
            return value

        for name in ("prefill_tps", "decode_tps"):
            if number(name, getattr(self, name)) <= 0:
                raise ValueError(f"{_flag(name)} must be > 0, got {getattr(self, name)!r}")
        if number("batch_slowdown", self.batch_slowdown) < 0:
            raise ValueError(f"{_flag('batch_slowdown')} must be >= 0, "
                             f"got {self.batch_slowdown!r}")
        if not 0 <= number("jitter", self.jitter) < 1:
            raise ValueError(f"{_flag('jitter')} must be in [0, 1), got {self.jitter!r}")
        for name, low in (("max_seqs", 1), ("chunk_tokens", 1), ("default_max_tokens", 0)):
            if integer(name, getattr(self, name)) < low:
                raise ValueError(f"{_flag(name)} must be >= {low}, got {getattr(self, name)!r}")
        integer("seed", self.seed)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"{_flag('model')} must be a non-empty string, got {self.model!r}")

    def token_time(self, active: int) -> float:
        """Seconds one output token takes while ``active`` sequences hold slots.

        active: sequences holding a slot, this one included.

        >>> round(LatencyConfig(decode_tps=40, batch_slowdown=0.05).token_time(3), 6)
        0.0275
        """
        return (1.0 / self.decode_tps) * (1.0 + self.batch_slowdown * (max(active, 1) - 1))

    def to_args(self) -> list[str]:
        """The command-line flags that give this configuration."""
        args: list[str] = []
        for f in dataclasses.fields(self):
            args += [_flag(f.name), str(getattr(self, f.name))]
        return args


def _flag(name: str) -> str:
    """The command-line flag of a config field: ``decode_tps`` -> ``--decode-tps``."""
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------------ the model


class _Slots:
    """``max_seqs`` sequence slots; waiters are served first in, first out."""

    def __init__(self, limit: int, stats: _Stats):
        self.limit = limit
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._stats = stats

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            self._stats.peak_active = max(self._stats.peak_active, self.active)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._stats.peak_queued = max(self._stats.peak_queued, len(self._waiters))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot was handed over: pass it on
                self.release()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot goes to the waiter; ``active`` is unchanged
                return
        self.active -= 1


@dataclass
class _Stats:
    received: int = 0
    served: int = 0
    cancelled: int = 0
    rejected: int = 0
    peak_active: int = 0
    peak_queued: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Job:
    """One parsed generation request."""

    chat: bool
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    stream: bool
    include_usage: bool
    model: str


class _BadRequest(Exception):
    pass


class LatencyModel:
    """The server's state: the slots, the counters, and the per-sequence timing loop."""

    def __init__(self, config: LatencyConfig):
        self.config = config
        self.stats = _Stats()
        self.slots = _Slots(config.max_seqs, self.stats)
        self.started = time.time()
        self._requests = 0

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /stats`` answers."""
        out: dict[str, Any] = dataclasses.asdict(self.stats)
        out.update(active=self.slots.active, queued=self.slots.queued,
                   uptime_s=round(time.time() - self.started, 3),
                   config=dataclasses.asdict(self.config))
        return out

    def reset(self) -> None:
        """Zero the counters and set the peaks to the current active and queued counts."""
        for f in dataclasses.fields(self.stats):
            setattr(self.stats, f.name, 0)
        self.stats.peak_active, self.stats.peak_queued = self.slots.active, self.slots.queued

    async def sequence(self, job: _Job) -> AsyncIterator[tuple[int, int]]:
        """Hold a slot, prefill, decode: yields ``(first token, count)`` as tokens are due.

        job: the request.
        """
        cfg = self.config
        self._requests += 1
        rng = random.Random(f"{cfg.seed}:{self._requests}") if cfg.jitter else None

        def jittered(seconds: float) -> float:
            return seconds * (1.0 + rng.uniform(-cfg.jitter, cfg.jitter)) if rng else seconds

        loop = asyncio.get_running_loop()
        await self.slots.acquire()
        try:
            due = loop.time() + jittered(job.prompt_tokens / cfg.prefill_tps)
            await _sleep_until(loop, due)
            done = 0
            while done < job.completion_tokens:
                count = min(cfg.chunk_tokens, job.completion_tokens - done)
                due += jittered(count * cfg.token_time(self.slots.active))
                await _sleep_until(loop, due)
                yield done, count
                done += count
        finally:
            self.slots.release()


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    delay = deadline - loop.time()
    await asyncio.sleep(delay if delay > 0 else 0)


# ------------------------------------------------------------------------ the HTTP layer


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": None}}, status_code=status)


def _text_of(content: Any) -> str:
    """The text of a chat message's content: a string, a list of parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    raise _BadRequest("message content must be a string, a list of parts or null")


def _parse(body: Any, chat: bool, config: LatencyConfig) -> _Job:
    """The ``_Job`` for a request body; ``_BadRequest`` with an OpenAI-style message if bad.

    body: the decoded JSON body.
    chat: a /v1/chat/completions request (else /v1/completions).
    config: the server's configuration.
    """
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("'messages' must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise _BadRequest("every message must be an object")
        texts = [_text_of(m.get("content")) for m in messages]
        prompt_tokens, last = estimate_tokens("\n".join(texts)), texts[-1]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_tokens, last = estimate_tokens(prompt), prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_tokens, last = len(prompt), ""
        else:
            raise _BadRequest("'prompt' must be a string or a list of token ids (one prompt "
                              "a request)")
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = config.default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise _BadRequest(f"'max_tokens' must be a non-negative integer, got {max_tokens!r}")
    if body.get("n", 1) not in (1, None):
        raise _BadRequest("this server supports only n=1")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _BadRequest("'response_format' cannot be enforced: this latency-model server "
                          "generates no real text (only {\"type\": \"text\"})")
    marker = LEN_MARKER.search(last)
    if marker is not None and int(marker.group(1)) <= max_tokens:
        completion_tokens, finish = int(marker.group(1)), "stop"
    else:
        completion_tokens, finish = max_tokens, "length"
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    model = body.get("model") if isinstance(body.get("model"), str) else config.model
    return _Job(chat=chat, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                finish_reason=finish, stream=stream, include_usage=include_usage,
                model=model or config.model)


def _usage(job: _Job) -> dict[str, int]:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
            "total_tokens": job.prompt_tokens + job.completion_tokens}


def build_app(config: LatencyConfig) -> tuple[Starlette, LatencyModel]:
    """The ASGI application and its ``LatencyModel`` (for serving it some other way).

    config: the latency model.
    """
    model = LatencyModel(config)
    stats = model.stats
    counter = iter(range(1, 1 << 62))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": config.model, "object": "model", "created": int(model.started),
             "owned_by": "tailrace-bench"}]})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def get_stats(request: Request) -> Response:
        return JSONResponse(model.snapshot())

    async def reset_stats(request: Request) -> Response:
        model.reset()
        return JSONResponse(model.snapshot())

    async def generate(request: Request, chat: bool) -> Response:
        stats.received += 1
        try:
            job = _parse(await request.json(), chat, config)
        except ValueError:  # json.JSONDecodeError
            stats.rejected += 1
            return _error(400, "the request body is not valid JSON")
        except _BadRequest as e:
            stats.rejected += 1
            return _error(400, str(e))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(counter)}"
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": job.model}
        if job.stream:
            return StreamingResponse(_events(job, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            async for _ in model.sequence(job):
                pass
        except asyncio.CancelledError:
            stats.cancelled += 1
            raise
        stats.served += 1
        stats.prompt_tokens += job.prompt_tokens
        stats.completion_tokens += job.completion_tokens
        text = filler(0, job.completion_tokens)
        if chat:
            choice: dict[str, Any] = {"index": 0, "finish_reason": job.finish_reason,
                                      "logprobs": None,
                                      "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "finish_reason": job.finish_reason,
                      "logprobs": None}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else
                             "text_completion", "created": created, "model": job.model,
                             "choices": [choice], "usage": _usage(job)})

    async def _events(job: _Job, head: dict[str, Any]) -> AsyncIterator[bytes]:
        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = json.dumps({**head, "choices": choices, **extra}, separators=(",", ":"))
            return b"data: " + body.encode() + b"\n\n"

        def choice(text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
            if not job.chat:
                return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

        finished = False
        try:
            gen = model.sequence(job)
            async with contextlib.aclosing(gen):
                async for start, count in gen:
                    yield event([choice(filler(start, count), None, start == 0)])
            yield event([choice(None if job.completion_tokens else "", job.finish_reason,
                                job.completion_tokens == 0)])
            if job.include_usage:
                yield event([], usage=_usage(job))
            finished = True
            stats.served += 1
            stats.prompt_tokens += job.prompt_tokens
            stats.completion_tokens += job.completion_tokens
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                stats.cancelled += 1

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    app = Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/stats", get_stats, methods=["GET"]),
        Route("/stats/reset", reset_stats, methods=["POST"]),
    ])
    return app, model


# ---------------------------------------------------------------------------- in-process


def _http_json(url: str, method: str = "GET", timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class ServerHandle:
    """A server running in this process (uvicorn in a daemon thread); a context manager.

    url: the OpenAI API root, ``http://HOST:PORT/v1``.
    root: ``http://HOST:PORT`` (``/healthz`` and ``/stats`` live there).
    """

    def __init__(self, config: LatencyConfig, host: str, port: int):
        import uvicorn

        self.config = config
        self.app, self.model = build_app(config)
        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets, and without it
        # Nagle's algorithm and delayed ACKs add ~40 ms to every small response
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        self.host, self.port = host, int(sock.getsockname()[1])
        shown = f"[{host}]" if ":" in host else host
        self.root = f"http://{shown}:{self.port}"
        self.url = self.root + "/v1"
        self._server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=1, loop="asyncio", http="h11", ws="none"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"latency-server-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                raise RuntimeError(f"latency server on {self.root} did not start")
            time.sleep(0.005)

    def stats(self) -> dict[str, Any]:
        """The server's counters, as ``GET /stats`` answers them."""
        return _http_json(self.root + "/stats")

    def reset_stats(self) -> dict[str, Any]:
        """Zero the counters and peaks (``POST /stats/reset``); returns the new stats."""
        return _http_json(self.root + "/stats/reset", "POST")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving (open streams get ``timeout_graceful_shutdown`` = 1 s) and join."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(config: LatencyConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> ServerHandle:
    """Serve the latency model from a background thread of this process; returns once it
    accepts connections.

    config: the latency model (default ``LatencyConfig()``).
    host: the address to listen on.
    port: the port; 0 picks a free one (see ``handle.port``).
    """
    return ServerHandle(config or LatencyConfig(), host, port)


# ---------------------------------------------------------------------------- subprocess


class SubprocessHandle:
    """A server running as ``python bench/latency_server.py`` in a child process.

    url, root, port: as for ``ServerHandle``. proc: the child. log: its stderr file.
    """

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: str):
        self.proc, self.url, self.log = proc, url, log
        self.root = url[: -len("/v1")]
        self.port = int(self.root.rsplit(":", 1)[1])

    def stats(self) -> dict[str, Any]:
        """The server's counters (``GET /stats``)."""
        return _http_json(self.root + "/stats")

    def reset_stats(self) -> dict[str, Any]:
        """Zero the counters and peaks (``POST /stats/reset``)."""
        return _http_json(self.root + "/stats/reset", "POST")

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the child's stderr."""
        with open(self.log, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the child, SIGKILL it if it has not exited after ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log)

    def __enter__(self) -> SubprocessHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(config: LatencyConfig | None = None, host: str = "127.0.0.1", port: int = 0,
          ready_s: float = 30.0, python: str = sys.executable) -> SubprocessHandle:
    """Start the server in a child process; returns once its ``/v1/models`` answers.

    config: the latency model (default ``LatencyConfig()``).
    host: the address to listen on.
    port: the port; 0 lets the child pick a free one (it reports it on its ready line).
    ready_s: seconds to wait for the server to answer; ``RuntimeError`` after that.
    python: the interpreter to run it with.
    """
    config = config or LatencyConfig()
    fd, log = tempfile.mkstemp(prefix="latency_server-", suffix=".log")
    cmd = [python, os.path.abspath(__file__), *config.to_args(), "--host", host,
           "--port", str(port)]
    with os.fdopen(fd, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL)

    def fail(why: str) -> RuntimeError:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
        with open(log, errors="replace") as f:
            tail = f.read()[-2000:]
        with contextlib.suppress(OSError):
            os.unlink(log)
        return RuntimeError(f"latency server ({' '.join(cmd)}) {why}; stderr:\n{tail}")

    assert proc.stdout is not None
    deadline = time.monotonic() + ready_s
    line = b""
    while b"\n" not in line:
        left = deadline - time.monotonic()
        if left <= 0:
            raise fail(f"did not report ready within {ready_s:g}s")
        readable, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
        if readable:  # the raw descriptor: a buffered read could hide bytes from select
            got = os.read(proc.stdout.fileno(), 4096)
            if not got:
                raise fail(f"exited with code {proc.wait()}")
            line += got
    match = READY_LINE.match(line.split(b"\n")[0].decode(errors="replace"))
    if match is None:
        raise fail(f"printed an unexpected line {line!r}")
    url = match.group(1)
    while True:
        try:
            _http_json(url + "/models", timeout=2.0)
            break
        except (OSError, ValueError, urllib.error.URLError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise fail("did not answer GET /v1/models") from None
            time.sleep(0.05)
    return SubprocessHandle(proc, url, log)


# ---------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (flags mirror ``LatencyConfig``'s fields)."""
    d = LatencyConfig()
    p = argparse.ArgumentParser(
        prog="latency_server.py",
        description="OpenAI-compatible server whose latency follows a continuous-batching "
                    "model; a benchmark tool (no model runs, no CPU is burnt).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    p.add_argument("--port", type=int, default=8101, help="port; 0 picks a free one "
                   "(%(default)s)")
    p.add_argument("--prefill-tps", type=float, default=d.prefill_tps,
                   help="prompt tokens prefilled per second (%(default)s)")
    p.add_argument("--decode-tps", type=float, default=d.decode_tps,
                   help="output tokens per second of a lone sequence (%(default)s)")
    p.add_argument("--batch-slowdown", type=float, default=d.batch_slowdown,
                   help="token time grows by this fraction per other active sequence "
                        "(%(default)s)")
    p.add_argument("--max-seqs", type=int, default=d.max_seqs,
                   help="sequences decoding at once; more wait FIFO (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the jitter (%(default)s)")
    p.add_argument("--jitter", type=float, default=d.jitter,
                   help="relative random spread of every prefill and token time, in [0, 1) "
                        "(%(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                   help="tokens produced and streamed per wake-up (%(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="completion length when a request sends no max_tokens (%(default)s)")
    p.add_argument("--model", default=d.model, help="model name listed (%(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT or SIGTERM.

    argv: the command-line arguments (default ``sys.argv[1:]``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    fields = {f.name for f in dataclasses.fields(LatencyConfig)}
    try:
        config = LatencyConfig(**{k: v for k, v in vars(args).items() if k in fields})
    except ValueError as e:
        parser.error(str(e))
    try:
        handle = start_server(config, args.host, args.port)
    except OSError as e:
        print(f"latency_server: cannot listen on {args.host}:{args.port}: {e}",
              file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"latency_server: listening on {handle.url} (prefill {config.prefill_tps:g} tok/s, "
          f"decode {config.decode_tps:g} tok/s, slowdown {config.batch_slowdown:g}, "
          f"max_seqs {config.max_seqs})", flush=True)
    while not stop.wait(0.5):
        if not handle.running:
            print("latency_server: the server thread stopped", file=sys.stderr)
            return 1
    handle.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
