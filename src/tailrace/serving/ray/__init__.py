"""Serving on a Ray cluster (``tailrace serve --runtime ray``): one hub actor (``hub.py``,
driving every pipeline's plan behind one admission gate), Ray Serve ingress replicas
(``ingress.py``) behind the proxy ``proxy.py`` chose, started and stopped by
``server.py``'s ``ClusterServer``. See docs/ray.md, "Serving on a cluster".
"""

from __future__ import annotations

from .ingress import default_outstanding
from .proxy import choose_proxy, default_proxy
from .server import ClusterServer

__all__ = ["ClusterServer", "choose_proxy", "default_outstanding", "default_proxy"]
