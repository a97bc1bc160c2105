"""verify: each verifier kind passes and fails, the operator in a pipeline (verdicts,
counters, on_fail error), and bad specs refused at compile time, naming the stage."""

from __future__ import annotations

import asyncio
import re

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline
from tailrace.compiler import compile_pipeline
from tailrace.errors import FieldError, PlanError
from tailrace.verify import Verdict, Verifier, make_verifier

PROMPT = 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
TASK = {"task_id": "t/0", "prompt": PROMPT, "entry_point": "add", "test": TEST}


def verdict(spec, answer, record=None) -> Verdict:
    return asyncio.run(make_verifier(spec, "verifier")(answer, record or {}))


# -- each kind --------------------------------------------------------------------------------
@pytest.mark.parametrize("answer", [
    "    return a + b\n",  # a completion of the prompt
    "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.",  # a whole solution
    "```\ndef add(a, b):\n    return b + a\n```",
])
def test_unit_tests_pass(answer):
    assert verdict({"unit_tests": {}}, answer, TASK) == Verdict(True, "passed", "unit_tests")


@pytest.mark.parametrize("answer,reason", [
    ("    return a - b\n", "AssertionError at line 7: assert candidate(2, 3) == 5"),
    ("    while True:\n        pass\n", "timeout after 1 s"),
    ("    import sys\n    sys.exit(0)\n", "exited before the end (sys.exit(0))"),
    ("    import socket\n    return socket.socket()\n", "refused: socket"),
    ("    x = bytearray(10 ** 10)\n", "memory limit (128 MB)"),
])
def test_unit_tests_fail_with_the_reason(answer, reason):
    v = verdict({"unit_tests": {"timeout_s": 1, "memory_mb": 128}}, answer, TASK)
    assert (v.ok, v.reason) == (False, reason)


def test_unit_tests_read_their_fields_by_name():
    task = {"q": PROMPT, "fn": "add", "tests": "assert add(1, 1) == 2\n"}  # MBPP-style asserts
    spec = {"unit_tests": {"tests": "tests", "entry_point": "fn", "prompt": "q"}}
    assert make_verifier(spec).fields == ("tests", "fn", "q")
    assert verdict(spec, "    return a + b\n", task).ok
    lacks = re.escape("reads field 'test', which the record lacks (it has: prompt, entry_point)")
    with pytest.raises(FieldError, match=lacks):
        verdict({"unit_tests": {}}, "x", {"prompt": "", "entry_point": "f"})


def test_json_schema():
    spec = {"json_schema": {"type": "object", "required": ["n"],
                            "properties": {"n": {"type": "integer"}}}}
    assert verdict(spec, '{"n": 3}').ok
    assert verdict(spec, 'Sure:\n```json\n{"n": 3}\n```').ok
    v = verdict(spec, '{"n": "three"}')
    assert (v.ok, v.reason) == (False, "does not match the schema at n: 'three' is not of type "
                                       "'integer'")
    assert verdict(spec, "n = 3").reason.startswith("not JSON: Expecting value")


def test_regex():
    assert verdict({"regex": r"\b42\b"}, "the answer is 42").reason == "matched '42'"
    v = verdict({"regex": r"^\d+$"}, "forty-two")
    assert (v.ok, v.reason) == (False, r"no match for '^\\d+$'")
    assert verdict({"regex": {"pattern": "^yes", "flags": "i"}}, "YES").ok


PASSAGES = [{"id": 1, "title": "Marie Curie", "text": "Marie Curie won the Nobel Prize in "
             "Physics in 1903 and the Nobel Prize in Chemistry in 1911."}]


def test_grounded():
    rec = {"passages": PASSAGES}
    v = verdict({"grounded": {}}, "Marie Curie won the Nobel Prize in 1911.", rec)
    assert (v.ok, v.reason) == (True, "grounded: 4/4 terms in the passages (1.00 >= 0.6)")
    v = verdict({"grounded": {}}, "Albert Einstein won it in 1921 for relativity.", rec)
    assert not v.ok
    assert v.reason.startswith("not grounded: 1/4 terms") and "Albert Einstein" in v.reason
    texts = {"ctx": ["Paris is the capital of France."]}  # a list of strings
    assert verdict({"grounded": {"passages": "ctx", "min_overlap": 1}}, "Paris, France.",
                   texts).ok
    assert verdict({"grounded": {}}, "  ", rec).reason == "empty answer"


