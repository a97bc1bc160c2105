"""The typed request envelope (``tailrace/request.py``): records carry user fields and at
most one reference to their request; what a request carries crosses processes as data."""

from __future__ import annotations

import asyncio
import pickle
import threading
from pathlib import Path

import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.request import REQUEST, Cancel, Reply, Request, request_of, strip
from tailrace.runtime.ray.served import HostRequests, ServedRequests
from tailrace.serving import PipelineService
from tailrace.serving.errors import ServiceError

SRC = Path(__file__).resolve().parent.parent / "src" / "tailrace"
#: the control fields records used to carry, one by one
OLD_FIELDS = ("_rid", "_cancel", "_stream", "_options", "_urgency", "_urgent", "_session",
              "_finish", "_usage", "_admission", "_trace")

SEEN: list[tuple[str, frozenset, object]] = []
_LOCK = threading.Lock()


def _seen(stage: str):
    def look(r: dict) -> dict:
        with _LOCK:
            SEEN.append((stage, frozenset(r), r.get(REQUEST)))
        return r
    return look


def _fan(r: dict) -> list[dict]:
    return [{**r, "k": k} for k in range(2)]


def test_no_source_file_writes_an_old_control_field_into_a_record():
    bad = [f"{p.relative_to(SRC)}: {f}" for p in SRC.rglob("*.py") for f in OLD_FIELDS
           if f'"{f}"' in p.read_text() or f"'{f}'" in p.read_text()]
    assert not bad, bad


def test_a_served_record_holds_only_user_fields_and_its_request_at_every_stage():
    SEEN.clear()
    p = tr.Pipeline("typed")
    (p.source(fields=["q"]).map(_seen("a"), id="a", timeout_ms=5000)  # an attempt's copy
     .flat_map(_fan, id="fan").map(_seen("b"), id="b").filter(lambda r: r["k"] == 1, id="f")
     .map(_seen("c"), id="c", retries=1).sink())
    gate = AdmissionGate(make_policy("slo", max_in_flight=2))
    svc = PipelineService(p, admission=gate).start()
    try:
        assert svc.wait_ready(30), svc.failure
        asked = Request(asked={"priority": "interactive"}, session="s1", options={"x": 1})

        async def main():
            return await asyncio.gather(svc.submit({"q": "one"}, request=asked),
                                        svc.submit({"q": "two"}))

        one, two = asyncio.run(main())
    finally:
        svc.stop()
        gate.close()
    assert one == {"q": "one", "k": 1} and two == {"q": "two", "k": 1}  # user fields only
    assert {s for s, _, _ in SEEN} == {"a", "b", "c"}
    for stage, keys, req in SEEN:
        assert keys - {"q", "k"} == {REQUEST}, (stage, keys)
        assert isinstance(req, Request)
    # the request that reached the stages is the caller's own, admission filled it in
    mine = [req for _, _, req in SEEN if req.rid == asked.rid]
    assert mine and all(r.session == "s1" and r.options == {"x": 1} for r in mine)
    assert asked.granted is not None and asked.granted[0] == 2  # interactive's class
    assert any(r is asked for r in mine)


def test_a_batch_run_under_admission_gives_sinks_user_fields_only():
    p = tr.Pipeline("b")
    p.source([{"x": i} for i in range(5)]).map(
        lambda r: {**r, "had_request": isinstance(request_of(r), Request)}).sink()
    gate = AdmissionGate(make_policy("fcfs", max_in_flight=2))
    try:
        out = tr.run(p, admission=gate)
    finally:
        gate.close()
    assert sorted(r["x"] for r in out.outputs) == list(range(5))
    assert all(set(r) == {"x", "had_request"} and r["had_request"] for r in out.outputs)


def test_submit_refuses_a_record_that_names_the_reserved_key():
    p = tr.Pipeline("r")
    p.source(fields=["q"]).map(lambda r: r).sink()
    svc = PipelineService(p).start()
    try:
        assert svc.wait_ready(30)
        with pytest.raises(ServiceError, match="the record field '_request' is reserved"):
            asyncio.run(svc.submit({"q": 1, REQUEST: "mine"}))
    finally:
        svc.stop()


