"""Shared fixtures. ``run`` runs a pipeline on every executor configuration:
like Bytewax's ``entry_point``, one test covers them all."""

from __future__ import annotations

import os

import pytest

import tailrace as tr

EXECUTORS = [("local", True), ("local", False)]


@pytest.fixture(params=EXECUTORS, ids=[f"{r}-{'fused' if f else 'unfused'}" for r, f in EXECUTORS])
def run(request):
    runtime, fuse = request.param

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
