"""The simulator against queueing theory, and proof that it runs the real policies.

Closed forms: a one-stage plan whose operator takes exponential (cv 1) or fixed (cv 0)
service times under Poisson arrivals is an M/M/c or M/D/c queue: M/M/1's mean time in
system 1/(mu - lambda), M/D/1's Pollaczek-Khinchine, M/M/c's Erlang C and M/D/c's
Cosmetatos approximation. Every run is seeded, so each figure is the same every time.
"""

from __future__ import annotations

import math
import statistics

import pytest

from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler.plan import compile_pipeline
from tailrace.control import policies
from tailrace.engines.llama_cpp import prefix_cache, scheduler
from tailrace.engines.pool import batching, dispatch
from tailrace.simulate import (
    Config,
    EngineProfile,
    LinearModel,
    Profile,
    ProfileError,
    Simulation,
    StageProfile,
    engines,
    poisson,
)

TOY = """
version: 1
pipeline: toy
source: {{fields: [question]}}
stages:
  - {{id: work, op: select, fields: [question], timeout_ms: 60000, replicas: {c}}}
"""

RAG = """
version: 1
pipeline: rag
slo: {{p99_ms: {p99}, priority: interactive}}
source: {{fields: [question]}}
engines:
  llm: {{backend: llama_cpp, model: smollm2-135m-instruct, replicas: {replicas}}}
stages:
  - {{id: answer, op: generate, engine: llm, prompt: "{{question}}", output: answer,
     max_tokens: 32, batch: {{max_size: 8}}, replicas: 4}}
"""


def toy(c: int = 1):
    return compile_pipeline(loads_pipeline(TOY.format(c=c)))


def toy_profile(mean_s: float, cv: float) -> Profile:
    return Profile("toy", {"work": StageProfile(LinearModel({"const": mean_s}, cv=cv)),
                           "sink": StageProfile(LinearModel({}))}, {})


def mean_time_in_system(c: int, lam: float, mean_s: float, cv: float, n: int) -> float:
    sim = Simulation([toy(c)], [toy_profile(mean_s, cv)], Config(seed=3))
    sim.run(poisson({"toy": lam}, n, seed=3))
    assert len(sim.results) == n and all(r[3] == "ok" for r in sim.results)
    return statistics.fmean(end - start for _, start, end, _ in sim.results)


def erlang_c_wait(c: int, lam: float, mu: float) -> float:
    a = lam / mu
    head = sum(a ** k / math.factorial(k) for k in range(c))
    tail = a ** c / math.factorial(c) * c / (c - a)
    return tail / (head + tail) / (c * mu - lam)


def test_mm1_mean_time_in_system_is_one_over_mu_minus_lambda():
    got = mean_time_in_system(1, lam=8.0, mean_s=0.1, cv=1.0, n=150_000)
    assert got == pytest.approx(1 / (10.0 - 8.0), rel=0.06)


def test_md1_mean_time_in_system_is_pollaczek_khinchine():
    rho, mu = 0.8, 10.0
    want = 1 / mu + rho / (2 * mu * (1 - rho))
    assert mean_time_in_system(1, lam=8.0, mean_s=0.1, cv=0.0, n=100_000) == \
        pytest.approx(want, rel=0.04)


def test_mm3_mean_time_in_system_is_erlang_c():
    want = erlang_c_wait(3, 24.0, 10.0) + 0.1
    assert mean_time_in_system(3, lam=24.0, mean_s=0.1, cv=1.0, n=150_000) == \
        pytest.approx(want, rel=0.06)


def test_md3_mean_time_in_system_matches_cosmetatos():
    c, lam, mu = 3, 24.0, 10.0
    rho = lam / (c * mu)
    wq = 0.5 * erlang_c_wait(c, lam, mu) * (
        1 + (1 - rho) * (c - 1) * (math.sqrt(4 + 5 * c) - 2) / (16 * rho * c))
    assert mean_time_in_system(c, lam=lam, mean_s=0.1, cv=0.0, n=100_000) == \
        pytest.approx(wq + 0.1, rel=0.05)


