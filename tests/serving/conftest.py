"""Fixtures of the serving tests: a one-stage YAML pipeline for ``tailrace serve`` runs."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPE = """\
version: 1
pipeline: loud
source: {fields: [text]}
stages:
  - {id: up, op: map, fn: tests.fixtures.ops.upper, input: text, output: loud}
"""


@pytest.fixture
def pipe(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "loud.yaml"
    path.write_text(PIPE)
    return path
