"""OpenTelemetry tracing: one span per request, one per stage a request passes; off by default.

Off (the default) it costs the runtime one attribute check per micro-batch
(``STATE.tracer is None``) and imports no OpenTelemetry code. On, the serving layer opens a
request span and the record's request carries its context (``Request.trace``: the
service sets it, ``attach_trace`` for a record of a batch run), and after each
micro-batch the runtime calls ``stage_spans``, which creates one span per tagged record:
from its arrival in the stage's queue to the end of the operator call, with the queue
wait as an attribute and an event where service began.
Generate stages follow the OpenTelemetry GenAI conventions (``gen_ai.*``: operation,
provider, model, request parameters, usage tokens when the stage records ``usage``).

    configure_tracing("http://127.0.0.1:4318")      # OTLP/HTTP; or OTEL_EXPORTER_OTLP_ENDPOINT
    configure_tracing(exporter=InMemorySpanExporter())  # tests
    shutdown_tracing()                               # flush, then off again
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from ..errors import TailraceError
from ..request import REQUEST, Request, request_of

ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"


class TracingError(TailraceError):
    """Tracing was asked for but cannot be set up (bad endpoint, missing package)."""


#: The process-wide switch the runtime reads once per micro-batch (``tracer`` None: off).
STATE = SimpleNamespace(tracer=None, provider=None)


def _traces_url(endpoint: str, where: str) -> str:
    """The OTLP/HTTP traces URL for a collector base URL (``/v1/traces`` appended)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingError(f"{where}: OTLP endpoint must be an http(s) URL like "
                           f"http://127.0.0.1:4318, got {endpoint!r}")
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1/traces") else url + "/v1/traces"


def configure_tracing(endpoint: str | None = None, exporter: Any = None, *,
                      service_name: str = "tailrace") -> bool:
    """Turn tracing on if an exporter or an OTLP endpoint is given; returns whether it is on.

    endpoint: OTLP/HTTP collector base URL; None reads ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    exporter: a span exporter to use instead (e.g. the SDK's ``InMemorySpanExporter``).
    service_name: the ``service.name`` resource attribute of every span.
    """
    where = "--otlp-endpoint"
    if endpoint is None and exporter is None:
        endpoint = os.environ.get(ENV_ENDPOINT) or None
        where = ENV_ENDPOINT
    if endpoint is None and exporter is None:
        return False
    url = _traces_url(endpoint, where) if exporter is None and endpoint else None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError as e:
        raise TracingError(f"tracing needs opentelemetry-sdk ({e}); install "
                           "'tailrace[serve]'") from None
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=url)
        processor: Any = BatchSpanProcessor(exporter)
    else:
        processor = SimpleSpanProcessor(exporter)
    shutdown_tracing()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(processor)
    STATE.provider = provider
    STATE.tracer = provider.get_tracer("tailrace")
    return True


def shutdown_tracing() -> None:
    """Flush pending spans and turn tracing off."""
    provider, STATE.provider, STATE.tracer = STATE.provider, None, None
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    """Whether tracing is on."""
    return STATE.tracer is not None


@contextmanager
def request_span(name: str, attributes: dict[str, Any] | None = None) -> Iterator[Any]:
    """Open the current request's server span ``name`` (``POST /v1/chat/completions``) with
    ``attributes``, or yield None when tracing is off."""
    tracer = STATE.tracer
    if tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span(name, kind=SpanKind.SERVER, attributes=attributes) as span:
        yield span


def current_trace(pipeline: str | None = None) -> Any:
    """The current request span's context for a request entering ``pipeline`` (the span
    gets ``tailrace.pipeline``), or None: tracing off or no span current."""
    if STATE.tracer is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    if pipeline is not None:
        span.set_attribute("tailrace.pipeline", pipeline)
    return ctx


def attach_trace(record: Any, pipeline: str | None = None) -> Any:
    """A (dict) record about to enter ``pipeline``, its request tagged with the current
    request span so its stage spans join that trace (a copy with a request of its own if
    it had none); the record itself when tracing is off, no span is current or it is not
    a dict."""
    ctx = current_trace(pipeline) if isinstance(record, dict) else None
    if ctx is None:
        return record
    req = request_of(record)
    if req is None:
        return {**record, REQUEST: Request(trace=ctx)}
    req.trace = ctx
    return record


