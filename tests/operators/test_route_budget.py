"""route ``escalate:``: budgeted, verified allocation with scripted providers of known
skill and price — the order, escalation on a failed verdict, the budget bound, the
ledger, policies fit offline and updated online, and the compile-time refusals."""

from __future__ import annotations

import json

import pytest

import tailrace as tr
from tailrace.compiler import compile_pipeline
from tailrace.engines import BACKENDS, Generation
from tailrace.errors import PlanError
from tailrace.operators.allocate import ledgers
from tailrace.operators.policy import Policy, features, fit


class SkillEngine:
    """Solves a prompt ``level N ...`` when N <= its skill: answers ``ok`` then, else
    ``wrong``. Prompt tokens are words (the user message's), completion tokens 10."""

    context_length = 512
    calls: dict[str, int] = {}

    def __init__(self, path: str, model: str, skill: int = 1) -> None:
        self.model, self.skill = model, skill

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def generate(self, requests, on_token=None):
        SkillEngine.calls[self.model] = SkillEngine.calls.get(self.model, 0) + len(requests)
        out = []
        for r in requests:
            text = r.messages[-1]["content"]
            level = int(text.split()[1])
            out.append(Generation("ok" if level <= self.skill else "wrong",
                                  sum(len(m["content"].split()) for m in r.messages), 10,
                                  "stop"))
        return out

    def close(self) -> None:
        pass


def says_ok(answer: str, record: dict) -> tuple[bool, str]:
    return answer == "ok", "ok" if answer == "ok" else f"answer was {answer!r}"


@pytest.fixture(autouse=True)
def skill_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "skill",
                        ("tests.operators.test_route_budget", "SkillEngine", ("generate",)))
    SkillEngine.calls = {}


def spec(model: str, skill: int, per_1k: float | None) -> dict:
    s = {"backend": "skill", "path": __file__, "model": model, "skill": skill}
    if per_1k is not None:
        s["price"] = {"prompt_per_1k": per_1k, "completion_per_1k": per_1k}
    return s


ENGINES = {"big": spec("big", 3, 10.0), "small": spec("small", 1, 1.0)}
VERIFY = {"python": "tests.operators.test_route_budget:says_ok"}


def pipeline(engines=None, **kw) -> tr.Pipeline:
    p = tr.Pipeline("budgeted", engines=engines or ENGINES)
    kw.setdefault("verify", VERIFY)
    p.source(fields=["q"]).apply("route", id="route", prompt="{q}", max_tokens=10,
                                 **kw).sink()
    return p


def run(p, records, **kw):
    return tr.run(p, input=records, runtime="local", **kw)


def test_price_order_tries_the_cheap_provider_first_and_escalates_on_a_failed_verdict():
    res = run(pipeline(escalate=["big", "small"], order="price", budget=1.0,
                       label="price-order"),
              [{"q": "level 1 sort"}, {"q": "level 3 parse"}])
    assert not res.errors, res.errors
    out = {r["q"]: r for r in res.outputs}
    easy, hard = out["level 1 sort"], out["level 3 parse"]
    assert easy["answer"] == hard["answer"] == "ok"
    assert [c["engine"] for c in easy["route"]["tried"]] == ["small"]
    assert [(c["engine"], c["passed"]) for c in hard["route"]["tried"]] == [
        ("small", False), ("big", True)]
    assert hard["route"]["verdict"] == {"ok": True, "reason": "ok"}
    # 3 prompt words + 8 chat overhead are not billed: the engine reports 3 prompt tokens
    small_cost = (3 + 10) * 1.0 / 1000
    assert easy["route"]["spent"] == pytest.approx(small_cost)
    assert hard["route"]["spent"] == pytest.approx(small_cost + (3 + 10) * 10.0 / 1000)
    assert hard["cost"]["big"]["cost"] == pytest.approx(0.13)
    c = res.stats["route"].counters
    assert (c["solved"], c["exhausted"], c["unsolved"]) == (2, 0, 0)
    assert c["revenue"] == 2.0  # each solved record pays its budget
    assert c["spend"] == pytest.approx(2 * small_cost + 0.13)
    assert c["margin"] == pytest.approx(2.0 - c["spend"])
    assert c["small.spend"] == pytest.approx(2 * small_cost)
    assert ledgers()["price-order"]["solved"] >= 2


