"""Serving: pipelines hosted continuously behind an OpenAI-compatible HTTP API.

``PipelineService`` runs one compiled pipeline on its own thread and answers
``submit(record)``; ``ServingHub`` holds a process's services, their shared admission
gate and API key; ``create_app(hub)`` (FastAPI, imported on first use) is the HTTP face;
``tailrace serve`` puts it all on uvicorn. See docs/serving.md.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    RecordDropped,
    RequestFailed,
    ServiceError,
    ServiceOverloaded,
    ServiceTimeout,
    ServiceUnavailable,
)
from .hub import ServingHub
from .service import PipelineService

__all__ = ["PipelineService", "RecordDropped", "RequestFailed", "ServiceError", "ServiceOverloaded",
           "ServiceTimeout", "ServiceUnavailable", "ServingHub", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":  # FastAPI loads only when an app is made
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
