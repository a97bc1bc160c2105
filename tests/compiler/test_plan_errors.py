"""Every PlanError names the file:line, the stage and the likely fix; texts pinned."""

import re

import pytest

import tailrace as tr
from tailrace.api.yaml_loader import loads_pipeline

HEAD = "version: 1\npipeline: t\nsource: {fields: [text]}\nstages:\n"
F = "tests.fixtures.ops"

CASES = {
    "unknown operator": (
        f"  - {{id: a, op: mapp, fn: {F}.upper, input: text}}\n",
        "p.yaml:5: stage 'a': unknown operator 'mapp'; did you mean 'map'? (known: batch, "
        "branch, embed, filter, flat_map, generate, key_by, map, memory_read, memory_write, "
        "merge, prompt, refine, rerank, retrieve, route, select, semantic_state, sink, "
        "source, stateful, tool_call, verify; or a dotted path to a tailrace.Operator subclass)"),
    "duplicate id": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text}}\n"
        f"  - {{id: a, op: map, fn: {F}.upper, input: text}}\n",
        "p.yaml:6: stage 'a': duplicate stage id (first defined at p.yaml:5); give each "
        "stage a unique id"),
    "cycle": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, after: [c]}}\n"
        f"  - {{id: b, op: map, fn: {F}.upper, input: text, after: [a]}}\n"
        "  - {id: c, op: merge, after: [source, b]}\n",
        "p.yaml:5: stage 'a': cycle: a -> b -> c -> a; pipelines are acyclic — remove one "
        "of these 'after' links"),
    "unknown field": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: txt, output: u}}\n",
        "p.yaml:5: stage 'a': reads unknown field 'txt'; did you mean 'text'? (fields "
        "available here: text)"),
    "field used before it is written": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: answer, output: u}}\n"
        f"  - {{id: b, op: map, fn: {F}.upper, input: text, output: answer}}\n",
        "p.yaml:5: stage 'a': reads field 'answer' before it exists: it is written by stage "
        "'b', which does not run before this one; put this stage after 'b'"),
    "bad placement": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, placement: {{gpus: 1}}}}\n",
        "p.yaml:5: stage 'a': unknown placement option(s) gpus; known: num_cpus, num_gpus, "
        "memory, resources, strategy, where"),
    "bad placement where": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, placement: {{where: gpu}}}}\n",
        "p.yaml:5: stage 'a': placement where must be one of driver, host, got 'gpu'"),
    "bad placement strategy": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, placement: {{strategy: far}}}}\n",
        "p.yaml:5: stage 'a': placement strategy must be one of pack, spread, got 'far'"),
    "wrong contract type": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, replicas: two}}\n",
        "p.yaml:5: stage 'a': 'replicas' must be a positive integer, got 'two'"),
    "wrong parameter type": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: [text]}}\n",
        "p.yaml:5: stage 'a': 'input' must be a field name, got ['text']"),
    "unknown parameter": (
        f"  - {{id: a, op: map, fn: {F}.upper, inptu: text}}\n",
        "p.yaml:5: stage 'a': unknown parameter 'inptu' for operator 'map'; did you mean "
        "'input'? (its parameters: fn, input, output; contract keys: replicas, batch, "
        "timeout_ms, retries, queue, blocking, placement)"),
    "missing parameter": (
        "  - {id: a, op: map, input: text}\n",
        "p.yaml:5: stage 'a': operator 'map' needs 'fn' (callable or dotted path "
        "'pkg.module.function')"),
    "function not found": (
        f"  - {{id: a, op: map, fn: {F}.nope, input: text}}\n",
        "p.yaml:5: stage 'a': 'fn': module 'tests.fixtures.ops' has no attribute 'nope'"),
    "module not found": (
        "  - {id: a, op: map, fn: nosuchpkg.mod.fn, input: text}\n",
        "p.yaml:5: stage 'a': 'fn': cannot import module 'nosuchpkg.mod' for "
        "'nosuchpkg.mod.fn': No module named 'nosuchpkg'"),
    "not callable": (
        f"  - {{id: a, op: map, fn: {F}.NOT_CALLABLE, input: text}}\n",
        "p.yaml:5: stage 'a': 'fn': 'tests.fixtures.ops.NOT_CALLABLE' is not callable"),
    "unknown upstream": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, after: [sourse]}}\n",
        "p.yaml:5: stage 'a': 'after' names unknown stage 'sourse'; did you mean 'source'?"),
    "branch without port": (
        f"  - {{id: a, op: branch, fn: {F}.is_long, input: text}}\n"
        f"  - {{id: b, op: map, fn: {F}.upper, input: text, after: [a]}}\n",
        "p.yaml:6: stage 'b': 'a' is a branch; consume 'a.true' or 'a.false', not 'a'"),
    "zero queue": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, queue: 0}}\n",
        "p.yaml:5: stage 'a': 'queue' must be a positive integer (records), got 0"),
    "replicated keyed state": (
        f"  - {{id: a, op: stateful, fn: {F}.upper, key: text, replicas: 2}}\n",
        "p.yaml:5: stage 'a': a keyed-state operator cannot have replicas (got 2); its "
        "state lives in one replica — remove 'replicas'"),
    "elastic keyed state": (
        f"  - {{id: a, op: stateful, fn: {F}.upper, key: text, replicas: {{min: 1, max: 2}}}}\n",
        "p.yaml:5: stage 'a': a keyed-state operator cannot have replicas (got 2); its "
        "state lives in one replica — remove 'replicas'"),
    "replica bounds with an unknown key": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, replicas: {{min: 1, most: 3}}}}\n",
        "p.yaml:5: stage 'a': 'replicas' must be a positive integer or a mapping like "
        "{min: 1, max: 4}, got {'min': 1, 'most': 3}"),
    "replica bounds upside down": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, replicas: {{min: 3, max: 2}}}}\n",
        "p.yaml:5: stage 'a': 'replicas.max' must be an integer >= 'replicas.min' (3), got 2"),
    "batch contract on filter": (
        f"  - {{id: a, op: filter, fn: {F}.upper, input: text, batch: {{max_size: 4}}}}\n",
        "p.yaml:5: stage 'a': operator 'filter' does not take a 'batch' contract; use a "
        "'batch' stage to group records"),
    "bad batch size": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, batch: {{max_size: 0}}}}\n",
        "p.yaml:5: stage 'a': 'batch.max_size' must be a positive integer, got 0"),
    "negative timeout": (
        f"  - {{id: a, op: map, fn: {F}.upper, input: text, timeout_ms: -5}}\n",
        "p.yaml:5: stage 'a': 'timeout_ms' must be a positive number, got -5"),
    "custom operator bad param": (
        f"  - {{id: a, op: {F}.Suffix, sufix: '?'}}\n",
        "p.yaml:5: stage 'a': unknown parameter 'sufix' for operator "
        "'tests.fixtures.ops.Suffix'; did you mean 'suffix'? (its parameters: suffix; "
        "contract keys: replicas, batch, timeout_ms, retries, queue, blocking, placement)"),
    "invalid YAML": (
        "  - {id: a, op: map\n",
        "p.yaml:6: invalid YAML: expected ',' or '}', but got '<stream end>'"),
    "reserved id": (
        "  - {id: sink, op: map, fn: x.y}\n",
        "p.yaml:5: stage 'sink': 'sink' is reserved for the implicit sink; rename the stage"),
    "stage without id": (
        "  - {op: map}\n",
        "p.yaml:5: stage needs an 'id' made of letters, digits, '_' or '-' (got None)"),
}


