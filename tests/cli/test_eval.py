"""tailrace eval on a small corpus slice with the real models."""

import json

import pytest

from tailrace.cli.main import main

pytestmark = pytest.mark.engine


def test_eval_reports_retrieval_and_answer_accuracy(tailrace_home, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["eval", "--limit", "3", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "retrieval recall@10:" in out and "no-retrieval baseline" in out
    r = json.loads(report.read_text())
    assert r["questions"] == 3 and r["embedder"] == "minilm-l6-int8"
    assert 0 <= r["recall_at_k"] <= 1 and 0 <= r["baseline_accuracy"] <= 1
    assert len(r["details"]) == 3 and {"rag", "baseline", "gold"} <= set(r["details"][0])


def test_eval_without_an_index_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAILRACE_HOME", str(tmp_path))
    assert main(["eval", "--retrieval-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tailrace: error: no index at ") and err.endswith(
        "; build it with `tailrace ingest`")