def _trace_of(record: Any) -> Any:
    req = request_of(record)
    return req.trace if req is not None else None


@dataclass(frozen=True)
class _StageInfo:
    """What every span of one plan stage shares, computed once per stage."""

    name: str
    attributes: dict[str, Any]
    usage_field: str | None


_INFO: dict[int, tuple[Any, _StageInfo]] = {}


def _stage_info(stage: Any) -> _StageInfo:
    hit = _INFO.get(id(stage))
    if hit is not None and hit[0] is stage:
        return hit[1]
    ops = stage.ops
    attrs: dict[str, Any] = {"tailrace.stage": stage.id,
                             "tailrace.ops": [o.id for o in ops],
                             "tailrace.op": [o.op.name for o in ops]}
    name, usage = f"stage {stage.id}", None
    gen = next((o for o in ops if o.op.name == "generate"), None)
    if gen is not None:
        spec = gen.params.get("_engine") or {}
        model = str(spec.get("model", gen.params.get("engine", "unknown")))
        backend = str(spec.get("backend", "unknown"))
        attrs.update({"gen_ai.operation.name": "chat", "gen_ai.provider.name": backend,
                      "gen_ai.system": backend, "gen_ai.request.model": model,
                      "gen_ai.request.max_tokens": gen.params.get("max_tokens", 0),
                      "gen_ai.request.temperature": float(gen.params.get("temperature", 0))})
        name, usage = f"chat {model}", gen.params.get("usage")
    info = _StageInfo(name, attrs, usage)
    if len(_INFO) >= 1024:  # plans come and go in a long-lived process: stay bounded
        _INFO.clear()
    _INFO[id(stage)] = (stage, info)
    return info


def stage_spans(tracer: Any, stage: Any, batch: list, ports: dict, errors: list,
                enqueued: float, started: float, ended: float) -> None:
    """One span per traced record of the micro-batch ``batch`` the ``PlanStage`` ``stage``
    just ran, given its outputs by port and its ``ErrorRecord``s; ``enqueued``, ``started``
    and ``ended`` are ``perf_counter()`` times (entered the queue, service began and ended).
    """
    traced = [(r, ctx) for r in batch if (ctx := _trace_of(r)) is not None]
    if not traced:
        return
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, Status, StatusCode

    wall, now = time.time_ns(), perf_counter()

    def ns(t: float) -> int:
        return wall - int((now - t) * 1e9)

    info = _stage_info(stage)
    failed = {id(ctx): e for e in errors if (ctx := _trace_of(e.input)) is not None}
    outputs: dict[int, dict] = {}
    if info.usage_field is not None:
        for records in ports.values():
            for r in records:
                if (ctx := _trace_of(r)) is not None:
                    outputs[id(ctx)] = r
    wait_us, svc_us = (started - enqueued) * 1e6, (ended - started) * 1e6
    t_enq, t_start, t_end = ns(enqueued), ns(started), ns(ended)
    for _, ctx in traced:
        span = tracer.start_span(info.name, trace.set_span_in_context(NonRecordingSpan(ctx)),
                                 attributes=info.attributes, start_time=t_enq)
        span.set_attribute("tailrace.queue_wait_us", wait_us)
        span.set_attribute("tailrace.service_us", svc_us)
        span.set_attribute("tailrace.batch_size", len(batch))
        span.add_event("service.start", timestamp=t_start)
        out = outputs.get(id(ctx))
        usage = out.get(info.usage_field) if out is not None else None
        if isinstance(usage, dict):
            span.set_attribute("gen_ai.usage.input_tokens", usage.get("prompt_tokens", 0))
            span.set_attribute("gen_ai.usage.output_tokens", usage.get("completion_tokens", 0))
        err = failed.get(id(ctx))
        if err is not None:
            span.set_attribute("error.type", err.error)
            span.set_status(Status(StatusCode.ERROR, err.message))
        span.end(end_time=t_end)
