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
        "id": "b", "upstream": ["a"], "replicas": 2, "mode": "thread", "queue": 1024,
        "ops": [{"id": "b", "op": "map", "state": "stateless",
                 "params": {"fn": "builtins.abs"},
                 "contract": {"replicas": 2, "batch": None, "timeout_ms": None, "retries": 0,
                              "queue": None, "blocking": False,
                              "placement": None}}]}
    assert plan.render("text").splitlines()[0] == "plan 'c': 4 stages from 5 operators"
