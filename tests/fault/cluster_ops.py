"""Operators and the gate of tests/fault/test_cluster.py, in a module of their own: the
stage actors import them (a test module would import Hypothesis profiles that only the
test process registers)."""

from __future__ import annotations

import asyncio

from tailrace.control import AdmissionGate, make_policy
from tailrace.request import request_of

MODES = ("ok", "fail", "drop", "slow")


async def work(r):
    """Streams three pieces; 'fail' raises; 'slow' runs ~1.5 s unless its caller leaves."""
    if r["mode"] == "fail":
        raise ValueError(f"record {r['i']} fails on purpose")
    req = request_of(r)
    for k in range(3):
        if req is not None and req.sink is not None:
            req.sink(f"p{k} ")
        await asyncio.sleep(0.01)
    if r["mode"] == "slow":
        for _ in range(150):
            if req.cancel.is_set():
                break
            await asyncio.sleep(0.01)
    return {**r, "out": r["i"] * 10}


def keep(r):
    return r["mode"] != "drop"


def gate():
    return AdmissionGate(make_policy("fcfs", max_in_flight=3, max_queue=3))