def test_listed_order_is_kept_and_fixed_revenue_is_what_a_solved_record_pays():
    res = run(pipeline(escalate=["big", "small"], revenue=0.5, budget=1.0,
                       label="listed"), [{"q": "level 1 x"}])
    (r,) = res.outputs
    assert [c["engine"] for c in r["route"]["tried"]] == ["big"]
    assert res.stats["route"].counters["revenue"] == 0.5


def test_a_provider_that_cannot_fit_in_the_budget_left_is_skipped_and_the_record_ends_exhausted():
    # small's worst case: (3 + 8 overhead + 10 max_tokens) / 1000 = 0.021; big's 0.21
    res = run(pipeline(escalate=["small", "big"], budget=0.05), [{"q": "level 3 hard"}])
    assert not res.outputs
    (e,) = res.errors
    assert e.error == "BudgetExhausted"
    assert "spent 0.013 of 0.05 on small (answer was 'wrong')" in e.message
    assert "next provider (big) could cost more" in e.message
    assert e.detail["route"]["skipped"] == ["big"]
    assert SkillEngine.calls == {"small": 1}
    assert res.stats["route"].counters["exhausted"] == 1


def test_when_every_provider_fails_on_fail_decides_between_an_error_and_the_last_answer():
    res = run(pipeline(escalate=["small", "big"]), [{"q": "level 9 impossible"}])
    (e,) = res.errors
    assert e.error == "VerificationFailed" and "no provider's answer passed" in e.message
    assert [c["engine"] for c in e.detail["route"]["tried"]] == ["small", "big"]
    kept = run(pipeline(escalate=["small", "big"], on_fail="keep"),
               [{"q": "level 9 impossible"}])
    (r,) = kept.outputs
    assert r["answer"] == "wrong" and r["route"]["verdict"]["ok"] is False
    assert kept.stats["route"].counters["unsolved"] == 1


def test_budget_required_comes_from_the_request_or_a_field_and_a_bad_one_is_an_error_record():
    p = pipeline(escalate=["small", "big"], budget="required", budget_field="budget")
    res = run(p, [{"q": "level 1 a", "budget": 0.5}, {"q": "level 1 b"},
                  {"q": "level 1 c", "budget": -1}])
    assert [r["q"] for r in res.outputs] == ["level 1 a"]
    assert res.outputs[0]["route"]["budget"] == 0.5
    msgs = sorted(e.message for e in res.errors)
    assert "must hold a positive budget" in msgs[0]
    assert "needs a budget per request" in msgs[1]


def crashes_on_boom(answer: str, record: dict) -> tuple[bool, str]:
    if "boom" in record["q"]:
        raise RuntimeError("the check crashed")
    return says_ok(answer, record)


def test_a_verifier_that_crashes_on_one_record_ends_that_record_only():
    # found by the fault suite: one record's crashing check used to fail the whole
    # micro-batch, answers already verified (and counted solved) included
    res = run(pipeline(escalate=["small", "big"],
                       verify={"python": "tests.operators.test_route_budget:crashes_on_boom"}),
              [{"q": "level 1 a"}, {"q": "level 3 boom"}, {"q": "level 3 c"}])
    assert sorted(r["q"] for r in res.outputs) == ["level 1 a", "level 3 c"]
    (e,) = res.errors
    assert (e.input["q"], e.error, e.message) == ("level 3 boom", "RuntimeError",
                                                  "the check crashed")
    c = res.stats["route"].counters
    assert (c["solved"], c["unsolved"]) == (2, 1)


