"""Collaborative generation (``backend: collab``): a small and a large llama.cpp model
sharing a tokenizer write one answer together, a router picking who writes each span.

``engine`` (``CollaborativeEngine``, its decode loop), ``router`` (features and
routers); training a router by tree search lives in ``tailrace.routing``.
"""

from .engine import CollaborativeEngine, check_spec
from .router import FEATURES, make_router

__all__ = ["FEATURES", "CollaborativeEngine", "check_spec", "make_router"]
