"""The YAML and Python forms of a pipeline compile to identical plans."""

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tests.fixtures import ops

YAML = """\
version: 1
pipeline: eq
source: {fields: [text]}
stages:
  - {id: up, op: map, fn: tests.fixtures.ops.upper, input: text, output: loud}
  - {id: size, op: map, fn: tests.fixtures.ops.n_chars, input: text, output: n, replicas: 2}
  - {id: long, op: branch, fn: tests.fixtures.ops.is_long, input: n}
  - {id: tagged, op: map, after: [long.true], fn: tests.fixtures.ops.tag, input: loud,
     timeout_ms: 500, retries: 1}
  - {id: both, op: merge, after: [tagged, long.false], queue: 16}
  - {id: bang, op: tests.fixtures.ops.Suffix, suffix: "!"}
"""


def python_form():
    p = tr.Pipeline("eq")
    s = p.source(fields=["text"])
    s = s.map(ops.upper, id="up", input="text", output="loud")
    s = s.map("tests.fixtures.ops.n_chars", id="size", input="text", output="n", replicas=2)
    t, f = s.branch(ops.is_long, id="long", input="n")
    t = t.map(ops.tag, id="tagged", input="loud", timeout_ms=500, retries=1)
    t.merge(f, id="both", queue=16).apply(ops.Suffix, id="bang", suffix="!").sink()
    return p


def test_yaml_and_python_give_identical_plans():
    for fuse in (True, False):
        y = tr.compile_pipeline(loads_pipeline(YAML, "eq.yaml"), fuse=fuse)
        py = tr.compile_pipeline(python_form(), fuse=fuse)
        assert y.to_dict() == py.to_dict()
        assert y.render("text") == py.render("text")


def test_yaml_and_python_give_identical_results():
    records = [{"text": "hi"}, {"text": "hello"}]
    y = tr.run(loads_pipeline(YAML, "eq.yaml"), input=records)
    py = tr.run(python_form(), input=records)
    key = lambda r: r["text"]  # noqa: E731
    assert sorted(y.outputs, key=key) == sorted(py.outputs, key=key) == [
        {"text": "hello!", "loud": "<HELLO>", "n": 5},
        {"text": "hi!", "loud": "HI", "n": 2},
    ]


def test_yaml_terminal_stages_all_feed_the_sink():
    text = ("version: 1\npipeline: t\nstages:\n"
            "  - {id: b, op: branch, fn: tests.fixtures.ops.is_long, input: n}\n")
    result = tr.run(loads_pipeline(text), input=[{"n": 1}, {"n": 9}])
    assert sorted(r["n"] for r in result.outputs) == [1, 9]


def test_building_runs_nothing():
    calls = []
    p = tr.Pipeline("lazy")
    p.source(iter([1, 2])).map(calls.append).sink()
    tr.compile_pipeline(p)
    assert calls == []
