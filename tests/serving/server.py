"""A real uvicorn server for a ``ServingHub`` on a free loopback port, in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from tailrace.cli.serve import draining_server
from tailrace.serving import ServingHub, create_app


@contextlib.contextmanager
def running(hub: ServingHub, *, start_hub: bool = True, drain_s: float = 30.0,
            mcp: bool = False) -> Iterator[str]:
    """Serve ``hub`` on 127.0.0.1:<free port>; yields the base URL (``http://...:N``).

    hub:       the hub to serve (drained and stopped on exit, as ``tailrace serve`` does).
    start_hub: the server starts the hub's services on its loop and waits until they are
               ready, as ``tailrace serve`` does (False: the test starts them first).
    drain_s:   most seconds each pipeline may take to drain on exit.
    mcp:       also serve ``/mcp`` (``tailrace serve --mcp``: the app's lifespan runs).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NODELAY
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    server = draining_server(uvicorn.Config(create_app(hub, mcp=mcp), log_level="warning",
                                            access_log=False, lifespan="on" if mcp else "off"),
                             hub, drain_s, start_hub)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    if start_hub:
        for s in hub.services.values():
            assert s.wait_ready(120), f"service {s.name} did not start: {s.failure}"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        hub.stop()
        sock.close()