# -- a plan with an engine: the real pool, dispatch, batcher, scheduler, admission -------

def rag(replicas: int = 2, p99: int = 3000):
    return compile_pipeline(loads_pipeline(RAG.format(replicas=replicas, p99=p99)))


def rag_profile(step_s: float = 0.01, cv: float = 0.05) -> Profile:
    return Profile(
        "rag",
        {"answer": StageProfile(LinearModel({"const": 0.0002}), "llm",
                                LinearModel({"const": 40.0, "tokens": 1.0}), 20.0, 24),
         "sink": StageProfile(LinearModel({}))},
        {"llm": EngineProfile("continuous", LinearModel({"const": step_s, "decoding": 0.001,
                                                          "prefill": 0.0001}, cv=cv),
                              n_seq_max=4, chunk=16, start_s=0.5)},
        input_tokens=10)


def run_rag(config: Config, rate: float = 4.0, n: int = 400, **kw) -> Simulation:
    sim = Simulation([rag(**kw)], [rag_profile()], config)
    sim.run(poisson({"rag": rate}, n, seed=config.seed))
    return sim


def test_the_real_policy_objects_decide(monkeypatch):
    """Each policy the simulator claims to run is called: a copy of its logic in the
    simulator would leave these counters at zero."""
    calls: dict[str, int] = {}

    def spy(owner, name):
        real = getattr(owner, name)

        def counted(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **k)

        monkeypatch.setattr(owner, name, counted)

    spy(policies.SLOPolicy, "_decide")
    spy(dispatch.LeastOutstandingWork, "choose")
    spy(batching.Batcher, "take")
    spy(scheduler.Scheduler, "schedule")
    spy(scheduler.Scheduler, "prefill")
    spy(prefix_cache.PrefixCache, "take")
    sim = run_rag(Config(admission="slo", max_in_flight=8, seed=1))
    assert {r[3] for r in sim.results} <= {"ok", "rejected"}
    assert set(calls) == {"_decide", "choose", "take", "schedule", "prefill"}, calls
    assert all(n > 100 for n in calls.values()), calls


def test_changing_a_real_policy_changes_the_simulation(monkeypatch):
    """Dispatch decided by the real LeastOutstandingWork spreads calls over both
    replicas; make the real class always pick the last replica and every call goes
    there: the simulator follows the code, not a model of it."""
    sim = run_rag(Config(seed=2), rate=6.0)
    calls = [r.calls for r in sim.pools["llm"].pool.statistics().replicas]
    assert min(calls) > 0.25 * sum(calls)

    def last(self, loads, cost, affinity=None):
        ok = [x for x in loads if x.can_take(cost)]
        return max(ok, key=lambda x: x.id).id if ok else None

    monkeypatch.setattr(dispatch.LeastOutstandingWork, "choose", last)
    sim = run_rag(Config(seed=2), rate=6.0)
    calls = [r.calls for r in sim.pools["llm"].pool.statistics().replicas]
    assert calls[0] == 0 and calls[1] > 0


def test_a_killed_replica_is_retried_elsewhere_and_restarted():
    sim = run_rag(Config(seed=4, kills=[(20.0, "llm", 0)]), rate=5.0, n=300)
    st = sim.pools["llm"].pool.statistics()
    assert len(sim.results) == 300 and all(r[3] == "ok" for r in sim.results)
    assert st.replicas[0].restarts == 1 and st.replicas[0].failures == 1
    assert st.retries >= 1  # its in-flight batch went to the other replica
    assert sim.tickets_out == 0


def test_overload_under_slo_rejects_and_every_request_ends_once():
    sim = run_rag(Config(admission="slo", max_in_flight=4, seed=5), rate=40.0, n=800,
                  replicas=1, p99=1500)
    outcomes = [r[3] for r in sim.results]
    assert len(outcomes) == 800 and sim.live == 0 and sim.tickets_out == 0
    assert outcomes.count("rejected") > 100 and outcomes.count("ok") > 100
    stats = sim.policy.statistics()
    assert stats.admitted == stats.completed == outcomes.count("ok")
    lat = sorted(e - a for _, a, e, o in sim.results if o == "ok")
    assert lat[int(0.99 * len(lat))] < 2.0  # admission kept the admitted ones near the SLO


