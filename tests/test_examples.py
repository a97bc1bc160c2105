"""The examples in examples/ run as the README says."""

import json
import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart(capsys):
    runpy.run_path(os.path.join(ROOT, "examples", "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "plan 'quickstart'" in out
    # 0..9: evens doubled (0,4,8,12,16) are "even", odds tripled (3,9,15,21,27) are "odd"
    assert "[('even', 0), ('even', 4), ('even', 12), ('even', 24), ('even', 40), " \
        "('odd', 3), ('odd', 12), ('odd', 27), ('odd', 48), ('odd', 75)]" in out


def test_text_stats_yaml_with_the_cli(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "tailrace.cli.main", "run", "examples/text-stats.yaml",
         "--input", "examples/sample.jsonl", "--output", str(out)],
        cwd=ROOT, capture_output=True, text=True, check=True)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [1, 2, 3, 4, 5, 6]
    assert {r["id"]: r["headline"] for r in rows}[3] == "The Danube flows through ten countries."
    assert "6 in, 6 out, 0 errors" in proc.stderr


def test_readme_python_snippet_runs(capsys):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    assert "[0, 2, 4, 6, 8, 10, 12, 14, 16, 18]" in capsys.readouterr().out


@pytest.mark.engine
def test_live_news_yaml_follows_its_feed_across_runs(tmp_path):
    """examples/live-news.yaml as the README runs it (in a copy: the feed gets appended)."""
    import shutil

    shutil.copytree(os.path.join(ROOT, "examples", "live-news"),
                    tmp_path / "examples" / "live-news")
    shutil.copy(os.path.join(ROOT, "examples", "live-news.yaml"), tmp_path / "examples")
    env = {**os.environ, "TAILRACE_HOME": str(tmp_path / "home"), "PYTHONPATH": ROOT}

    def run() -> dict:
        out = tmp_path / "out.jsonl"
        subprocess.run([sys.executable, "-m", "tailrace.cli.main", "run",
                        "examples/live-news.yaml", "--input",
                        "examples/live-news/questions.jsonl", "--output", str(out), "-q"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
        return {r["question"]: r["sources"] for r in map(json.loads, out.open())}

    first = run()
    assert first["Will the Northline trains run on Friday?"] == ["Northline rail strike called off"]
    assert first["Who is the new president of the Ostrava chess club?"] == [
        "Ostrava chess club picks a young president"]
    feed = tmp_path / "examples" / "live-news" / "news.jsonl"
    with open(feed, "a") as f:  # an update of one story, the deletion of another
        f.write((tmp_path / "examples" / "live-news" / "update.jsonl").read_text())
    second = run()
    assert second["Will the Northline trains run on Friday?"] == ["Northline rail strike back on"]
    meta = json.loads((tmp_path / "home" / "live" / "news" / "snapshot" / "meta.json").read_text())
    assert (meta["count"], meta["next_key"]) == (4, 6)  # 5 stories, 1 replaced, 1 deleted;
    # the restart resumed the feed: only the one new story was embedded (keys 0-4, then 5)


@pytest.mark.engine
@pytest.mark.slow
def test_chat_with_memory_yaml_remembers_per_session_and_user(tailrace_home, tmp_path):
    """examples/chat-with-memory.yaml as the README runs it, on a fresh memory store."""
    import sqlite3

    home = tmp_path / "home"
    home.mkdir()
    (home / "indexes").symlink_to(tailrace_home / "indexes")  # the session's wiki slice
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "tailrace.cli.main", "run", "examples/chat-with-memory.yaml",
         "--input", "examples/chat-with-memory.jsonl", "--output", str(out)],
        cwd=ROOT, env={**os.environ, "TAILRACE_HOME": str(home)}, capture_output=True,
        text=True, check=True)
    assert "6 in, 6 out, 0 errors" in proc.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    mem = {(r["user_id"], r["session_id"], r["question"][:12]): r["memory"] for r in rows}
    fact = "- Ada is writing an essay about the film 2001: A Space Odyssey."
    assert mem["ada", "s1", "Who directed"] == ""
    assert fact in mem["ada", "s1", "In which yea"]  # the fact written by the first turn
    assert "user: Who directed 2001: A Space Odyssey?" in mem["ada", "s1", "In which yea"]
    assert mem["ada", "s2", "Which film i"] == "Known facts about the user:\n" + fact  # no turns
    assert "user: Who was Alan Turing?" in mem["bob", "s7", "Which machin"]
    assert "Ada" not in mem["bob", "s7", "Which machin"]
    assert mem["eve", "s1", "What did I a"] == ""  # ada's session id, another user: nothing
    [ada2] = [r for r in rows if r["question"].startswith("In which year")]
    assert ada2["sources"] == ["2001: A Space Odyssey"]  # "that film", found via the memory
    with sqlite3.connect(home / "memory.sqlite") as db:
        assert db.execute("SELECT count(*) FROM turns").fetchone() == (12,)
        assert db.execute("SELECT count(*) FROM pending").fetchone() == (0,)


@pytest.mark.engine
@pytest.mark.slow
def test_docs_qa_yaml_answers_from_tailrace_docs_with_citations(tmp_path):
    """examples/docs-qa.yaml over tailrace's own docs/ (`tailrace ingest docs --index
    tailrace-docs`, as the README says): hybrid search finds the section, the sources
    cite its file and heading path. (The questions must not be quoted in docs/,
    or the quoting section is the best match.)"""
    home = tmp_path / "home"
    env = {**os.environ, "TAILRACE_HOME": str(home)}
    subprocess.run([sys.executable, "-m", "tailrace.cli.main", "ingest", "docs", "--index",
                    "tailrace-docs", "-q"], cwd=ROOT, env=env, check=True)
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question": "Can a filter keep documents by page range?"}) + "\n" +
        json.dumps({"question": "How do I run a pipeline on a Ray cluster?"}) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "tailrace.cli.main", "run", "examples/docs-qa.yaml",
         "--input", str(questions), "--output", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "2 in, 2 out, 0 errors" in proc.stderr
    rows = {r["question"][:16]: r for r in map(json.loads, out.open())}
    filt, ray = rows["Can a filter kee"], rows["How do I run a p"]
    top = filt["sources"][0]
    assert top["path"] == "docs/retrieval.md" and top["heading"].endswith("Filters"), top
    assert ray["sources"][0]["path"] == "docs/ray.md"
    assert all(set(s) == {"path", "heading"} for s in filt["sources"] + ray["sources"])
    assert filt["answer"].strip() and ray["answer"].strip()


@pytest.mark.engine
@pytest.mark.slow
def test_docs_search_yaml_over_the_ingested_docs_folder(tmp_path):
    """README "RAG over your own documents": ingest docs/, then ask examples/docs-search.yaml;
    a second ingest embeds nothing."""
    env = {**os.environ, "TAILRACE_HOME": str(tmp_path / "home")}
    cli = [sys.executable, "-m", "tailrace.cli.main"]
    first = subprocess.run([*cli, "ingest", "docs", "--index", "tailrace-docs"], cwd=ROOT,
                           env=env, capture_output=True, text=True, check=True)
    n_files = len([f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")])
    assert f"{n_files} files ({n_files} embedded, 0 unchanged" in first.stderr
    assert "embed" in first.stderr and "index_write" in first.stderr  # the stage table
    again = subprocess.run([*cli, "ingest", "docs", "--index", "tailrace-docs"], cwd=ROOT,
                           env=env, capture_output=True, text=True, check=True)
    assert "index 'tailrace-docs' is up to date" in again.stderr
    proc = subprocess.run([*cli, "run", "examples/docs-search.yaml", "-q"], cwd=ROOT, env=env,
                          input='{"question": "How do I run a pipeline on Ray?"}\n',
                          capture_output=True, text=True, check=True)
    [row] = [json.loads(x) for x in proc.stdout.splitlines()]
    assert row["sources"][0].startswith("docs/ray.md > ")
