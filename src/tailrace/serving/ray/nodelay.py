"""Nagle's algorithm off on an ingress replica's own HTTP connections, without touching
asyncio or Serve.

Serve's replica server (Ray 2.60) listens on a socket asyncio does not take for TCP, so
every response body waited ~40 ms for a delayed ACK. Serve gives the replica only the
port a request came in on (the ASGI scope), and Linux copies a listener's
``TCP_NODELAY`` onto the connections it accepts: so on the first request the option is
set on this process's sockets bound to that port (``/proc/self/fd``). Without ``/proc``
nothing changes. Why not in asyncio: docs/design.md.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from typing import Any

#: seconds after the first request when the connections on its port are set once more
RECHECK_S = 1.0
FDS = "/proc/self/fd"


def nodelay_on_port(port: int, fds: str = FDS) -> int:
    """Set ``TCP_NODELAY`` on every TCP socket of this process bound to local ``port``
    (a listener and the connections it accepted); returns how many were set."""
    try:
        names = os.listdir(fds)
    except OSError:
        return 0
    done = 0
    for name in names:
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)  # a view of the fd: detached below, not closed
        except (ValueError, OSError):
            continue  # not a number, or closed since the listing
        try:
            if (sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM and sock.getsockname()[1] == port):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                done += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return done


def nodelay_for(scope: Any) -> int:
    """``nodelay_on_port`` for the port an HTTP request's ``scope`` came in on, now and
    again ``RECHECK_S`` later (on the running loop); returns that port (0: none known)."""
    server = scope.get("server")
    port = int(server[1]) if server and len(server) > 1 and server[1] else 0
    if port:
        nodelay_on_port(port)
        asyncio.get_running_loop().call_later(RECHECK_S, nodelay_on_port, port)
    return port


class NoDelay:
    """ASGI middleware: on its first HTTP request, Nagle's algorithm off for the port the
    request came in on (``nodelay_for``); after that, one attribute test per request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port: int | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.port is None and scope["type"] == "http":
            self.port = nodelay_for(scope)
        await self.app(scope, receive, send)
