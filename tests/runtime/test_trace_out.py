"""The trace writer (``runtime/trace_out.py``) and ``tr.run(..., trace=writer)``: one
line per input record as it ends, whatever ends it (output, error record, admission
rejection, a filter's drop); written in the background at least every second."""

from __future__ import annotations

import json
import time

import pytest

import tailrace as tr
from tailrace.control import AdmissionGate, make_policy
from tailrace.control.admission import AdmissionRejected
from tailrace.errors import PlanError, TailraceError
from tailrace.request import REQUEST
from tailrace.runtime import trace_out
from tailrace.runtime.trace_out import TraceWriter


def read(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def wait_until(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_lines_have_the_format_and_come_in_the_order_recorded(tmp_path):
    path = tmp_path / "t.jsonl"
    w = TraceWriter.open(str(path))
    w.record(w.t0 + 0.5, "p", 10, 64, 7, "ok", ended=w.t0 + 1.75)
    w.record(w.t0 + 0.25, "q", 3, None, None, "rejected", ended=w.t0 + 2.0)
    w.close()
    assert read(path) == [
        {"t": 0.5, "pipeline": "p", "prompt_tokens": 10, "max_tokens": 64,
         "output_tokens": 7, "latency_s": 1.25, "outcome": "ok"},
        {"t": 0.25, "pipeline": "q", "prompt_tokens": 3, "max_tokens": None,
         "output_tokens": None, "latency_s": 1.75, "outcome": "rejected"}]
    w.record(w.t0, "p", 1, None, None, "ok")  # after close: nothing
    w.close()  # twice: nothing
    assert len(read(path)) == 2


def test_lines_are_written_without_close_within_a_second(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    with TraceWriter.open(str(path)) as w:
        w.record(w.t0, "p", 1, None, None, "ok")
        wait_until(lambda: path.read_text().count("\n") == 1, "the periodic flush")
        monkeypatch.setattr(trace_out, "FLUSH_LINES", 3)
        for _ in range(3):  # FLUSH_LINES waiting: written at once (well before FLUSH_S)
            w.record(w.t0, "p", 1, None, None, "ok")
        wait_until(lambda: path.read_text().count("\n") == 4, "the flush at FLUSH_LINES")
    assert len(read(path)) == 4


def test_a_path_that_cannot_be_written_is_one_clear_error(tmp_path):
    with pytest.raises(TailraceError, match=r"cannot write the trace: No such file or "
                                            r"directory; give a writable file"):
        TraceWriter.open(str(tmp_path / "missing" / "t.jsonl"))


class Picky(AdmissionGate):
    """Rejects the records that ask for it (``reject: true``), admits the others."""

    async def admit(self, pipeline, record):
        if record.get("reject"):
            raise AdmissionRejected("queue full", reason="queue_full", retry_after=1.0)
        return await super().admit(pipeline, record)


def fails_on_boom(text: str) -> str:
    if text == "boom":
        raise ValueError("no boom")
    return text.upper()


def test_every_record_has_one_line_whatever_ends_it(tmp_path):
    p = tr.Pipeline("mixed")
    (p.source(fields=["text"]).filter(lambda r: not r["text"].startswith("drop"), id="keep")
     .map(fails_on_boom, input="text", output="loud", id="loud").sink())
    path = tmp_path / "t.jsonl"
    # distinct sizes (prompt_tokens: characters / 4 + 1) tell the lines apart
    records = [{"text": "a"}, {"text": "boom"}, {"text": "drop me, please!!!"},
               {"text": "nope nope", "reject": True}, {"text": "abcdefghijklmnopqrstuvwxyz"}]
    out: list = []
    errors: list = []
    with TraceWriter.open(str(path)) as w:
        gate = Picky(make_policy("fcfs", max_in_flight=4))
        tr.run(p, input=records, output=out, errors=errors, admission=gate, trace=w)
        assert gate.statistics().in_flight == 0
    assert sorted(r["loud"] for r in out) == ["A", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    assert all(REQUEST not in r for r in out)  # the caller gets user fields only
    assert sorted(e.error for e in errors) == ["AdmissionRejected", "ValueError"]
    rows = read(path)
    assert len(rows) == 5 and {r["pipeline"] for r in rows} == {"mixed"}
    assert {r["prompt_tokens"]: r["outcome"] for r in rows} == {
        1: "ok", 2: "error", 5: "ok", 3: "rejected", 7: "ok"}  # a filter's drop: ok


def test_trace_is_refused_where_it_cannot_follow_the_records(tmp_path):
    with TraceWriter.open(str(tmp_path / "t.jsonl")) as w:
        p = tr.Pipeline("own")
        p.source([{"x": 1}]).map(lambda r: r).sink(out := [])
        with pytest.raises(PlanError, match="trace= follows the records of input="):
            tr.run(p, trace=w)
        q = tr.Pipeline("open")
        q.source().map(lambda r: r).sink()
        with pytest.raises(PlanError, match="applies to runtime='local' only"):
            tr.run(q, input=[{"x": 1}], runtime="ray", trace=w)
        res = tr.run(q, input=[{"x": 1}, 5], trace=w)  # not a dict: the input ends there
        assert res.outputs == [{"x": 1}] and len(res.errors) == 1
        assert "trace= follows records that are dicts" in res.errors[0].message
    assert out == []
    assert [r["outcome"] for r in read(tmp_path / "t.jsonl")] == ["ok"]


def test_records_grouped_by_batch_stages_reach_the_output_without_the_traces_requests(
        tmp_path):
    """The fault suite's find: a batch of batches carried each member's request (a
    runtime object) into the output."""
    import tailrace as tr
    from tailrace.runtime.trace_out import TraceWriter

    p = tr.Pipeline("nested")
    (p.source(None, id="src").batch(2, 0, id="b1", output="items")
     .batch(2, 0, id="b2", output="items").sink(None))
    out: list = []
    w = TraceWriter.open(str(tmp_path / "t.jsonl"))
    tr.run(p, input=[{"a": i} for i in range(5)], output=out.append, trace=w)
    w.close()
    members = [m for group in out for batch in group["items"] for m in batch["items"]]
    assert sorted(m["a"] for m in members) == list(range(5))
    assert all(set(m) == {"a"} for m in members)
    assert all(set(group) == {"items"} for group in out)
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 5
