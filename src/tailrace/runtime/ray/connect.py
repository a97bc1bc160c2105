"""Import Ray lazily and connect to a cluster, failing fast with a one-line reason."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from ...errors import TailraceError

#: Seconds to wait for a TCP answer from a cluster address before calling it unreachable.
CONNECT_TIMEOUT_S = 3.0


class RayUnavailable(TailraceError):
    """Ray is not installed, or the cluster address does not answer."""


def import_ray() -> Any:
    """The ``ray`` module, or ``RayUnavailable`` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(
            f"--runtime ray needs the 'ray' package ({e}); install it with "
            "pip install 'tailrace[ray]' (ray>=2.30), or use --runtime local") from None
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` or ``ray://host:port``; None for ``auto``/``local``."""
    rest = address.split("://", 1)[1] if "://" in address else address
    if address in ("auto", "local"):
        return None
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayUnavailable(f"--address {address!r} is not a Ray cluster address; give "
                             "HOST:PORT (e.g. 127.0.0.1:6379), ray://HOST:PORT or auto")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ``RayUnavailable`` unless something answers TCP at ``address`` within
    ``timeout`` seconds (``auto``/``local`` are not checked)."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        with socket.create_connection(hp, timeout=timeout):
            pass
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise RayUnavailable(f"cannot reach the Ray cluster at {address}: {reason}; start "
                             "one with `ray start --head` or check --address") from None


def use_local_token() -> bool:
    """Present this machine's Ray auth token when joining a cluster by address.

    ``ray start --head`` (Ray >= 2.5x) turns token authentication on and saves the token
    (``~/.ray/auth_token``), but a client given ``address=HOST:PORT`` only sends it when
    ``RAY_AUTH_MODE=token``: without it every connection is refused as unauthenticated.
    When ``RAY_AUTH_MODE`` is not set and a token is at hand (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or the default file), set it; returns whether it did. Ray
    reads the mode when it is imported: this runs before ``import ray``.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return False
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path)):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    return True


def connect(address: str | None) -> Any:
    """Connect this process to Ray (once); returns the ``ray`` module.

    address: a cluster address (``HOST:PORT``, ``ray://HOST:PORT``, ``auto``); None
             uses the running connection, or ``RAY_ADDRESS``, or starts a local Ray.
    """
    if address and address != "local" and "ray" not in sys.modules:
        use_local_token()
    ray = import_ray()
    if address:
        check_reachable(address)
    if ray.is_initialized():
        if address and address not in ("auto", "local"):
            current = ray.get_runtime_context().gcs_address
            if _host_port(address)[1] != _host_port(current)[1]:  # type: ignore[index]
                raise RayUnavailable(f"this process is already connected to Ray at "
                                     f"{current}; cannot also use --address {address}")
        return ray
    try:
        ray.init(address=address or None, logging_level=logging.WARNING,
                 include_dashboard=False if not address else None)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if address and os.environ.get("RAY_AUTH_MODE") != "token":
            msg += (" (a cluster with token authentication, Ray's default, needs "
                    "RAY_AUTH_MODE=token and its token: RAY_AUTH_TOKEN or ~/.ray/auth_token)")
        raise RayUnavailable(f"cannot connect to Ray at {address or 'a new local instance'}: "
                             f"{msg}") from None
    return ray
