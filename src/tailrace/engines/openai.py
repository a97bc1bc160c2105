"""An engine for any OpenAI-compatible HTTP server (vLLM, SGLang, Ollama, llama.cpp's server).

Uses the official ``openai`` package, imported when an engine is created. Generation always
streams, so ``on_token`` sees pieces as the server sends them; a batch's requests run
concurrently on a thread pool. Failures become ``EngineError`` (``ContextOverflow`` when the
server says the prompt does not fit) with a one-line message naming the server and model.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import ContextOverflow, EngineError
from .base import Generation, GenerationRequest, TokenCallback
from .tokens import approx_tokens
from .tool_calls import CALL_CLOSE, CALL_OPEN, format_call

#: server messages (HTTP 400/413) that mean "the prompt does not fit in the context window"
_OVERFLOW = re.compile(
    r"context.{0,40}(length|window|size|limit)|exceed.{0,60}context|maximum context|n_ctx"
    r"|too long|too many tokens", re.IGNORECASE)

#: tokenizer endpoints tried once, relative to the server root (``base_url`` minus ``/v1``):
#: llama-cpp-python's server, then vLLM / SGLang / llama.cpp's ``llama-server``.
_TOKENIZE_PATHS = ("/extras/tokenize", "/tokenize")


def _one_line(text: str, limit: int = 300) -> str:
    """``text`` with whitespace collapsed, cut to ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _server_message(exc: Any) -> str:
    """The server's own error message from an ``openai.APIStatusError`` (else the SDK's)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        if body.get("detail"):
            return str(body["detail"])
    elif isinstance(body, str) and body:
        return body
    return str(getattr(exc, "message", exc))


class OpenAIEngine:
    """Generation or embedding engine talking to an OpenAI-compatible server.

    A chat request's ``response_format`` is passed on to the server, which enforces it.
    """

    #: ``GenerationRequest.response_format`` types passed on (chat requests)
    response_formats = frozenset({"json_object", "json_schema"})
    #: client tools pass through to the server; its calls come back in the call form
    tool_calls = True
    #: the calls the server batches itself (its scheduler); embeddings are batched in front
    #: of it (one /v1/embeddings request takes a list)
    continuous_batching = frozenset({"generate"})

    def __init__(self, base_url: str, model: str, *, kind: str = "generate",
                 api_key: str | None = None, api_key_env: str | None = None,
                 timeout_s: float = 60.0, retries: int = 2, context_length: int = 4096,
                 concurrency: int = 8, dim: int | None = None, embed_batch: int = 64):
        """Create the client (no request is sent until the first call).

        base_url: the server's OpenAI API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name the server knows (sent as ``model`` in every request).
        kind: ``"generate"`` (chat and completion requests) or ``"embed"`` (embeddings).
        api_key: the API key; else ``$api_key_env``; else ``"not-needed"``.
        api_key_env: the environment variable holding the API key.
        timeout_s: seconds to wait for a response (and between streamed pieces).
        retries: times the SDK retries connection errors, 408/409/429 and 5xx responses.
        context_length: the model's context window in tokens (as configured on the server).
        concurrency: the most requests of one batch in flight at once.
        dim: the embedding size, if known (``kind="embed"``); else learnt on the first call.
        embed_batch: the most texts sent in one /v1/embeddings request.
        """
        if kind not in ("generate", "embed"):
            raise EngineError(f"openai engine: kind must be 'generate' or 'embed', not {kind!r}")
        try:
            import openai
        except ImportError:
            raise EngineError("the openai backend needs the 'openai' package; install it with: "
                              "pip install openai") from None
        if api_key is None and api_key_env:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise EngineError(f"openai engine at {base_url}: the environment variable "
                                  f"'{api_key_env}' (api_key_env) is not set")
        self._openai = openai
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.kind = kind
        self.context_length = int(context_length)
        self.timeout_s = float(timeout_s)
        self._api_key = api_key or "not-needed"
        self._retries = int(retries)
        self._client = openai.OpenAI(base_url=self.base_url, api_key=self._api_key,
                                     timeout=self.timeout_s, max_retries=self._retries)
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(concurrency)),
                                        thread_name_prefix="openai-engine")
        self._dim = int(dim) if dim else None
        self.embed_batch = max(1, int(embed_batch))
        self.pooling = "server"  # or "client-mean" once per-token embeddings were pooled here
        self._lock = threading.Lock()
        self._tokenize_path: str | None = None  # the endpoint that worked
        self._tokenize_probed = False
        self._closed = False

    # ------------------------------------------------------------------ errors

    def _where(self) -> str:
        return f"openai engine at {self.base_url} (model '{self.model}')"

    def _timed_out(self, what: str = "request") -> EngineError:
        return EngineError(f"{self._where()}: {what} timed out after {self.timeout_s:g}s")

    def _error(self, exc: BaseException) -> EngineError:
        """The ``EngineError`` (or ``ContextOverflow``) for what the SDK (or httpx) raised."""
        openai = self._openai
        if isinstance(exc, EngineError):
            return exc
        if isinstance(exc, openai.APITimeoutError):
            return self._timed_out()
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__ or exc.__context__
            detail = _one_line(str(cause)) if cause is not None and str(cause) else exc.message
            return EngineError(f"{self._where()}: cannot connect ({detail})")
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            message = _one_line(_server_message(exc))
            if status in (400, 413, 422) and _OVERFLOW.search(message):
                return ContextOverflow(f"{self._where()}: prompt does not fit the context "
                                       f"window (server {status}: {message})")
            return EngineError(f"{self._where()}: server error {status}: {message}")
        if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2"):
            if "Timeout" in type(exc).__name__:
                return self._timed_out()
            return EngineError(f"{self._where()}: connection lost while reading the response "
                               f"({type(exc).__name__}: {_one_line(str(exc))})")
        if isinstance(exc, openai.APIError):  # an error event inside a stream
            return EngineError(f"{self._where()}: server error: {_one_line(exc.message)}")
        return EngineError(f"{self._where()}: {type(exc).__name__}: {_one_line(str(exc))}")

    def _check_kind(self, kind: str) -> None:
        if self._closed:
            raise EngineError(f"{self._where()}: engine is closed")
        if self.kind != kind:
            raise EngineError(f"{self._where()}: this engine was created with kind="
                              f"'{self.kind}' and cannot {kind}; create one with kind='{kind}'")

    # ------------------------------------------------------------------ tokens

    def _tokenize(self, path: str, text: str) -> int | None:
        """Tokens in ``text`` by the endpoint ``path`` (relative to the server root); None
        if the endpoint is unusable."""
        # one body for every server's field name: llama-cpp-python reads "input", vLLM and
        # SGLang "prompt", llama.cpp's llama-server "content"
        body = json.dumps({"model": self.model, "input": text, "prompt": text, "content": text,
                           "add_special_tokens": False}).encode()
        req = urllib.request.Request(
            self.base_url.removesuffix("/v1") + path, data=body, method="POST",
            headers={"Content-Type": "application/json",
                     "Authorization": f"Bearer {self._api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                data = json.loads(resp.read())
        except urllib.error.HTTPError:
            return None
        except (TimeoutError, urllib.error.URLError) as e:
            if isinstance(e, TimeoutError) or isinstance(e.reason, TimeoutError):
                raise self._timed_out("tokenize request") from None
            raise EngineError(f"{self._where()}: cannot connect ({_one_line(str(e.reason))})"
                              ) from None
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        if isinstance(data.get("count"), int):
            return int(data["count"])
        if isinstance(data.get("tokens"), list):
            return len(data["tokens"])
        return None

    def count_tokens(self, text: str) -> int:
        """Tokens ``text`` takes: the server's tokenizer if it has one (the first call tries
        ``_TOKENIZE_PATHS`` and remembers which works), else ``approx_tokens``."""
        with self._lock:
            probed, path = self._tokenize_probed, self._tokenize_path
        if path is not None:
            n = self._tokenize(path, text)
            if n is None:
                raise EngineError(f"{self._where()}: tokenize request to {path} failed")
            return n
        if probed:
            return approx_tokens(text)
        for candidate in _TOKENIZE_PATHS:
            n = self._tokenize(candidate, text)
            if n is not None:
                with self._lock:
                    self._tokenize_probed, self._tokenize_path = True, candidate
                return n
        with self._lock:
            self._tokenize_probed = True
        return approx_tokens(text)

    @property
    def tokenizer(self) -> str:
        """Which count ``count_tokens`` gives: the endpoint path, ``"approx"`` or ``"unknown"``."""
        if self._tokenize_path is not None:
            return self._tokenize_path
        return "approx" if self._tokenize_probed else "unknown"

    # -------------------------------------------------------------- generation

    def generate(self, requests: Sequence[GenerationRequest],
                 on_token: TokenCallback | None = None) -> list[Generation]:
        """Run the requests concurrently, streaming; results in request order.

        requests: chat requests (``messages``) or completion requests (``prompt``).
        on_token: called as ``on_token(index, piece)`` for each streamed piece of text.

        If any request fails the others are stopped and the first failure (in request order)
        is raised: ``ContextOverflow`` if the server says the prompt does not fit, else
        ``EngineError``.
        """
        self._check_kind("generate")
        for req in requests:
            if (req.prompt is None) == (req.messages is None):
                raise EngineError(f"{self._where()}: a request needs exactly one of 'prompt' "
                                  "and 'messages'")
            if req.response_format is not None and req.messages is None:
                raise EngineError(f"{self._where()}: response_format is passed on with chat "
                                  "requests only ('messages'), not with a raw 'prompt'")
        if not requests:
            return []
        cancel = threading.Event()

        def stop_others_on_failure(fut: Future[Generation]) -> None:
            if not fut.cancelled() and fut.exception() is not None:
                cancel.set()

        futures: list[Future[Generation]] = []
        for i, req in enumerate(requests):
            futures.append(self._pool.submit(self._run_one, i, req, on_token, cancel))
            futures[-1].add_done_callback(stop_others_on_failure)
        results: list[Generation] = []
        first_error: Exception | None = None
        for fut in futures:
            try:
                results.append(fut.result())
            except Exception as e:
                first_error = first_error or e
        if first_error is not None:
            raise self._error(first_error) from first_error
        return results

    def _create(self, req: GenerationRequest, stream: bool, client: Any = None) -> Any:
        """Send ``req`` to /v1/chat/completions (messages) or /v1/completions (prompt), with
        ``client`` (default: the engine's); ``stream`` asks for server-sent events (with usage
        in the last event, if supported)."""
        client = client or self._client
        kwargs: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens,
                                  "temperature": req.temperature}
        if stream:
            kwargs.update(stream=True, stream_options={"include_usage": True})
        optional = {"stop": list(req.stop) or None, "seed": req.seed,
                    "top_p": req.top_p if req.top_p != 1.0 else None,
                    "presence_penalty": req.presence_penalty or None,
                    "frequency_penalty": req.frequency_penalty or None,
                    "response_format": req.response_format}
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        if req.tools is not None and req.messages is not None:
            kwargs.update(_tool_fields(req.tools))
        if req.messages is not None:
            return client.chat.completions.create(
                messages=[dict(m) for m in req.messages], **kwargs)
        return client.completions.create(prompt=req.prompt or "", **kwargs)

    def _run_one(self, index: int, req: GenerationRequest, on_token: TokenCallback | None,
                 cancel: threading.Event) -> Generation:
        """Stream request ``index`` of its batch and collect its text, usage and finish
        reason; ``cancel`` (another request of the batch failed) stops it early."""
        if cancel.is_set():  # another request failed before this one started
            return Generation("", 0, 0, "stop", extra={"cancelled": True})
        chat = req.messages is not None
        pieces: list[str] = []
        n_events = 0
        finish: str | None = None
        usage: Any = None
        calls = _CallText() if chat and req.tools is not None else None
        with self._create(req, stream=True) as stream:  # leaving it closes the connection
            for chunk in stream:
                n_events += 1
                if cancel.is_set():
                    break
                if getattr(chunk, "usage", None) is not None:
                    usage = chunk.usage
                for choice in chunk.choices or ():
                    source = getattr(choice, "delta", None) if chat else choice
                    piece = getattr(source, "content" if chat else "text", None) or ""
                    if calls is not None:
                        piece += calls.delta(getattr(source, "tool_calls", None))
                    if piece:
                        pieces.append(piece)
                        if on_token is not None and on_token(index, piece) is False:
                            finish = "cancelled"  # the caller stopped it: the server stops
                            break                 # when the connection closes
                    if choice.finish_reason:
                        finish = choice.finish_reason
                if finish == "cancelled":
                    break
        rest = calls.close() if calls is not None and finish != "cancelled" else ""
        if rest:  # the last call's close
            pieces.append(rest)
            if on_token is not None:
                on_token(index, rest)
        if n_events == 0 and not cancel.is_set():
            # Some servers (llama-cpp-python's) validate a streamed request only after
            # answering 200, and on failure close the stream empty; asked again without
            # streaming they answer with the real HTTP error (or the generation).
            return self._run_unstreamed(index, req, on_token)
        if finish is None and not cancel.is_set():
            raise EngineError(f"{self._where()}: the stream ended after {len(pieces)} pieces "
                              "without a finish reason (connection lost or server failure)")
        return self._generation(req, "".join(pieces), finish, usage, len(pieces))

    def _run_unstreamed(self, index: int, req: GenerationRequest,
                        on_token: TokenCallback | None) -> Generation:
        """Send ``req`` without streaming; ``on_token`` gets the whole text as one piece."""
        # the server may drop the connection the failed stream came on: retry at least once
        client = self._client.with_options(max_retries=max(1, self._retries))
        resp = self._create(req, stream=False, client=client)
        if not resp.choices:
            raise EngineError(f"{self._where()}: the server answered without choices")
        choice = resp.choices[0]
        text = (choice.message.content if req.messages is not None else choice.text) or ""
        if req.messages is not None and getattr(choice.message, "tool_calls", None):
            text += "".join(format_call(c.function.name, c.function.arguments)
                            for c in choice.message.tool_calls)
        if text and on_token is not None:
            on_token(index, text)
        gen = self._generation(req, text, choice.finish_reason, resp.usage, 1 if text else 0)
        gen.extra["streamed"] = False
        return gen

    def _generation(self, req: GenerationRequest, text: str, finish: str | None, usage: Any,
                    n_pieces: int) -> Generation:
        """The ``Generation`` for a finished request, with the server's token counts
        (``usage``, None if it sent none) or estimated ones: the prompt counted here and
        ``n_pieces``, the streamed pieces (one token each on the servers we know)."""
        extra: dict[str, Any] = {"finish_reason": finish, "streamed": True}
        if usage is not None and getattr(usage, "completion_tokens", None) is not None:
            prompt_tokens = int(usage.prompt_tokens or 0)
            completion_tokens = int(usage.completion_tokens)
            extra["usage"] = "server"
        else:  # no usage from the server: count the prompt's text and the streamed pieces
            source = req.prompt if req.messages is None else "\n".join(
                m.get("content", "") for m in req.messages)
            prompt_tokens, completion_tokens = self.count_tokens(source or ""), n_pieces
            extra["usage"] = "estimated"
        return Generation(text=text, prompt_tokens=prompt_tokens,
                          completion_tokens=completion_tokens,
                          finish_reason=finish if finish in ("length", "cancelled") else "stop",
                          extra=extra)

    # --------------------------------------------------------------- embedding

    @property
    def dim(self) -> int:
        """The embedding size; asks the server (embedding one short text) if not yet known."""
        if self._dim is None:
            self.embed(["dimension probe"])
        assert self._dim is not None
        return self._dim

    def embed(self, texts: Sequence[str]) -> Any:
        """Embed ``texts`` by ``/v1/embeddings`` (``embed_batch`` to a request): float32
        array, one L2-normalised row each.

        A server that returns one vector per token (llama-cpp-python's, for a model without a
        pooling type) has them mean-pooled here (``pooling`` becomes ``"client-mean"``) and is
        then sent one text per request: llama-cpp-python 0.3 misaligns the token vectors of
        every input of a batch but the first.
        """
        import numpy as np

        self._check_kind("embed")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        texts = list(texts)
        vectors: list[Any] = []
        step = 1 if self.pooling == "client-mean" else self.embed_batch
        i = 0
        while i < len(texts):
            batch = texts[i:i + step]
            got, per_token = self._embed_request(batch)
            if per_token and len(batch) > 1:  # redo this batch one text per request
                self.pooling, step = "client-mean", 1
                continue
            if per_token:
                self.pooling = "client-mean"
            vectors.extend(got)
            i += len(batch)
        if len({v.shape[0] for v in vectors}) != 1:
            raise EngineError(f"{self._where()}: the server returned embeddings of different "
                              "sizes")
        arr = np.stack(vectors)
        if self._dim is None:
            self._dim = int(arr.shape[1])
        elif arr.shape[1] != self._dim:
            raise EngineError(f"{self._where()}: embeddings have {arr.shape[1]} dimensions, "
                              f"expected {self._dim}")
        norms = np.linalg.norm(arr, axis=1, keepdims=True)
        return (arr / np.where(norms > 0, norms, 1.0)).astype(np.float32, copy=False)

    def _embed_request(self, batch: list[str]) -> tuple[list[Any], bool]:
        """One /v1/embeddings request: a float32 vector per text, and whether they were pooled."""
        import numpy as np

        try:
            resp = self._client.embeddings.create(model=self.model, input=batch,
                                                  encoding_format="float")
        except Exception as e:
            raise self._error(e) from e
        rows = sorted(resp.data, key=lambda d: d.index)
        if len(rows) != len(batch):
            raise EngineError(f"{self._where()}: asked for {len(batch)} embeddings, the server "
                              f"returned {len(rows)}")
        vectors, per_token = [], False
        for row in rows:
            vec = np.asarray(row.embedding, dtype=np.float32)
            if vec.ndim == 2:  # one vector per token (a server without pooling): mean-pool
                vec, per_token = vec.mean(axis=0), True
            if vec.ndim != 1 or vec.size == 0:
                raise EngineError(f"{self._where()}: an embedding has shape {vec.shape}, "
                                  "expected (dim,)")
            vectors.append(vec)
        return vectors, per_token

    def close(self) -> None:
        """Close the HTTP client and the request threads."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()


