"""The README's "Agents" snippets (OpenAI Agents SDK, LangChain) run as written against
examples/agent.yaml served on the embedded SmolLM2, and print what the README shows."""

from __future__ import annotations

import os
import re

import pytest

from tailrace.api.yaml_loader import load_pipeline
from tailrace.serving import PipelineService, ServingHub
from tests.serving.server import running

pytestmark = pytest.mark.engine
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def section() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return text.split("## Agents\n", 1)[1].split("\n## ", 1)[0]


@pytest.fixture(scope="module")
def url():
    hub = ServingHub([PipelineService(load_pipeline(os.path.join(ROOT, "examples",
                                                                 "agent.yaml")))])
    with running(hub) as u:
        yield u


@pytest.mark.parametrize("which", [0, 1], ids=["agents-sdk", "langchain"])
def test_the_readme_agent_snippets_print_what_it_shows(url, which, capsys):
    text = section()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[which]
    after = text.split(code, 1)[1]  # the first indented block after the snippet
    shown = re.search(r"\n\n((?:    .*\n)+)", after).group(1)
    exec(compile(code.replace("http://127.0.0.1:8000", url), "README.md", "exec"), {})
    out = capsys.readouterr().out
    want = [line[4:] for line in shown.splitlines() if line.strip()]
    got = out.splitlines()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):  # call ids differ per run: up to the "..."
        head = w.split("...")[0]
        assert g.startswith(head), (g, w)