def test_a_request_pickles_as_its_data_and_the_receiver_binds_live_parts():
    pieces: list[str] = []
    req = Request(sink=pieces.append, options={"temperature": 0.5}, answers="answer",
                  asked={"priority": 1}, granted=(1, 99.0), session="s", ticket=object(),
                  messages=[{"role": "user", "content": "hi"}], tenant="t")
    req.cancel.set()
    req.report("answer", "stop", {"prompt_tokens": 3, "completion_tokens": 2})
    there = pickle.loads(pickle.dumps({"q": 1, REQUEST: req}))[REQUEST]
    assert there == req and there is not req  # equal by id
    assert (there.options, there.answers, there.asked, there.granted, there.session,
            there.messages, there.tenant) == (req.options, "answer", {"priority": 1},
                                              (1, 99.0), "s", req.messages, "t")
    assert there.ticket is None  # a ticket never leaves its gate's process
    assert there.cancel.is_set() and there.cancel is not req.cancel
    assert there.reply == Reply("stop", {"prompt_tokens": 3, "completion_tokens": 2})
    with pytest.raises(RuntimeError, match="before its receiver bound one"):
        there.sink("x")  # streams, but nobody bound a sink here yet

    async def host_side():
        queued: list = []
        host = HostRequests(lambda rid, piece, at: queued.append((rid, piece, at)))
        fresh = pickle.loads(pickle.dumps(Request(rid=7, sink=pieces.append)))
        host.bind([{REQUEST: fresh}])
        assert not fresh.cancel.is_set()
        fresh.sink("a")
        fresh.sink("b")
        host.cancel([7])
        assert fresh.cancel.is_set()
        late = pickle.loads(pickle.dumps(Request(rid=7)))
        host.bind([{REQUEST: late}])  # arrives after the cancel: its flag is set too
        assert late.cancel.is_set()
        await asyncio.sleep(0)
        return queued, fresh.streamed

    queued, streamed = asyncio.run(host_side())
    assert queued == [(7, "a", 1), (7, "b", 2)] and streamed == 2


def test_the_driver_gives_returning_records_the_live_request_and_its_reply():
    delivered: list = []
    served = ServedRequests(lambda target, records, born, sent: delivered.extend(records))
    pieces: list[str] = []
    live = Request(sink=pieces.append, answers="answer")
    served.hold([{"q": 1, REQUEST: live}])
    back = pickle.loads(pickle.dumps({"q": 1, "answer": "hi", REQUEST: live}))
    back[REQUEST].reply = Reply("stop", {"prompt_tokens": 1, "completion_tokens": 1})
    back[REQUEST].streamed = 2

    async def driver_side():
        expected = served.arrived([back])
        assert back[REQUEST] is live and live.reply.finish == "stop"
        assert expected == {live.rid: 2}
        ready = served.ready(0, [back], expected, 0.0, 0.0)
        assert ready == []  # its two pieces have not reached the caller yet
        served.pieces({live.rid: (1, ["h", "i"])})
        assert pieces == ["h", "i"] and delivered == [back]

    asyncio.run(driver_side())
    served.forget([back])
    assert served.entries == {}


def test_strip_and_cancel_children():
    r = {"q": 1, REQUEST: Request()}
    assert strip(r) == {"q": 1} and REQUEST in r
    parent = threading.Event()
    c = Cancel(parent)
    child = c.child()
    assert not child.is_set()
    parent.set()
    assert c.is_set() and child.is_set()
    own = Cancel().child()
    own.set()
    assert own.is_set() and not own.parent.is_set()


def test_requests_made_in_different_processes_may_share_an_id_and_both_get_answers():
    """Found by the served-cluster overload test: two ingress replicas number their
    requests alike; the service routes answers by an id of its own."""
    p = tr.Pipeline("ids")
    p.source(fields=["q"]).map(lambda r: {**r, "a": r["q"] * 2}).sink()
    svc = PipelineService(p).start()
    try:
        assert svc.wait_ready(30)

        async def main():
            return await asyncio.gather(*(svc.submit({"q": i}, request=Request(rid=1))
                                          for i in range(20)))

        got = asyncio.run(main())
    finally:
        svc.stop()
    assert [r["a"] for r in got] == [2 * i for i in range(20)]
