"""Engine pools under random replica deaths and slow nodes, on the simulator's virtual
clock: the real ``EnginePool`` (batcher, dispatch, retries, restarts, back-off), the
real admission policy and the real llama.cpp scheduler, with thousands of kills a
minute that a real process pool could not be put through here. Every request ends
exactly once (answered, or failed after the pool's retries, or rejected), every ticket
is released, and the pool's view of each replica (what dispatch reads) stays current."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler.plan import compile_pipeline
from tailrace.engines.pool import dispatch
from tailrace.simulate import (
    Config,
    EngineProfile,
    LinearModel,
    Profile,
    Simulation,
    StageProfile,
    poisson,
)

from .harness import fault_settings

YAML = """
version: 1
pipeline: p
slo: {{p99_ms: {p99}, priority: interactive}}
source: {{fields: [question]}}
engines:
  llm: {{backend: llama_cpp, model: smollm2-135m-instruct, replicas: {replicas},
        max_retries: {retries}, dispatch: {dispatch}}}
stages:
  - {{id: answer, op: generate, engine: llm, prompt: "{{question}}", output: answer,
     max_tokens: 16, batch: {{max_size: {batch}}}, replicas: {stage}}}
"""


def profile(step: float, start: float) -> Profile:
    return Profile(
        "p",
        {"answer": StageProfile(LinearModel({"const": 0.0001}), "llm",
                                LinearModel({"const": 20.0, "tokens": 1.0}), 8.0, 16),
         "sink": StageProfile(LinearModel({}))},
        {"llm": EngineProfile("continuous", LinearModel({"const": step, "decoding": 0.0005,
                                                          "prefill": 0.00005}, cv=0.3),
                              n_seq_max=2, chunk=16, start_s=start)},
        input_tokens=8)


@st.composite
def pool_scenarios(draw):
    replicas = draw(st.integers(1, 3))
    nodes = draw(st.integers(1, 2))
    n = draw(st.integers(20, 150))
    rate = draw(st.sampled_from([2.0, 10.0, 40.0]))
    horizon = n / rate
    kills = draw(st.lists(st.tuples(st.floats(0.0, horizon),
                                    st.integers(0, replicas * nodes - 1)), max_size=6))
    slow = draw(st.lists(st.tuples(st.floats(0.0, horizon), st.integers(0, nodes - 1),
                                   st.sampled_from([0.5, 2.0, 10.0])), max_size=2))
    return dict(
        yaml=YAML.format(p99=draw(st.sampled_from([500, 3000, 60000])), replicas=replicas,
                         retries=draw(st.integers(0, 2)),
                         dispatch=draw(st.sampled_from(["least_work", "prefix_affinity",
                                                        "round_robin"])),
                         batch=draw(st.integers(1, 8)), stage=draw(st.integers(1, 4))),
        nodes=nodes, n=n, rate=rate, seed=draw(st.integers(0, 1000)),
        admission=draw(st.sampled_from(["simultaneous", "fcfs", "slo"])),
        max_in_flight=draw(st.integers(1, 8)),
        kills=[(t, "llm", r) for t, r in kills], slow=[(t, nd, f) for t, nd, f in slow],
        step=draw(st.sampled_from([0.001, 0.01, 0.05])),
        start=draw(st.sampled_from([0.0, 0.2, 2.0])))


@fault_settings("pools")
@given(sc=pool_scenarios())
def test_pools_under_kills_end_every_request_once_and_release_every_ticket(sc):
    plan = compile_pipeline(loads_pipeline(sc["yaml"]))
    sim = Simulation([plan], [profile(sc["step"], sc["start"])], Config(
        nodes=sc["nodes"], admission=sc["admission"], max_in_flight=sc["max_in_flight"],
        kills=sc["kills"], slow=sc["slow"], seed=sc["seed"]))
    sim.run(poisson({"p": sc["rate"]}, sc["n"], sc["seed"]))  # raises if one never ends
    outcomes = [r[3] for r in sim.results]
    assert len(outcomes) == sc["n"] and sim.live == 0 and sim.tickets_out == 0
    stats = sim.policy.statistics()
    assert stats.in_flight == 0 and stats.queued == 0
    assert stats.completed == stats.admitted == sc["n"] - outcomes.count("rejected")
    pool = sim.pools["llm"].pool
    assert pool._load_of == [r.load() for r in pool._replicas]
    assert pool._load_of.free == sum(x.can_take(0) for x in pool._load_of)
    least = dispatch.LeastOutstandingWork()  # the table's pick is the scan's
    assert least.choose(pool._load_of, 0) == least.choose(list(pool._load_of), 0)
    ps = pool.statistics()
    assert ps.queued == 0 and all(r.in_flight == 0 for r in ps.replicas)
    if not sc["kills"]:
        assert sum(r.failures for r in ps.replicas) == 0 and ps.retries == 0
    if outcomes.count("error"):  # only a call that failed max_retries + 1 times fails
        assert sc["kills"] and ps.failed_calls > 0
