"""Structured output on the real SmolLM2-135M (llama.cpp grammar sampling): answers that
validate against their JSON schema, json_object, constrained and free sequences in one
batch, per-sequence grammar state, no leaked samplers, a bounded grammar cache, and the
constraint crossing an engine pool's process boundary."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tailrace.engines import llama_cpp as llama_module
from tailrace.engines.base import GenerationRequest
from tailrace.engines.llama_cpp import LlamaCppEngine
from tailrace.engines.llama_cpp import grammar as llama_grammar
from tailrace.engines.structured import check_answer, check_response_format
from tailrace.errors import StructuredOutputError

pytestmark = pytest.mark.engine

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]}}}
ASK = "Describe a person as JSON with a name, an age and a favourite color."


def fmt(schema: dict, name: str = "person") -> dict:
    return check_response_format({"type": "json_schema",
                                  "json_schema": {"name": name, "schema": schema}})


def chat(text: str = ASK, max_tokens: int = 64, **kw) -> GenerationRequest:
    return GenerationRequest(messages=({"role": "user", "content": text},),
                             max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def engine():
    eng = LlamaCppEngine("smollm2-135m-instruct", n_threads=2, n_ctx=512, n_seq_max=4)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def person(engine):
    """The greedy constrained answer to ASK, alone."""
    [g] = engine.generate([chat(response_format=fmt(PERSON))])
    return g


def test_greedy_with_a_schema_gives_json_that_validates(person):
    value = json.loads(person.text)
    jsonschema.validate(value, PERSON)
    assert isinstance(value["age"], int) and value["color"] in ("red", "green", "blue")
    assert person.finish_reason == "stop"  # the grammar ended it, not max_tokens


def test_without_the_grammar_the_model_does_not_answer_in_json(engine):
    [g] = engine.generate([chat()])
    with pytest.raises(ValueError):
        json.loads(g.text)


def test_json_object_gives_an_object(engine):
    [g] = engine.generate([chat("Tell me about cats.", max_tokens=128,
                                response_format={"type": "json_object"})])
    assert isinstance(json.loads(g.text), dict), g.text


def test_a_sampled_answer_validates_too(engine):
    reqs = [chat(response_format=fmt(PERSON), temperature=1.0, seed=s) for s in (1, 2, 3)]
    for g in engine.generate(reqs):
        jsonschema.validate(json.loads(g.text), PERSON)


def test_constrained_and_free_sequences_share_a_batch(engine, person):
    free_alone = engine.generate([chat()])[0].text
    other = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    reqs = [chat(), chat(response_format=fmt(PERSON)),
            chat("Is the sky blue?", response_format=fmt(other, "yes_no")),
            chat(response_format={"type": "json_object"})]
    gens = engine.generate(reqs)
    assert gens[0].text == free_alone  # the free one is untouched by its neighbours
    assert gens[1].text == person.text  # each sequence keeps its own grammar state
    jsonschema.validate(json.loads(gens[2].text), other)
    assert isinstance(json.loads(gens[3].text), dict)
    for r, g in zip(reqs[1:], gens[1:], strict=True):
        assert check_answer(g.text, r.response_format, g.finish_reason, r.max_tokens) is None


def test_a_short_max_tokens_cuts_the_json_and_the_check_says_so(engine):
    r = chat(max_tokens=4, response_format=fmt(PERSON))
    [g] = engine.generate([r])
    assert g.finish_reason == "length"
    assert check_answer(g.text, r.response_format, g.finish_reason, 4) == (
        "the answer was cut at max_tokens=4 before its JSON was complete; raise max_tokens")


def test_an_invalid_schema_is_a_clear_error(engine):
    with pytest.raises(ValueError, match=r"response_format.json_schema.schema is not a valid "
                                         r"JSON Schema: \['type'\]: 'person' is not valid"):
        fmt({"type": "person"})
    # valid JSON Schema that llama.cpp's converter does not support
    with pytest.raises(StructuredOutputError, match=r"response_format.json_schema.schema: "
                                                    r"llama.cpp cannot build a grammar from it "
                                                    r"\(AssertionError: Unrecognized schema"):
        engine.generate([chat(), chat(response_format=fmt({"not": {"type": "string"}}))])
    # a request built by hand is checked too, naming the field
    for bad, message in (({"type": "xml"}, r"response_format.type must be 'text', "
                                           r"'json_object' or 'json_schema', got 'xml'"),
                         ({"type": "json_schema", "json_schema": {"schema": [1]}},
                          r"response_format.json_schema.schema must be an object")):
        with pytest.raises(StructuredOutputError, match=message):
            engine.generate([chat(response_format=bad)])
    assert engine.generate([chat(max_tokens=2)])[0].completion_tokens == 2  # still serves


def test_grammar_samplers_are_freed_and_the_cache_is_bounded(engine, monkeypatch):
    lib = llama_module.llama_lib()
    live: set[int] = set()
    clone, free = lib.llama_sampler_clone, lib.llama_sampler_free

    def counted_clone(proto):
        s = clone(proto)
        live.add(id(s))  # ctypes pointers: track by the wrapper object
        counted_clone.made.append(s)
        return s

    counted_clone.made = []
    freed: list = []
    monkeypatch.setattr(lib, "llama_sampler_clone", counted_clone)
    monkeypatch.setattr(lib, "llama_sampler_free", lambda s: (freed.append(s), free(s)))
    monkeypatch.setattr(llama_grammar, "GRAMMAR_CACHE", 2)
    schemas = [{"type": "object", "required": [k], "properties": {k: {"type": "integer"}}}
               for k in ("a", "b", "c")]
    cancel_after_one = lambda i, piece: i != 1  # noqa: E731 - the caller of #1 went away
    reqs = [chat("Give a.", max_tokens=24, response_format=fmt(schemas[0])),
            chat("Give b.", max_tokens=24, response_format=fmt(schemas[1])),
            chat("Give c.", max_tokens=0, response_format=fmt(schemas[2])),
            chat("Give c.", max_tokens=24, response_format=fmt(schemas[2]))]
    gens = engine.generate(reqs, cancel_after_one)
    assert gens[1].finish_reason == "cancelled" and gens[2].completion_tokens == 0
    made = counted_clone.made
    assert len(made) == 4
    assert all(any(f is m for f in freed) for m in made)  # every sequence's sampler freed
    assert len(engine._grammars) == 2  # the oldest compiled grammars were evicted (and freed)


def test_the_constraint_crosses_a_pool_process(person):
    from tailrace.engines.pool import EnginePool

    spec = {"backend": "llama_cpp", "model": "smollm2-135m-instruct", "n_threads": 2,
            "n_ctx": 512, "n_seq_max": 4}
    with EnginePool("json", spec, replicas=1) as pool:
        [g] = pool.generate([chat(response_format=fmt(PERSON))])
    assert g.text == person.text  # the replica process enforced the same grammar


def test_the_docs_example_runs(capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    [code] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
              if "response_format" in b]
    exec(code, {})  # noqa: S102
    text, finish = capsys.readouterr().out.strip().rsplit(" ", 1)
    assert json.loads(text) == {"city": "Paris"} and finish == "stop"
