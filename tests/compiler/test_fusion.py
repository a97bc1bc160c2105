import tailrace as tr


def chain(**middle):
    p = tr.Pipeline("c")
    p.source(range(3)).map(abs, id="a").map(abs, id="b", **middle).map(abs, id="c").sink()
    return p


def stage_ids(plan):
    return [s.id for s in plan.stages]


def test_stateless_chain_is_fused():
    assert stage_ids(tr.compile_pipeline(chain())) == ["source", "a+b+c+sink"]


def test_fusion_off_keeps_every_operator():
    plan = tr.compile_pipeline(chain(), fuse=False)
    assert stage_ids(plan) == ["source", "a", "b", "c", "sink"]
    assert [e.bound for e in plan.edges] == [1024] * 4


def test_replicas_timeouts_and_queues_break_fusion():
    assert stage_ids(tr.compile_pipeline(chain(replicas=2))) == ["source", "a", "b", "c+sink"]
    assert stage_ids(tr.compile_pipeline(chain(timeout_ms=5))) == ["source", "a", "b", "c+sink"]
    assert stage_ids(tr.compile_pipeline(chain(queue=8))) == ["source", "a", "b+c+sink"]


def test_every_edge_has_the_stage_bound():
    plan = tr.compile_pipeline(chain(queue=8, replicas=2))
    assert [(e.src, e.dst, e.bound) for e in plan.edges] == [
        ("source", "a", 1024), ("a", "b", 8), ("b", "c+sink", 1024)]
    b = plan.stage("b")
    assert (b.replicas, b.mode, b.queue) == (2, "thread", 8)


def test_elastic_replicas_compile_to_bounds_and_render():
    p = tr.Pipeline("e")
    p.source([1]).map(abs, id="a", replicas={"min": 1, "max": 4}, queue=64).sink()
    plan = tr.compile_pipeline(p)
    a = plan.stage("a")
    assert (a.replicas, a.max_replicas, a.elastic, a.mode) == (1, 4, True, "thread")
    assert a.execution is not None and a.execution.push == 64 // (8 * 4)  # for 4 replicas
    assert "replicas=1..4 (autoscaled on Ray)" in plan.render("text")
    assert plan.to_dict()["stages"][1]["max_replicas"] == 4
    fixed = tr.compile_pipeline(chain(replicas=2)).stage("b")
    assert (fixed.max_replicas, fixed.elastic) == (0, False)


def test_fan_out_is_not_fused():
    p = tr.Pipeline("f")
    s = p.source([1]).map(abs, id="a")
    s.sink(id="x")
    s.sink(id="y")
    assert stage_ids(tr.compile_pipeline(p)) == ["source", "a", "x", "y"]


def test_render_formats():
    plan = tr.compile_pipeline(chain(replicas=2))
    assert plan.render("mermaid").splitlines()[:2] == [
        "flowchart LR", '  n_source["source: source"]']
    assert "  n_a -->|1024| n_b" in plan.render("mermaid")
    assert plan.to_dict()["stages"][2] == {
        "id": "b", "upstream": ["a"], "replicas": 2, "max_replicas": 2, "mode": "thread",
        "queue": 1024,
        "ops": [{"id": "b", "op": "map", "state": "stateless",
                 "params": {"fn": "builtins.abs"},
                 "contract": {"replicas": 2, "batch": None, "timeout_ms": None, "retries": 0,
                              "queue": None, "blocking": False,
                              "placement": None, "max_replicas": None}}],
        "execution": {"call": "chain", "mode": "thread", "max_batch": 512,
                      "max_wait_ms": 0.0, "push": 64, "timeout_ms": None, "retries": 0,
                      "cancel": "none", "threads": 1, "in_flight": 1}}
    assert plan.render("text").splitlines()[0] == "plan 'c': 4 stages from 5 operators"


# -- the execution record: decided once here, read by every runtime --------------------
async def _twice(x):
    return 2 * x


def test_each_stage_gets_one_execution_record():
    from tailrace.compiler import ABANDON_CAP

    p = tr.Pipeline("x")
    s = p.source([1]).map(abs, id="plain").map(abs, id="timed", timeout_ms=50, retries=2)
    s = s.map(_twice, id="coro", timeout_ms=20).map(
        lambda xs: xs, id="grouped", batch=tr.BatchSpec(max_size=16, max_wait_ms=3))
    s.batch(max_size=5, max_wait_ms=7, id="win").sink(id="out")
    plan = tr.compile_pipeline(p, fuse=False)
    x = {st.id: st.execution for st in plan.stages}
    assert x["source"] is None
    assert (x["plain"].call, x["plain"].mode, x["plain"].threads) == ("chain", "inline", 0)
    assert (x["timed"].call, x["timed"].cancel, x["timed"].retries, x["timed"].threads) == \
        ("per_record", "abandon", 2, 1 + ABANDON_CAP)
    assert (x["coro"].call, x["coro"].mode, x["coro"].cancel, x["coro"].threads) == \
        ("per_record", "async", "cancel", 0)
    assert (x["win"].call, x["win"].max_batch, x["win"].max_wait_ms, x["win"].push) == \
        ("collect", 5, 7.0, 5)
    assert (x["grouped"].call, x["grouped"].max_batch, x["grouped"].push) == ("collect", 16, 16)
    text = plan.render("text")
    assert "runs: per_record thread batch<=1024 push=128 timeout=50ms (abandon) retries=2 " \
        "threads=5" in text
    assert "runs: collect inline batch<=5 wait=7ms push=5" in text


class BatchOwn:
    """A generation engine (never opened here) that merges concurrent calls itself."""

    continuous_batching = frozenset({"generate"})