@pytest.mark.parametrize("body,message", CASES.values(), ids=list(CASES))
def test_yaml_plan_errors(body, message):
    with pytest.raises(tr.PlanError, match=re.escape(message) + "$"):
        tr.compile_pipeline(loads_pipeline(HEAD + body, "p.yaml"))


TOP_CASES = {
    "no version": ("pipeline: t\nstages: []\n",
                   "p.yaml:1: unsupported version None; this tailrace reads 'version: 1'"),
    "misspelt key": ("version: 1\npipeline: t\nstage: []\n",
                     "p.yaml:1: unknown top-level key 'stage'; did you mean 'stages'? "
                     "(allowed: version, pipeline, description, slo, engines, source, serve, "
                     "stages)"),
    "not a mapping": ("- a\n", "p.yaml:1: expected a mapping with 'version', 'pipeline' "
                      "and 'stages' at the top level"),
    "no stages": ("version: 1\npipeline: t\nstages: []\n",
                  "p.yaml:1: 'stages' must be a non-empty list of stages"),
}


@pytest.mark.parametrize("text,message", TOP_CASES.values(), ids=list(TOP_CASES))
def test_yaml_document_errors(text, message):
    with pytest.raises(tr.PlanError, match=re.escape(message) + "$"):
        loads_pipeline(text, "p.yaml")


def test_missing_file():
    with pytest.raises(tr.PlanError, match=r"^nope\.yaml: no such file; check the path$"):
        tr.Pipeline.from_yaml("nope.yaml")


def test_python_errors_point_at_the_calling_line():
    p = tr.Pipeline("t")
    p.source([1]).map("os.path.nope").sink()
    with pytest.raises(tr.PlanError, match=r"test_plan_errors\.py:\d+: stage 'map': 'fn': "
                       r"module 'os.path' has no attribute 'nope'$"):
        tr.compile_pipeline(p)


def test_python_dangling_stream_is_an_error():
    p = tr.Pipeline("t")
    p.source([1]).map(abs, id="m")
    with pytest.raises(tr.PlanError, match=r"stage 'm': output has no consumer, so its "
                       r"records would be dropped; add a sink \(or a stage after it\)$"):
        tr.compile_pipeline(p)


def test_python_unknown_contract_key():
    p = tr.Pipeline("t")
    with pytest.raises(tr.PlanError, match=r"stage 'map': unexpected keyword argument\(s\): "
                       r"replica; contract keys are: replicas, batch"):
        p.source([1]).map(abs, replica=2)


def test_unbound_source_at_run_time():
    p = tr.Pipeline("t")
    p.source().sink()
    with pytest.raises(tr.PlanError, match=r"stage 'source': source has no data: pass "
                       r"tr.run\(p, input=records\)$"):
        tr.run(p)


@pytest.mark.parametrize("method", ["filter", "flat_map", "key_by", "branch"])
def test_an_async_function_where_a_plain_one_is_called_is_refused(method):
    """An async predicate used to keep every record silently (a coroutine is truthy)."""
    async def pred(x):
        return False

    p = tr.Pipeline("t")
    if method == "branch":
        yes, no = p.source([1]).branch(pred, id="s")
        yes.merge(no).sink([])
    else:
        getattr(p.source([1]), method)(pred, id="s").sink([])
    with pytest.raises(tr.PlanError, match="'fn' is an async function, but '" + method +
                       "' calls it synchronously"):
        tr.compile_pipeline(p)