def _tool_fields(spec: Any) -> dict[str, Any]:
    """A request's client tools (``tool_calls.ToolSpec``) as the chat API's fields."""
    choice: Any = spec.choice if spec.choice in ("auto", "none", "required") else \
        {"type": "function", "function": {"name": spec.choice}}
    out: dict[str, Any] = {"tools": [{"type": "function", "function": dict(f)}
                                     for f in spec.functions], "tool_choice": choice}
    if not spec.parallel:
        out["parallel_tool_calls"] = False
    return out


class _CallText:
    """Streamed ``delta.tool_calls`` as the call form's text (``tool_calls.py``): a call's
    head when its index first shows, its arguments as they come, its close before the
    next call's head and at the end."""

    def __init__(self) -> None:
        self.index: int | None = None
        self.args = False

    def delta(self, calls: Any) -> str:
        out = ""
        for c in calls or ():
            fn = getattr(c, "function", None)
            if c.index != self.index:
                out += self.close()
                self.index, self.args = c.index, False
                name = getattr(fn, "name", None) or ""
                out += f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": '
            piece = getattr(fn, "arguments", None) or ""
            self.args = self.args or bool(piece)
            out += piece
        return out

    def close(self) -> str:
        if self.index is None:
            return ""
        self.index = None
        return ("" if self.args else "{}") + "}" + CALL_CLOSE