def test_a_cancelled_request_is_not_escalated():
    # its caller gave up (or its attempt was abandoned by a timeout): no dearer call
    from tailrace.request import REQUEST, Request

    gone = Request()
    gone.cancel.set()
    res = run(pipeline(escalate=["small", "big"]), [{"q": "level 3 x", REQUEST: gone}])
    (e,) = res.errors
    assert e.error == "VerificationFailed"
    assert [c["engine"] for c in e.detail["route"]["tried"]] == ["small"]
    assert SkillEngine.calls == {"small": 1}
    kept = run(pipeline(escalate=["small", "big"], on_fail="keep"),
               [{"q": "level 3 x", REQUEST: gone}])
    assert [r["route"]["engine"] for r in kept.outputs] == ["small"]


def test_a_cancelled_request_that_skipped_a_provider_ends_unsolved_not_exhausted():
    # listed order: the dear provider does not fit the budget and is skipped, the small
    # one fails, then the caller gives up: the cancel stopped it, not the budget (found
    # by the fault suite's chaos profile)
    from tailrace.request import REQUEST, Request

    engines = {**ENGINES, "dear": spec("dear", 9, 100.0)}
    gone = Request()
    gone.cancel.set()
    res = run(pipeline(engines, escalate=["dear", "small", "big"], budget=0.5,
                       label="cut-short"), [{"q": "level 3 x", REQUEST: gone}])
    (e,) = res.errors
    assert e.error == "VerificationFailed", e.message
    route = e.detail["route"]
    assert [c["engine"] for c in route["tried"]] == ["small"] and route["skipped"] == ["dear"]
    c = res.stats["route"].counters
    assert (c["unsolved"], c.get("exhausted", 0)) == (1, 0)


def trace_of(res) -> list[str]:
    lines = [json.dumps(tr.api.records.ErrorRecord.to_dict(e)) for e in res.errors]
    return lines + [json.dumps(r) for r in res.outputs]


def test_a_policy_fit_on_a_trace_skips_the_provider_that_fails_such_prompts(tmp_path):
    # the trace: every provider tried on every prompt (order listed, keep going on failure)
    tasks = [{"q": f"level {lvl} {w} task"} for lvl in (1, 3) for w in "abcdefgh"]
    res = run(pipeline(escalate=["small", "big"], on_fail="keep"), tasks)
    (tmp_path / "trace.jsonl").write_text("\n".join(trace_of(res)))
    from tailrace.cli.main import main

    assert main(["route", "fit", str(tmp_path / "trace.jsonl"), "--out",
                 str(tmp_path / "p.json"), "--prompt-field", "q"]) == 0
    pol = Policy.load(tmp_path / "p.json")
    assert pol.success("small", features("level 1 z task")) > 0.7
    assert pol.success("small", features("level 3 z task")) < 0.3
    SkillEngine.calls = {}
    # small at half big's price: worth trying first only where it likely passes
    # (chance > 0.34 here); a cheaper small is worth a try even at a low chance
    engines = {"big": spec("big", 3, 10.0), "small": spec("small", 1, 5.0)}
    res = run(pipeline(engines, escalate=["small", "big"], order="policy",
                       policy=str(tmp_path / "p.json"), revenue=1.0),
              [{"q": "level 3 z task"}, {"q": "level 1 z task"}])
    assert not res.errors, res.errors
    out = {r["q"]: [c["engine"] for c in r["route"]["tried"]] for r in res.outputs}
    assert out == {"level 3 z task": ["big"], "level 1 z task": ["small"]}


def test_a_policy_declines_when_no_provider_is_expected_to_pay(tmp_path):
    pol = fit([(f"level 9 {w}", [{"engine": "small", "passed": False, "completion_tokens": 10},
                                 {"engine": "big", "passed": False, "completion_tokens": 10}])
               for w in "abcdef"])
    pol.save(tmp_path / "p.json")
    res = run(pipeline(escalate=["small", "big"], order="policy",
                       policy=str(tmp_path / "p.json"), revenue=0.01), [{"q": "level 9 a"}])
    (e,) = res.errors
    assert e.error == "BudgetExhausted" and e.message.startswith("declined")
    assert SkillEngine.calls == {}


