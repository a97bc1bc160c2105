"""Client tools, engine-neutral: checking a request's tools, the call form and its
parsers (whole and streamed), the prompt for engines that read tools as text, and the
llama.cpp grammar that holds an answer to a call."""

from __future__ import annotations

import json

import pytest

from tailrace.engines.tool_calls import (
    CallStream,
    ToolSpec,
    call_schema,
    check_tools,
    format_call,
    split_calls,
    tool_prompt,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


def test_check_tools_reads_the_chat_and_the_flat_forms():
    spec = check_tools([WEATHER, ADD], None, None)
    assert spec is not None and spec.choice == "auto" and spec.parallel
    assert [f["name"] for f in spec.offered] == ["get_weather", "add"]
    named = check_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}},
                        False)
    assert named.choice == "add" and named.must_call and not named.parallel
    assert [f["name"] for f in named.offered] == ["add"]
    flat = check_tools([{"type": "function", **WEATHER["function"]}],
                       {"type": "function", "name": "get_weather"}, None, flat=True)
    assert flat.offered[0]["parameters"]["required"] == ["city"]
    assert check_tools([WEATHER], "none", None).offered == ()
    assert check_tools(None, None, None) is None and check_tools([], "auto", None) is None
    no_params = check_tools([{"type": "function", "function": {"name": "ping"}}], None, None)
    assert no_params.functions[0]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(("tools", "choice", "parallel", "says"), [
    ([WEATHER], "sometimes", None, "'tool_choice' must be none, auto, required"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None,
     "names function 'nope', which 'tools' does not offer"),
    (None, "required", None, "'tool_choice' needs 'tools'"),
    ([{"type": "web_search"}], None, None, "tools[0].type: 'web_search' tools are not supported"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, None,
     "tools[0].function.name must be 1-64 letters"),
    ([WEATHER, WEATHER], None, None, "'get_weather' is offered twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     None, None, "parameters must be a JSON Schema of an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                    "required": 3}}}],
     None, None, "tools[0].function.parameters is not a valid JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, None,
     "unknown field 'extra'"),
    ([WEATHER], None, "yes", "'parallel_tool_calls' must be true or false"),
    ("f", None, None, "'tools' must be a list"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, parallel, says):
    with pytest.raises(ValueError, match=None) as e:
        check_tools(tools, choice, parallel)
    assert says in str(e.value)


def test_a_whole_answer_splits_into_text_and_calls():
    text = format_call("get_weather", '{"city": "Paris"}') + format_call("add", "{}")
    assert split_calls(text) == ("", [["get_weather", '{"city": "Paris"}'], ["add", "{}"]])
    # arguments before name: still a call
    assert split_calls('<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call>') == \
        ("", [["g", '{"x": 1}']])
    # not the call form, or a call that did not close: all text, no calls
    for t in ("hello <tool_call> there", '<tool_call>{"name": "g", "arguments": {"x": 1',
              "<tool", '<tool_call>{"name": "g", "arguments": 3}</tool_call>', ""):
        assert split_calls(t) == (t, [])


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_pieces_give_the_name_first_then_the_arguments(size):
    args = '{"city": "Pa\\"ris}", "deep": {"a": [1, {"b": "}"}]}}'
    text = "  " + format_call("get_weather", args) + format_call("add", '{"a": 1}')
    s, events = CallStream(), []
    for k in range(0, len(text), size):
        events += s.feed(text[k:k + size])
    events += s.close()
    assert not s.broken
    starts = [e for e in events if e[0] == "call"]
    assert starts == [("call", 0, "get_weather"), ("call", 1, "add")]
    first_args = next(i for i, e in enumerate(events) if e[0] == "args")
    assert events.index(starts[0]) < first_args  # the name comes before any argument
    got = ["".join(e[2] for e in events if e[0] == "args" and e[1] == i) for i in (0, 1)]
    assert got == [args, '{"a": 1}'] and json.loads(got[0])["deep"]["a"][1]["b"] == "}"
    assert s.calls == [["get_weather", args], ["add", '{"a": 1}']]
    assert not [e for e in events if e[0] == "text"]


def test_streamed_text_passes_through_and_a_cut_call_is_broken():
    s = CallStream()
    events = s.feed("<to") + s.feed("day is sunny") + s.close()
    assert [e for e in events if e[0] == "text"] and "".join(
        e[1] for e in events) == "<today is sunny"
    cut = CallStream()
    cut.feed('<tool_call>{"name": "f", "arguments": {"x"')
    cut.close()
    assert cut.broken and cut.calls == [["f", '{"x"']]


def test_tool_prompt_puts_tools_in_the_system_message_and_calls_in_the_form():
    spec = check_tools([WEATHER], "required", None)
    msgs = tool_prompt([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], spec)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[0]["content"].endswith("Answer with a function call.")
    assert msgs[2] == {"role": "assistant", "content": format_call("get_weather",
                                                                  '{"city": "Paris"}')}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # tool_choice none: no tools described
    plain = tool_prompt([{"role": "user", "content": "hi"}], check_tools([WEATHER], "none", None))
    assert plain == ({"role": "user", "content": "hi"},)


def test_the_call_schema_allows_exactly_the_offered_functions():
    jsonschema = pytest.importorskip("jsonschema")
    schema = call_schema(check_tools([WEATHER, ADD], "auto", None))
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for bad in ({"name": "other", "arguments": {}}, {"name": "get_weather", "arguments": {}},
                {"name": "add", "arguments": {"a": "x"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = call_schema(ToolSpec(check_tools([WEATHER, ADD], None, None).functions, "add"))
    assert one["properties"]["name"] == {"const": "add"}


def test_the_llama_grammar_holds_calls_and_lets_auto_answer_text():
    pytest.importorskip("llama_cpp")
    from tailrace.engines.llama_cpp.grammar import tool_grammar

    schema = json.dumps(call_schema(check_tools([WEATHER], "auto", None)))
    must = tool_grammar(True, False, schema)
    assert must.startswith("root ::= tr-calls\n") and "tr-calls ::= tr-one\n" in must
    assert "tr-free" not in must
    auto = tool_grammar(False, True, schema)
    assert "root ::= tr-calls | tr-free" in auto and "tr-calls ::= tr-one tr-one*" in auto
    assert "tr-call ::=" in auto and "\nroot ::= alternative" not in auto