def test_grounded_with_max_terms_fails_a_long_answer_however_grounded():
    rec = {"passages": PASSAGES}
    long = "Marie Curie won the Nobel Prize in 1911."  # 4 terms, all in the passages
    assert verdict({"grounded": {"max_terms": 4}}, long, rec).ok
    v = verdict({"grounded": {"max_terms": 3}}, long, rec)
    assert not v.ok and v.reason.startswith("not a short answer: 4 terms > 3 (Marie Curie")
    assert verdict({"grounded": {"max_terms": 1}}, "Yes.", rec).ok  # claims nothing


def is_upper(answer, record):
    return answer.isupper()


async def matches_gold(answer, record):
    return answer == record["gold"], f"expected {record['gold']!r}"


def test_python_functions_sync_async_and_by_path():
    assert verdict({"python": is_upper}, "ABC") == Verdict(True, "passed",
                                                           f"python:{__name__}.is_upper")
    assert verdict({"python": f"{__name__}:is_upper"}, "abc").reason == "failed"
    v = verdict({"python": matches_gold}, "4", {"gold": "5"})
    assert (v.ok, v.reason) == (False, "expected '5'")
    with pytest.raises(TypeError, match="return a bool, \\(bool, reason\\) or a Verdict"):
        verdict({"python": lambda a, r: "yes"}, "x")


class Length(Verifier):
    name = "length"

    async def __call__(self, answer, record):
        return self.verdict(len(answer) < 5, f"{len(answer)} characters")


def test_a_verifier_object_is_taken_as_it_is():
    v = Length()
    assert make_verifier(v) is v and verdict(v, "abc").ok


# -- the operator in a pipeline -----------------------------------------------------------------
def test_verify_in_a_pipeline_keeps_verdicts_and_counts(run):
    p = loads_pipeline("""
version: 1
pipeline: check-code
source: {fields: [task_id, prompt, entry_point, test, completion]}
stages:
  - {id: check, op: verify, field: completion, verifier: {unit_tests: {timeout_s: 5}}}
""")
    good = {**TASK, "completion": "    return a + b\n"}
    bad = {**TASK, "task_id": "t/1", "completion": "    return 0\n"}
    result = run(p, input=[good, bad])
    assert not result.errors
    got = {r["task_id"]: r["verdict"] for r in result.outputs}
    assert got["t/0"] == {"ok": True, "reason": "passed", "verifier": "unit_tests"}
    assert got["t/1"]["ok"] is False and got["t/1"]["reason"].startswith("AssertionError")
    if run.runtime == "local":  # (the Ray runtime does not gather operator counters yet)
        assert result.stats["check"].counters == {"verified": 2, "passed": 1, "failed": 1}


def test_on_fail_error_ends_the_record_as_an_error_record_with_the_reason():
    p = tr.Pipeline("t")
    p.source(fields=["answer"]).apply("verify", id="check", verifier={"regex": "^[0-9]+$"},
                                      on_fail="error", out="v").sink()
    result = tr.run(p, input=[{"answer": "7"}, {"answer": "seven"}])
    assert result.outputs == [{"answer": "7", "v": {"ok": True, "reason": "matched '7'",
                                                    "verifier": "regex"}}]
    (e,) = result.errors
    assert (e.stage, e.error, e.input) == ("check", "VerificationFailed", {"answer": "seven"})
    assert e.message == "regex: no match for '^[0-9]+$'"