def test_learn_updates_the_policy_online_from_verified_outcomes(tmp_path):
    Policy(["small", "big"]).save(tmp_path / "p.json")
    engines = {"big": spec("big", 3, 10.0), "small": spec("small", 1, 5.0)}
    p = pipeline(engines, escalate=["small", "big"], order="policy",
                 policy=str(tmp_path / "p.json"),
                 revenue=1.0, learn=True, on_fail="keep")
    res = run(p, [{"q": f"level 3 {w} job"} for w in "abcdefghijklmnop"] * 3)
    tried = [[c["engine"] for c in r["route"]["tried"]] for r in res.outputs]
    assert tried[0][0] == "small"  # an untrained policy: cheap first
    assert tried[-1] == ["big"]  # it learnt that small fails these
    learnt = Policy.load(tmp_path / "p.json")  # and saved what it learnt
    assert learnt.seen["small"] > 0 and learnt.success("small", features("level 3 q job")) < 0.34


@pytest.mark.parametrize("kw,msg", [
    ({"escalate": ["small", "big"], "verify": None}, "'escalate' needs 'verify'"),
    ({"escalate": ["small", "big"], "verify": {"oracle": {}}}, "verif"),
    ({"escalate": ["small", "big"], "budget": -1}, "'budget' must be a positive number"),
    ({"escalate": ["small", "big"], "budget": "lots"}, "'budget' must be a positive number"),
    ({"escalate": ["small", "small"]}, "each once"),
    ({"escalate": ["small", "big"], "order": "policy"}, "order: policy needs 'policy'"),
    ({"escalate": ["small", "big"], "order": "cheapest"}, "listed, price or policy"),
    ({"escalate": ["small", "big"], "learn": True}, "set order: policy"),
    ({"escalate": ["small", "big"], "on_fail": "retry"}, "error or keep"),
    ({"escalate": ["small", "big"], "policy": "/no/such.json", "order": "policy"},
     "cannot read it"),
    ({"cascade": ["small", "big"], "budget": 1.0}, "only apply to 'escalate'"),
])
def test_compile_time_refusals(kw, msg):
    with pytest.raises(PlanError, match=msg):
        compile_pipeline(pipeline(**kw))


def test_an_unpriced_engine_cannot_be_budgeted_and_a_price_must_be_well_formed():
    engines = {"small": spec("small", 1, None), "big": spec("big", 3, 10.0)}
    with pytest.raises(PlanError, match="engine 'small' has no price"):
        compile_pipeline(pipeline(engines, escalate=["small", "big"], budget=1.0))
    compile_pipeline(pipeline(engines, escalate=["small", "big"]))  # listed, unbudgeted: fine
    bad = {"small": {**spec("small", 1, None), "price": {"prompt_per_1k": -1}}}
    with pytest.raises(PlanError, match="price must be"):
        compile_pipeline(pipeline(bad, escalate=["small"]))


def test_an_onnx_embedder_is_priced_by_its_own_token_counts_other_embedders_are_refused():
    from tailrace.engines import check_spec, open_engine
    from tailrace.errors import EngineError

    with pytest.raises(EngineError, match="reports none for embeddings"):
        check_spec("emb", {"backend": "openai", "base_url": "http://127.0.0.1:9/v1",
                           "model": "e", "kind": "embed", "price": {"prompt_per_1k": 1}},
                   "embed")
    with pytest.raises(EngineError, match="no completion tokens"):
        check_spec("emb", {"backend": "onnx", "model": "minilm-l6-int8",
                           "price": {"prompt_per_1k": 1, "completion_per_1k": 1}}, "embed")
    spec = {"backend": "onnx", "model": "minilm-l6-int8", "price": {"prompt_per_1k": 2.0}}
    p = tr.Pipeline("priced-embed", engines={"emb": spec})
    p.source(fields=["q"]).apply("embed", id="embed", engine="emb", input="q",
                                 output="v").sink()
    texts = ["a short text", "another, somewhat longer text to embed"]
    res = run(p, [{"q": t} for t in texts])
    eng = open_engine({k: v for k, v in spec.items() if k != "price"})
    tokens = sum(eng.count_tokens(t) for t in texts)
    assert res.stats["embed"].counters == {"cost": pytest.approx(tokens * 2.0 / 1000)}


