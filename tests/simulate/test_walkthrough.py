"""docs/simulate.md's walk-through prints what the simulator prints: each command of its
section 4 is run here and its shown output compared (the shown lines are the last
ones of its stderr then stdout; the wall time of the closing line is left out)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tailrace.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "simulate.md"
WALL = re.compile(r" in [0-9.]+s: [0-9]+ requests/s$")


def walkthrough() -> list[tuple[str, list[str]]]:
    """(command, shown lines) of each command in the walk-through section."""
    text = DOC.read_text()
    section = text[text.index("## 4. A walk-through"):text.index("## 5. How it works")]
    pairs = re.findall(r"\n    (tailrace simulate [^\n]*(?:\\\n[^\n]*)*)\n\n```\n(.*?)\n```",
                       section, re.S)
    return [(cmd.replace("\\\n", " "), shown.splitlines()) for cmd, shown in pairs]


def test_the_walkthrough_has_its_commands():
    cmds = [c for c, _ in walkthrough()]
    assert len(cmds) == 4 and all("--profile bench/profiles/wiki-qa.json" in c for c in cmds)


@pytest.mark.parametrize("cmd,shown", walkthrough(), ids=lambda x: "")
def test_the_walkthrough_shows_what_the_simulator_prints(cmd, shown, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(cmd)[1:]) == 0
    cap = capsys.readouterr()  # --find's progress lines go to stderr, before the answer
    out = (cap.err + cap.out).rstrip("\n").splitlines()
    printed = out[-len(shown):]
    if shown[-1].startswith("simulated "):
        shown, printed = shown[:-1] + [WALL.sub("", shown[-1])], \
            printed[:-1] + [WALL.sub("", printed[-1])]
    assert printed == shown, f"docs/simulate.md shows other output for: {cmd}"
