"""tailrace eval: answer matching, and a small corpus slice with the real models."""

import json
from pathlib import Path

import pytest

from tailrace.cli.evaluate import _accuracy, check_bound
from tailrace.cli.main import main
from tailrace.stores.corpus import EvalQuestion, answer_correct, normalize_answer

WIKI_QA = str(Path(__file__).resolve().parents[2] / "src" / "tailrace" / "demo" / "wiki-qa.yaml")


@pytest.mark.parametrize("generated,gold,ok", [
    ("9.71", ("1",), False),  # a number is one token: "1" is not inside "9.71"
    ("The surface gravity is approximately 9.71 m/s2.", ("1",), False),
    ("10", ("1",), False),
    ("3.1", ("1",), False),
    ("answer is 1.", ("1",), True),
    ("1", ("1",), True),
    ("(1)", ("1",), True),
    ("9.71", ("9.71",), True),
    ("About 1,000 people", ("1000",), True),
    ("The film was directed by Stanley Kubrick in 1968.", ("Stanley Kubrick",), True),
    ("Stanley Kubrick's best film", ("Stanley Kubrick",), True),
    ("Kubrick, Stanley", ("Stanley Kubrick",), False),  # a multi-word answer, in order
    ("Stanley Kubricks", ("Stanley Kubrick",), False),
    ("a New York-based band", ("New York",), True),
    ("Paris and Rome", ("Paris", "Rome"), True),  # every gold answer must be there
    ("Paris and Romeo", ("Paris", "Rome"), False),
    ("THE BEATLES!!", ("the Beatles",), True),  # case, articles, punctuation
    ("“Hamlet”, by Shakespeare", ("hamlet",), True),
    ("It is in the U.S.", ("US",), True),
    ("Democratic Party", ("Democrat",), False),
    ("", ("x",), False),
    ("anything", (), False),
    ("anything", ("!!",), False),  # a gold answer with no token never matches
])
def test_answers_match_on_whole_normalised_tokens(generated, gold, ok):
    assert answer_correct(generated, gold) is ok


def test_normalisation_keeps_numbers_whole_and_splits_words():
    assert normalize_answer("The answer is 9.71.") == "answer is 971"
    assert normalize_answer("An 8,611 m peak") == "8611 m peak"
    assert normalize_answer("Jay-Z's album") == "jay z s album"


def test_accuracy_counts_whole_token_matches():
    qs = [EvalQuestion("a", "g?", ("1",), "E"), EvalQuestion("b", "h?", ("1",), "E")]
    assert _accuracy({"g?": "It is 9.71.", "h?": "The answer is 1."}, qs) == 0.5


@pytest.mark.engine
def test_eval_reports_retrieval_and_answer_accuracy(tailrace_home, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["eval", WIKI_QA, "--limit", "3", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "retrieval recall@10:" in out and "no-retrieval baseline" in out
    r = json.loads(report.read_text())
    assert r["questions"] == 3 and r["embedder"] == "minilm-l6-int8"
    assert 0 <= r["recall_at_k"] <= 1 and 0 <= r["baseline_accuracy"] <= 1
    assert len(r["details"]) == 3 and {"rag", "baseline", "gold"} <= set(r["details"][0])


@pytest.mark.engine
def test_eval_of_the_demo_reports_each_strategys_accuracy_and_spend(tailrace_home, tmp_path,
                                                                   capsys):
    """The default pipeline (the demo's) answers with a route stage: each provider alone,
    then verify-then-escalate, each with its accuracy and what it spent."""
    report = tmp_path / "r.json"
    assert main(["eval", "--limit", "4", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    for label in ("small only", "large only", "verify-then-escalate"):
        assert f"  {label} " in out
    rows = {r["strategy"]: r for r in json.loads(report.read_text())["strategies"]}
    small, large, both = rows["small only"], rows["large only"], rows["verify-then-escalate"]
    assert all(r["answered"] == 4 and 0 <= r["accuracy"] <= 1 for r in rows.values())
    assert small["answered_by"] == {"small": 4} and large["answered_by"] == {"large": 4}
    assert small["escalated"] == large["escalated"] == 0
    # the large model costs more per token: alone it spends more than the small alone,
    # and escalating spends at least what the small model does
    assert 0 < small["spend"] < large["spend"] and both["spend"] >= small["spend"]
    assert both["escalated"] == both["answered_by"].get("large", 0) / 4
    c = both["check"]
    assert c["passed"] + c["escalated"] == 4 and c["escalated"] == both["escalated"] * 4
    assert c["passed_right"] <= c["passed"] and c["escalated_first_right"] <= c["escalated"]
    bound = rows["perfect check (bound)"]
    assert bound["accuracy"] >= max(small["accuracy"], large["accuracy"], both["accuracy"])
    assert small["spend"] <= bound["spend"] <= small["spend"] + large["spend"]
    assert "the check passed " in out and "(from the runs above, not a run)" in out


def test_the_perfect_check_bound_walks_up_the_list_until_an_answer_is_right():
    right = {"a only": [True, False, False], "b only": [False, True, False]}
    cost = {"a only": [1.0, 1.0, 1.0], "b only": [4.0, 4.0, 4.0]}
    row = check_bound(["a", "b"], right, cost, 3)
    # q0: a right (1); q1: a wrong, b right (1 + 4); q2: neither (1 + 4), b's answer stands
    assert row["accuracy"] == 2 / 3 and row["spend"] == 11.0 and row["escalated"] == 2 / 3


def test_eval_refuses_llm_on_a_routed_pipeline(tailrace_home, capsys):
    assert main(["eval", "--limit", "2", "--llm", "gemma3-270m"]) == 2
    err = capsys.readouterr().err
    assert "--llm replaces a generate stage's model; stage 'answer' routes between small, " \
           "large" in err and err.count("\n") == 1


@pytest.mark.engine
def test_eval_without_an_index_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAILRACE_HOME", str(tmp_path))
    assert main(["eval", "--retrieval-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tailrace: error: no index at ") and err.endswith(
        "; build it with `tailrace ingest`")


@pytest.mark.engine
def test_eval_reports_dense_sparse_and_hybrid(tailrace_home, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["eval", "--limit", "20", "--retrieval-only", "--mode", "all",
                 "--fusion", "k=30,sparse=0.5", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    for mode in ("dense ", "sparse", "hybrid"):
        assert f"  {mode} retrieval recall@10:" in out
    assert "reciprocal rank fusion k=30, weights dense 1 sparse 0.5, top 50 of each" in out
    r = json.loads(report.read_text())
    assert [m["mode"] for m in r["modes"]] == ["dense", "sparse", "hybrid"]
    assert r["fusion"] == {"k": 30, "dense": 1.0, "sparse": 0.5, "candidates": 50}
    assert r["recall_at_k"] == r["modes"][0]["recall_at_k"]  # the first mode, as before
    assert all(0 <= m["recall_at_k"] <= 1 and 0 <= m["mrr_at_k"] <= 1 for m in r["modes"])


@pytest.mark.parametrize("fusion,message", [
    ("k=60,sparse", "--fusion: 'sparse' is not KEY=NUMBER; give e.g. k=60,dense=1,sparse=0.5"),
    ("k=60,weight=2", "unknown fusion key(s) weight; known: k, dense, sparse, candidates"),
])
def test_eval_refuses_a_bad_fusion_in_one_line(tailrace_home, capsys, fusion, message):
    assert main(["eval", "--retrieval-only", "--mode", "hybrid", "--fusion", fusion]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