class BatchNot:
    """A generation engine (never opened here) that leaves batching to its callers."""


def test_a_batch_contract_over_an_engine_that_batches_itself_does_not_wait(monkeypatch,
                                                                          tmp_path):
    """One batcher per engine kind: the engine's continuous batching, not the stage's
    window; an engine that does not batch keeps the window it was given."""
    from tailrace.engines import BACKENDS

    for name in ("BatchOwn", "BatchNot"):
        monkeypatch.setitem(BACKENDS, name, (__name__, name, ("generate",)))
    (tmp_path / "m.bin").write_bytes(b"")
    path = str(tmp_path / "m.bin")
    wait = {"max_size": 8, "max_wait_ms": 5}
    for backend, want in (("BatchOwn", 0.0), ("BatchNot", 5.0)):
        p = tr.Pipeline("g", engines={"llm": {"backend": backend, "path": path},
                                      "big": {"backend": "BatchOwn", "path": path}})
        s = p.source(fields=["q"])
        s = s.apply("generate", id="gen", engine="llm", input="q", batch=wait)
        s = s.apply("tool_call", id="tools", engine="llm", input="q", batch=wait, tools=[
            {"name": "n", "fn": "builtins.len"}])
        s.apply("route", id="route", cascade=["llm", "big"], input="q", batch=wait).sink()
        plan = tr.compile_pipeline(p)
        for sid in ("gen", "tools", "route"):
            x = plan.stage(sid).execution
            assert (x.call, x.max_batch, x.max_wait_ms) == ("collect", 8, want), (backend, sid)
        note = "wait=0ms push=8 threads=1 (the engine batches: batch.max_wait_ms unused)"
        assert (note in plan.render("text")) == (want == 0.0)


def test_a_stage_over_a_continuously_batching_engine_calls_in_flight(monkeypatch, tmp_path):
    """Without a batch contract, such a stage hands each record to the engine as its own
    call, several in flight per replica (``Execution.in_flight``), so a short answer is not
    held behind a long one; an engine that does not batch keeps one micro-batch call."""
    from tailrace.compiler import CALLS_IN_FLIGHT
    from tailrace.engines import BACKENDS

    for name in ("BatchOwn", "BatchNot"):
        monkeypatch.setitem(BACKENDS, name, (__name__, name, ("generate",)))
    (tmp_path / "m.bin").write_bytes(b"")
    path = str(tmp_path / "m.bin")
    for backend, want in (("BatchOwn", (1, CALLS_IN_FLIGHT)), ("BatchNot", (8, 1))):
        p = tr.Pipeline("g", engines={"llm": {"backend": backend, "path": path},
                                      "big": {"backend": "BatchOwn", "path": path}})
        s = p.source(fields=["q"])
        s = s.apply("generate", id="gen", engine="llm", input="q")
        s = s.apply("tool_call", id="tools", engine="llm", input="q", tools=[
            {"name": "n", "fn": "builtins.len"}])
        s = s.apply("generate", id="small", engine="llm", input="q", queue=8, replicas=2)
        s = s.apply("generate", id="grouped", engine="llm", input="q", batch={"max_size": 4})
        s.sink()
        plan = tr.compile_pipeline(p)
        for sid in ("gen", "tools"):
            x = plan.stage(sid).execution
            assert (x.max_batch, x.in_flight) == want, (backend, sid)
        assert plan.stage("small").execution.in_flight == (4 if want[1] > 1 else 1)  # 8 // 2
        assert plan.stage("grouped").execution.in_flight == 1  # a batch contract: one call
        assert (f"in_flight={CALLS_IN_FLIGHT}" in plan.render("text")) == (want[1] > 1)


class _Remote(tr.Operator):
    concurrent_calls = True  # e.g. a client of a vLLM server

    def process(self, record):
        return record


def test_a_custom_operator_with_concurrent_calls_keeps_several_in_flight():
    from tailrace.compiler import CALLS_IN_FLIGHT

    p = tr.Pipeline("c")
    p.source(list(range(40))).apply(_Remote, id="remote").sink(out := [])
    x = tr.compile_pipeline(p).stage("remote").execution
    assert (x.mode, x.max_batch, x.in_flight) == ("thread", 1, CALLS_IN_FLIGHT)
    tr.run(p)
    assert sorted(out) == list(range(40))


def test_replicas_and_the_bound_size_batches_and_pushes():
    p = tr.Pipeline("x")
    p.source([1]).map(abs, id="a", replicas=2, queue=64).sink(id="out")
    a = tr.compile_pipeline(p).stage("a").execution
    assert (a.max_batch, a.push) == (32, 4)  # 64 // 2 replicas; 64 // (8 pushes x 2)


def test_the_consumer_graph_both_runtimes_wire_by():
    p = tr.Pipeline("g")
    s = p.source([1], id="src").map(abs, id="a")
    t, f = s.branch(lambda x: x > 0, id="b")
    t.map(abs, id="t").sink(id="out_t")
    f.sink(id="out_f")
    s.sink(id="out_a")
    plan = tr.compile_pipeline(p, fuse=False)
    ids = [st.id for st in plan.stages]
    named = {ids[i]: {port: [ids[c] for c in cs] for port, cs in ports.items()}
             for i, ports in plan.consumers().items() if ports}
    assert named == {"src": {None: ["a"]}, "a": {None: ["b", "out_a"]},
                     "b": {"true": ["t"], "false": ["out_f"]}, "t": {None: ["out_t"]}}
    assert {ids[i] for i in plan.first_stages()} == {"a"}
