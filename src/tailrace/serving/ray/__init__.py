"""Serving on a Ray cluster: Ray Serve ingress replicas in front of one long-running plan.

``tailrace serve --runtime ray`` (``ClusterServer``) lays a served job out as one hub
actor (``hub.py``: the driver of every pipeline's plan and their one admission gate)
and Ray Serve ingress replicas (``ingress.py``: the same ``create_app`` as a local
server, over handles on the hub), behind the HTTP proxy Serve runs (``proxy.py``:
HAProxy or Serve's Python proxy actor). ``server.py`` starts and stops it all. One room
per job: what runs in the caller, in the hub actor, in Serve's replicas, and the one
choice made before Serve starts. See docs/ray.md, "Serving on a cluster".
"""

from __future__ import annotations

from .ingress import default_outstanding
from .proxy import choose_proxy, default_proxy
from .server import ClusterServer

__all__ = ["ClusterServer", "choose_proxy", "default_outstanding", "default_proxy"]
