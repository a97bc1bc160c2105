"""`make demo` as a user sees it: the real models answer each question right, say which
model answered, whether it escalated and what it cost, and README.md shows exactly that."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from tailrace.cli import demo as demo_mod
from tailrace.cli.main import main
from tailrace.stores.corpus import answer_correct, read_wiki

ROOT = Path(__file__).resolve().parents[2]
#: the pages the demo's answers are on, the top hit of each question in the full index too
PAGES = ("2001: A Space Odyssey", "The Starry Night", "Pride and Prejudice",
         "Sinking of the Titanic", "Mona Lisa", "Apollo 11")


def answers_part(text: str) -> str:
    """The demo's output up to its summary line ("6 answers, ..."): no timings."""
    head, sep, _ = text.partition(" escalated; spent ")
    assert sep, text
    return (head + sep + _.split("\n", 1)[0]).strip()


def readme_tool():
    spec = importlib.util.spec_from_file_location("readme_demo", ROOT / "tools" / "readme_demo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """What `tailrace demo` prints, run once on the real models over an index of the demo's
    pages among 600 others (the full 10,033-page index takes minutes to build here; these
    pages are the top hit either way, and the answers come from the page alone)."""
    home = tmp_path_factory.mktemp("demo_home")
    docs = read_wiki()
    keep = [d for d in docs if d["title"] in PAGES]
    assert len(keep) == len(PAGES)
    corpus = home / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"title": d["title"], "text": d["text"]}) + "\n"
                              for d in docs[:600] + keep), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAILRACE_HOME", str(home))
        from tailrace.cli.ingest import ingest

        ingest(index="wiki", corpus=str(corpus), quiet=True)
        mp.setattr(demo_mod, "ingest", lambda **_: None)  # the index above, as built
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["demo"])
    assert code == 0, out.getvalue()
    return out.getvalue()


@pytest.mark.engine
def test_the_demo_answers_right_and_says_who_answered_and_what_it_cost(printed):
    for question, gold in demo_mod.QUESTIONS:
        block = printed.split(f"Q: {question}\n", 1)[1].split("\n\n", 1)[0]
        lines = block.splitlines()
        assert lines[0].startswith("A: ") and answer_correct(lines[0][3:], (gold,)), block
        assert lines[1].startswith("   sources: ") and lines[2].startswith("   model: ")
        assert " cost " in lines[2] and ("passed the check" in lines[2]
                                         or "escalated: small's answer" in lines[2]), block
    assert f"{len(demo_mod.QUESTIONS)} answers, " in printed and "escalated; spent" in printed
    assert "\nstage " in printed and "answer" in printed


@pytest.mark.engine
def test_the_readme_shows_what_the_demo_prints(printed):
    """README.md's sample is `make readme`'s output of a real run: its answers, models,
    escalations and costs are what the demo prints on this build (timings aside)."""
    tool = readme_tool()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert tool.BEGIN in readme and tool.END in readme
    block = readme.split(tool.BEGIN, 1)[1].split(tool.END, 1)[0]
    shown = answers_part(block.split("```\n", 1)[1])
    assert shown == answers_part(printed), "README.md's demo output is stale: run `make readme`"


def test_the_readme_tool_replaces_only_its_block():
    tool = readme_tool()
    text = f"intro\n{tool.BEGIN}\nold\n{tool.END}\nrest\n"
    assert tool.splice(text, "new") == f"intro\n{tool.BEGIN}\nnew\n{tool.END}\nrest\n"
    with pytest.raises(ValueError, match="README has no"):
        tool.splice("no markers", "new")
    with pytest.raises(ValueError, match="README has no"):
        tool.splice(f"{tool.END}\n{tool.BEGIN}", "new")
