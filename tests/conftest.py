"""Shared fixtures. ``run`` runs a pipeline on every executor configuration:
like Bytewax's ``entry_point``, one test covers them all."""

from __future__ import annotations

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