def test_a_missing_field_or_a_broken_check_is_an_error_record_not_a_verdict():
    def broken(answer, record):
        raise RuntimeError("check crashed")

    p = tr.Pipeline("t")
    s = p.source()
    s.apply("verify", id="a", verifier={"python": broken}).sink()
    result = tr.run(p, input=[{"answer": "x"}, {"text": "no answer"}])
    assert sorted(e.error for e in result.errors) == ["FieldError", "RuntimeError"]
    assert result.outputs == []


def test_a_structured_answer_is_checked_as_json():
    p = tr.Pipeline("t")
    p.source().apply("verify", verifier={"json_schema": {"type": "object"}}).sink()
    assert tr.run(p, input=[{"answer": {"a": 1}}]).outputs[0]["verdict"]["ok"]


# -- refused at compile time ----------------------------------------------------------------------
def compile_yaml(stage: str):
    return compile_pipeline(loads_pipeline(
        "{version: 1, pipeline: ex, source: {fields: [answer, test, prompt, entry_point]}, "
        f"stages: [{stage}]}}"))


@pytest.mark.parametrize("stage,message", [
    ("{id: c, op: verify, verifier: {regexp: x}}",
     "stage 'c': verifier: unknown verifier 'regexp'; did you mean 'regex'? (accepted: "
     "unit_tests, json_schema, regex, grounded, python)"),
    ("{id: c, op: verify, verifier: {regex: x, python: m:f}}",
     "stage 'c': verifier: must be a mapping with exactly one of unit_tests, json_schema, "),
    ("{id: c, op: verify, verifier: {}}", "stage 'c': verifier: must be a mapping with exactly"),
    ("{id: c, op: verify, verifier: {regex: '('}}",
     "stage 'c': verifier: regex: bad pattern '(': missing ), unterminated subpattern"),
    ("{id: c, op: verify, verifier: {unit_tests: {memory_mb: 8}}}",
     "stage 'c': verifier: unit_tests: 'memory_mb' must be an integer number of MiB, >= 64, "
     "got 8"),
    ("{id: c, op: verify, verifier: {unit_tests: {timeout_s: 0}}}",
     "stage 'c': verifier: unit_tests: 'timeout_s' must be seconds, > 0"),
    ("{id: c, op: verify, verifier: {unit_tests: {test: t}}}",
     "stage 'c': verifier: unit_tests: unknown option 'test' (options: tests, "),
    ("{id: c, op: verify, verifier: {json_schema: {type: 3}}}",
     "stage 'c': verifier: json_schema: not a valid JSON Schema at type"),
    ("{id: c, op: verify, verifier: {python: 'no_such_module:f'}}",
     "stage 'c': verifier: python: cannot import module 'no_such_module'"),
    ("{id: c, op: verify, verifier: {grounded: {min_overlap: 2}}}",
     "stage 'c': verifier: grounded: 'min_overlap' must be a number from 0 to 1, got 2"),
    ("{id: c, op: verify, verifier: {grounded: {max_terms: 0}}}",
     "stage 'c': verifier: grounded: 'max_terms' must be an integer >= 1, got 0"),
    ("{id: c, op: verify, verifier: {grounded: {max_words: 3}}}",
     "stage 'c': verifier: grounded: unknown option 'max_words' (options: passages, "
     "min_overlap, max_terms)"),
    ("{id: c, op: verify, verifier: {regex: x}, on_fail: drop}",
     "stage 'c': 'on_fail' must be keep or error, got 'drop'"),
    ("{id: c, op: verify}", "stage 'c': operator 'verify' needs 'verifier'"),
    ("{id: c, op: verify, verifier: {grounded: {}}}",
     "stage 'c': reads unknown field 'passages'"),
])
def test_bad_specs_are_one_line_plan_errors_naming_the_stage(stage, message):
    with pytest.raises(PlanError, match=re.escape(message)) as e:
        compile_yaml(stage)
    assert "\n" not in str(e.value)


def test_a_good_spec_compiles_and_declares_the_fields_it_reads():
    plan = compile_yaml("{id: c, op: verify, verifier: {unit_tests: {}}, out: v}")
    op = plan.stage("c").ops[0]
    assert op.op.fields(op.params) == (("answer", "test", "entry_point", "prompt"), ("v",))