def test_simultaneous_admission_lets_the_same_overload_queue_without_bound():
    sim = run_rag(Config(seed=5), rate=40.0, n=800, replicas=1)
    assert all(r[3] == "ok" for r in sim.results)
    lat = sorted(e - a for _, a, e, o in sim.results)
    assert lat[int(0.99 * len(lat))] > 10.0


def test_more_nodes_raise_throughput_and_a_slow_node_lowers_it():
    def p99(config: Config) -> float:
        sim = run_rag(config, rate=12.0, n=1200, replicas=1)
        lat = sorted(e - a for _, a, e, _ in sim.results)
        return lat[int(0.99 * len(lat))]

    one, four = p99(Config(seed=6)), p99(Config(seed=6, nodes=4))
    slowed = p99(Config(seed=6, nodes=4, slow=[(0.0, 0, 4.0), (0.0, 1, 4.0)]))
    assert four < one / 5
    assert slowed > four * 1.5


def test_the_pools_dispatch_view_stays_current_through_kills_and_restarts():
    sim = run_rag(Config(seed=7, kills=[(5.0, "llm", 0), (9.0, "llm", 1), (9.5, "llm", 0)]),
                  rate=8.0, n=300)
    pool = sim.pools["llm"].pool
    assert all(r[3] == "ok" for r in sim.results)
    assert pool._load_of == [r.load() for r in pool._replicas]
    assert pool._load_of.free == sum(x.can_take(0) for x in pool._load_of)
    least = dispatch.LeastOutstandingWork()  # the table's pick is the scan's
    assert least.choose(pool._load_of, 0) == least.choose(list(pool._load_of), 0)
    assert sum(r.restarts for r in pool.statistics().replicas) == 3


def test_decode_runs_planned_as_one_event_end_as_step_by_step(monkeypatch):
    """A replica plans a run of decode-only steps as one event, cut when a request
    arrives or its node slows: with exact durations (cv 0) every request ends when it
    ends stepping one event a step, through arrivals mid-run, a slowed node and a kill."""
    def run() -> tuple[list, int, float]:
        slow = [(t / 10, t % 2, 1.0 + t % 3) for t in range(50, 150, 7)]
        config = Config(seed=3, nodes=2, slow=slow, kills=[(11.1, "llm", 0)])
        sim = Simulation([rag()], [rag_profile(cv=0.0)], config)
        sim.run(poisson({"rag": 5.0}, 300, seed=3))
        reps = [r for d in sim.pools.values() for r in d.replicas]
        return (sorted(sim.results), sim.loop.events,
                sum(getattr(r, "steps", 0) for r in reps))

    planned, events, steps = run()
    monkeypatch.setattr(engines.ContinuousReplica, "_settled", lambda self: False)
    stepped, events_stepped, steps_stepped = run()
    assert [r[3] for r in planned] == [r[3] for r in stepped]
    assert all(a[0] == b[0] and abs(a[2] - b[2]) < 1e-9
               for a, b in zip(planned, stepped, strict=True))
    assert steps == steps_stepped  # the same decode steps, counted once each
    assert events < 0.6 * events_stepped  # in far fewer events


def test_the_ray_topology_places_each_replica_once_and_pays_a_hop_per_actor():
    """``runtime: ray``: three nodes still hold one engine actor (the spec's replicas) and
    the stage's replicas once; a lone request pays one hop into its stage and two per
    engine call, exactly, on top of what it costs locally."""
    def lone(**kw: object) -> tuple[float, Simulation]:
        sim = Simulation([rag(replicas=2)], [rag_profile(cv=0.0)],
                         Config(jitter=0.0, seed=1, **kw))  # type: ignore[arg-type]
        sim.run(poisson({"rag": 1.0}, 1, seed=1))
        (_, a, e, outcome), = sim.results
        assert outcome == "ok"
        return e - a, sim

    local, _ = lone()
    on_ray, sim = lone(runtime="ray", nodes=3, hop_ms=5.0)
    assert len(sim.pools["llm"].replicas) == 2  # not 2 per node
    stage = sim.pipelines["rag"].stages[0]
    assert stage.workers == 4 * max(stage.stage.execution.in_flight, 1)
    assert on_ray - local == pytest.approx(3 * 0.005, abs=1e-9)
    _, spread = lone(nodes=3)  # the local topology: 2 replicas on each of 3 nodes
    assert len(spread.pools["llm"].replicas) == 6