def test_a_priced_generate_reports_cost_in_its_usage_field_and_counter():
    p = tr.Pipeline("priced", engines={"small": spec("small", 1, 2.0)})
    p.source(fields=["q"]).apply("generate", id="gen", engine="small", prompt="{q}",
                                 usage="usage").sink()
    res = run(p, [{"q": "level 1 a"}, {"q": "level 1 b c"}])
    costs = sorted(r["usage"]["cost"] for r in res.outputs)
    assert costs == pytest.approx([(3 + 10) * 2 / 1000, (4 + 10) * 2 / 1000])
    assert res.stats["gen"].counters["cost"] == pytest.approx(sum(costs))


def test_a_policy_fit_on_embeddings_reads_them_through_the_stages_embedder(tmp_path):
    tasks = [{"q": f"level {lvl} {w} task"} for lvl in (1, 3) for w in "abcdefgh"]
    res = run(pipeline(escalate=["small", "big"], on_fail="keep"), tasks)
    (tmp_path / "trace.jsonl").write_text("\n".join(trace_of(res)))
    from tailrace.cli.main import main

    assert main(["route", "fit", str(tmp_path / "trace.jsonl"), "--out", str(tmp_path / "p.json"),
                 "--prompt-field", "q", "--embedder", "minilm-l6-int8", "--no-words"]) == 0
    pol = Policy.load(tmp_path / "p.json")
    assert (pol.embedder, pol.embed_dim, pol.words) == ("minilm-l6-int8", 384, False)
    engines = {**ENGINES, "emb": {"backend": "onnx", "model": "minilm-l6-int8"}}
    res = run(pipeline(engines, escalate=["small", "big"], order="policy",
                       policy=str(tmp_path / "p.json"), embedder="emb", revenue=1.0),
              [{"q": "level 1 z task"}])
    assert [r["answer"] for r in res.outputs] == ["ok"], res.errors
    # the embedder must be the model the policy was fit on, and only with a policy
    with pytest.raises(PlanError, match="was fit with embedder 'minilm-l6-int8'"):
        compile_pipeline(pipeline(engines, escalate=["small", "big"], order="policy",
                                  policy=str(tmp_path / "p.json")))
    with pytest.raises(PlanError, match="use it with order: policy"):
        compile_pipeline(pipeline(engines, escalate=["small", "big"], embedder="emb"))
    assert main(["route", "fit", str(tmp_path / "trace.jsonl"), "--out", str(tmp_path / "q.json"),
                 "--embedder", "no-such-model"]) == 2


def test_retries_do_not_repeat_an_outcome_a_spent_budget_or_a_failed_verdict():
    p = tr.Pipeline("retried", engines=ENGINES)
    p.source(fields=["q"]).apply("route", id="route", prompt="{q}", max_tokens=10,
                                 escalate=["small", "big"], verify=VERIFY, budget=0.05,
                                 retries=2, label="retried").sink()
    res = run(p, [{"q": "level 3 hard"}, {"q": "level 9 never"}])
    assert sorted(e.error for e in res.errors) == ["BudgetExhausted", "BudgetExhausted"]
    assert all(e.attempts == 1 for e in res.errors)
    assert SkillEngine.calls == {"small": 2}  # once each, not three times
    assert res.stats["route"].counters["requests"] == 2