def test_a_runtime_it_does_not_know_and_a_serve_deployment_are_refused():
    with pytest.raises(ValueError, match="runtime must be local or ray, got 'k8s'"):
        Simulation([rag()], [rag_profile()], Config(runtime="k8s"))
    plan = compile_pipeline(loads_pipeline(RAG.format(replicas=1, p99=3000).replace(
        "replicas: 1}", "cluster: {replicas: 2}}")))
    with pytest.raises(ProfileError, match="engine 'llm': cluster: .* is not simulated"):
        Simulation([plan], [rag_profile()], Config(runtime="ray"))


def test_requests_draw_their_output_from_the_measured_samples(monkeypatch):
    """A profile with measured output lengths: each simulated request generates one of
    them (so a batched call lasts as its longest), not their mean."""
    from dataclasses import replace

    prof = rag_profile()
    answer = replace(prof.stages["answer"], output_samples=(2, 2, 30))
    prof = replace(prof, stages={**prof.stages, "answer": answer})
    outputs: list[int] = []
    real = Simulation.request

    def spy(self, stage, rec):
        req = real(self, stage, rec)
        outputs.append(self.shapes.get(req).output)
        return req

    monkeypatch.setattr(Simulation, "request", spy)
    sim = Simulation([rag()], [prof], Config(seed=3))
    sim.run(poisson({"rag": 4.0}, 300, seed=3))
    assert set(outputs) == {2, 30} and 0.2 < outputs.count(30) / len(outputs) < 0.5


def test_the_sequences_model_shares_the_decode_among_its_slots():
    """Two slots, three requests of 100 prompt and 10 output tokens: two prefill side by
    side (0.11 s) and decode sharing the server (0.025 s a token), the third then alone;
    the same figure ``sequence_features`` gives the profile's fit for a call of two."""
    import numpy as np

    from tailrace.engines.base import GenerationRequest
    from tailrace.engines.pool.messages import BatchResult, GenerateBatch
    from tailrace.simulate.engines import SequenceReplica, Shape, Shapes, sequence_features
    from tailrace.simulate.events import Loop

    loop, shapes, ends = Loop(), Shapes(), {}
    model = LinearModel({"const": 0.01, "prefill": 0.001, "tokens": 0.02, "crowd": 0.005})
    rep = SequenceReplica(loop, EngineProfile("sequences", model, n_seq_max=2, start_s=0),
                          lambda m: ends.setdefault(m.batch_id, (loop.now(), m)), 0, {},
                          "generate", shapes=shapes)
    for b in range(3):
        req = GenerationRequest(prompt=str(b), max_tokens=10)
        shapes.put(req, Shape(np.zeros(100, dtype=np.int32), 10))
        rep.send(GenerateBatch(b, (req,)))
    loop.run()
    assert [round(ends[b][0], 9) for b in range(3)] == [0.36, 0.36, 0.67]
    assert all(isinstance(m, BatchResult) and m.outputs[0].completion_tokens == 10
               for _, m in ends.values())
    assert model(**sequence_features([(100, 10), (100, 10)])) == pytest.approx(0.36)


def test_a_fits_absurd_spread_is_drawn_as_at_most_exponential():
    import random

    m = LinearModel({"const": 0.001}, cv=477.0)
    rng = random.Random(1)
    xs = [m.draw(rng) for _ in range(20_000)]
    assert statistics.fmean(xs) == pytest.approx(0.001, rel=0.05)
    assert max(xs) < 0.02  # exponential's tail, not a gamma of shape 4e-6's seconds
