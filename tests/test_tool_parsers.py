"""Tool-call parsers (hermes, llama3_json) on whole outputs and on the same outputs streamed in
every way of cutting them, plus the request checks and the forced tool_choice modes."""

from __future__ import annotations

import json
import re

import pytest

from atb_plugin.server.tool_parsers import (
    TOOL_PARSERS,
    StreamDelta,
    ToolCallDelta,
    assemble_deltas,
    check_tools,
    get_tool_parser,
    parse_forced_tool_calls,
    split_partial_tag,
    tool_choice_schema,
)
from tests.helpers import chunkings

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'

# (output text, expected content, expected [(name, arguments)])
HERMES = {
    "plain text": ("Hello there, how are you? a < b", "Hello there, how are you? a < b", []),
    "one call, Qwen2.5 layout": (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER_ARGS)]),
    "content first, two calls, whitespace around": (
        f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        "Let me check.\n",
        [("get_weather", WEATHER_ARGS), ("get_time", "{}")],
    ),
    "compact JSON is re-serialised": (
        '<tool_call>{"name":"f","arguments":{"x":[1,2],"y":"Zürich"}}</tool_call>',
        None,
        [("f", '{"x": [1, 2], "y": "Zürich"}')],
    ),
    "malformed JSON stays content": (
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',
        [],
    ),
    "no name stays content": (
        '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "arguments not an object stay content": (
        '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
        [],
    ),
    "malformed between two calls": (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>oops</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"k": "v"}}</tool_call>',
        "<tool_call>oops</tool_call>\n",
        [("a", "{}"), ("b", '{"k": "v"}')],
    ),
    "text after a call keeps its space": (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> Done.',
        " Done.",
        [("a", "{}")],
    ),
    "unclosed but complete call": ('<tool_call>\n{"name": "a", "arguments": {"n": 1}}', None, [("a", '{"n": 1}')]),
    "cut short inside a call": (
        'Sure. <tool_call>{"name": "a", "argu',
        'Sure. <tool_call>{"name": "a", "argu',
        [],
    ),
    "a partial tag at the very end": ("The tag is <tool_ca", "The tag is <tool_ca", []),
    "closing tag alone is content": ("x </tool_call> y", "x </tool_call> y", []),
}

LLAMA3 = {
    "one call": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    "python tag, nesting, braces in strings": (
        '<|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": "}]{"}], "q": "say \\"}\\""}}',
        None,
        [("f", '{"a": [1, {"b": "}]{"}], "q": "say \\"}\\""}')],
    ),
    "two calls separated by ;": (
        '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "y;z"}}',
        None,
        [("a", "{}"), ("b", '{"x": "y;z"}')],
    ),
    "leading whitespace": ('  \n{"name": "a", "parameters": {"n": 1}}\n', None, [("a", '{"n": 1}')]),
    "plain text": ("The answer is {not json}", "The answer is {not json}", []),
    "python code after the tag is content": ('<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    "malformed JSON stays content": (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1]}',
        '<|python_tag|>{"name": "a", "parameters": {"x": 1]}',
        [],
    ),
    "an object that is not a call": ('{"city": "Paris"}', '{"city": "Paris"}', []),
    "cut short": ('{"name": "a", "parameters": {"x": ', '{"name": "a", "parameters": {"x": ', []),
    "good call then a bad one": ('{"name": "a", "parameters": {}}; {"name": oops}', '{"name": oops}', [("a", "{}")]),
    "call then text": ('{"name": "a", "parameters": {}} and then text', " and then text", [("a", "{}")]),
    "only a tag": ("<|python_tag|>", "<|python_tag|>", []),
}

CASES = [("hermes", text, content, calls, label) for label, (text, content, calls) in HERMES.items()] + [
    ("llama3_json", text, content, calls, label) for label, (text, content, calls) in LLAMA3.items()
]
IDS = [f"{parser}: {label}" for parser, *_, label in CASES]


def summary(extracted):
    return extracted.content, [(call.name, call.arguments) for call in extracted.tool_calls]


def stream(parser_name: str, pieces) -> list[StreamDelta]:
    parser = get_tool_parser(parser_name).streaming()
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish()


@pytest.mark.parametrize("parser, text, content, calls, label", CASES, ids=IDS)
def test_extract(parser, text, content, calls, label):
    extracted = get_tool_parser(parser).extract(text)
    assert summary(extracted) == (content, calls)
    assert extracted.tools_called == bool(calls)
    for call in extracted.tool_calls:
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
        json.loads(call.arguments)
    assert len({call.id for call in extracted.tool_calls}) == len(calls)


@pytest.mark.parametrize("parser, text, content, calls, label", CASES, ids=IDS)
def test_streamed_deltas_reassemble_to_extract(parser, text, content, calls, label):
    whole = summary(get_tool_parser(parser).extract(text))
    for pieces in chunkings(text):
        deltas = stream(parser, pieces)
        assert summary(assemble_deltas(deltas)) == whole, pieces
        # Content deltas are never empty and each call comes as one delta with id and name.
        for delta in deltas:
            assert delta.content != ""
            if delta.tool_call is not None:
                assert delta.tool_call.id and delta.tool_call.name


def test_hermes_streams_content_at_once_and_the_call_when_it_closes():
    parser = get_tool_parser("hermes").streaming()
    assert parser.feed("Let me check") == [StreamDelta(content="Let me check")]
    assert parser.feed(". <tool") == [StreamDelta(content=". ")]  # "<tool" may start a tag: held
    assert parser.feed('_call>\n{"name": "get_weather", ') == []
    assert parser.feed('"arguments": {"city": "Paris", "unit": "celsius"}}\n') == []
    (delta,) = parser.feed("</tool_call>")
    call = delta.tool_call
    assert (call.index, call.name, call.arguments) == (0, "get_weather", WEATHER_ARGS)
    assert parser.feed("\n") == []  # whitespace after a call waits for what follows
    assert parser.feed("<tool_call>{") == []
    (delta,) = parser.feed('"name": "b", "arguments": {}}</tool_call>')
    assert (delta.tool_call.index, delta.tool_call.name) == (1, "b")
    assert parser.finish() == []


def test_hermes_held_prefix_that_is_no_tag_is_released():
    parser = get_tool_parser("hermes").streaming()
    assert parser.feed("a <to") == [StreamDelta(content="a ")]
    assert parser.feed("p>") == [StreamDelta(content="<top>")]


def test_llama3_json_sends_each_call_when_its_object_closes():
    parser = get_tool_parser("llama3_json").streaming()
    assert parser.feed('<|python_tag|>{"name": "a", "parameters": {"x": "}"') == []
    (delta,) = parser.feed("}}")
    assert (delta.tool_call.index, delta.tool_call.name, delta.tool_call.arguments) == (0, "a", '{"x": "}"}')
    assert parser.feed("; ") == []
    assert parser.feed('{"name": "b", "parameters": {}}')[0].tool_call.index == 1
    assert parser.finish() == []


def test_llama3_json_text_streams_as_soon_as_it_is_not_a_call():
    parser = get_tool_parser("llama3_json").streaming()
    assert parser.feed("<|py") == []
    assert parser.feed("thon is nice") == [StreamDelta(content="<|python is nice")]


def test_a_stream_parser_serves_one_output():
    parser = get_tool_parser("hermes").streaming()
    parser.finish()
    with pytest.raises(RuntimeError, match="finish"):
        parser.feed("x")
    with pytest.raises(RuntimeError, match="twice"):
        parser.finish()


def test_registry_and_unknown_parser():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match=r"unknown tool call parser 'mistral'; known: hermes, llama3_json"):
        get_tool_parser("mistral")


def test_delta_types_refuse_inconsistent_values():
    with pytest.raises(ValueError, match="exactly one"):
        StreamDelta()
    with pytest.raises(ValueError, match="exactly one"):
        StreamDelta(content="x", tool_call=ToolCallDelta(0, "", "id", "f"))
    with pytest.raises(ValueError, match="never empty"):
        StreamDelta(content="")
    with pytest.raises(ValueError, match="both its id and its name"):
        ToolCallDelta(0, "{}", id="chatcmpl-tool-1")
    with pytest.raises(ValueError, match="starts after"):
        assemble_deltas([StreamDelta(tool_call=ToolCallDelta(1, "{}", "i", "f"))])


def test_assemble_appends_argument_pieces():
    deltas = [StreamDelta(content="Hi"), StreamDelta(tool_call=ToolCallDelta(0, '{"a"', "i0", "f")),
              StreamDelta(tool_call=ToolCallDelta(0, ": 1}"))]
    assert summary(assemble_deltas(deltas)) == ("Hi", [("f", '{"a": 1}')])


def test_split_partial_tag():
    assert split_partial_tag("abc<tool_c", "<tool_call>") == ("abc", "<tool_c")
    assert split_partial_tag("abc<", "<tool_call>") == ("abc", "<")
    assert split_partial_tag("abc<tool_call>", "<tool_call>") == ("abc<tool_call>", "")  # whole tags are not held
    assert split_partial_tag("abc", "<tool_call>") == ("abc", "")


# ---------------------------------------------------------------------------------------------
# request checks and the forced modes

def tool(name, parameters=None, **extra):
    function = {"name": name, "description": f"{name} tool", **extra}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [tool("get_weather", CITY), tool("get_time")]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tools, tool_choice", [
    (TOOLS, "auto"), (TOOLS, "required"), (TOOLS, NAMED), (TOOLS, "none"), (TOOLS, None), (None, "none"),
    (None, None), ([], None),
])
def test_check_tools_accepts(tools, tool_choice):
    check_tools(tools, tool_choice)


@pytest.mark.parametrize("tools, tool_choice, message", [
    (TOOLS, {"type": "function", "function": {"name": "x"}},
     r"tool_choice names function 'x', which is not in tools \(known: get_weather, get_time\)"),
    (None, "required", r"tool_choice 'required' needs tools"),
    ([], "auto", r"tool_choice 'auto' needs tools"),
    (None, NAMED, r"tool_choice names function 'get_weather', but the request has no tools"),
    ([{"type": "function", "function": {"description": "no name"}}], "auto", r"tools\[0\].function.name is missing"),
    ([{"type": "function"}], "auto", r"tools\[0\] must be"),
    ([tool("f", parameters=["x"])], "auto", r"tools\[0\].function.parameters must be a JSON Schema object, got list"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "auto", r"tools\[0\].type must be 'function'"),
    ([tool("f"), tool("f")], "auto", r"tools\[1\].function.name 'f' is used by another tool"),
    ({"function": {"name": "f"}}, "auto", r"tools must be a list"),
    (TOOLS, "always", r"tool_choice must be"),
    (TOOLS, {"type": "function"}, r"tool_choice must be"),
])
def test_check_tools_refuses(tools, tool_choice, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools, tool_choice)


def test_schema_for_a_named_function_is_its_parameters():
    assert json.loads(tool_choice_schema(TOOLS, NAMED)) == CITY
    no_parameters = {"type": "function", "function": {"name": "get_time"}}
    assert json.loads(tool_choice_schema(TOOLS, no_parameters)) == {"type": "object", "properties": {}}
    assert tool_choice_schema(TOOLS, "auto") is None
    assert tool_choice_schema(TOOLS, "none") is None


def test_schema_for_required_is_an_array_of_name_parameter_objects():
    defs = {"Unit": {"enum": ["c", "f"]}}
    tools = [tool("get_weather", {**CITY, "$defs": defs}), tool("get_time")]
    schema = json.loads(tool_choice_schema(tools, "required"))
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": CITY},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]},
        ]},
        "$defs": defs,
    }
    assert tools[0]["function"]["parameters"]["$defs"] == defs  # the request's tools are left alone


def test_schema_refuses_conflicting_defs():
    tools = [tool("a", {"type": "object", "$defs": {"X": {"type": "string"}}}),
             tool("b", {"type": "object", "$defs": {"X": {"type": "integer"}}})]
    with pytest.raises(ValueError, match=r"\$defs 'X' differently"):
        tool_choice_schema(tools, "required")


def test_parse_forced_required():
    text = '[{"name": "get_weather", "parameters": {"city":"Paris"}}, {"name": "get_time", "parameters": {}}]'
    calls = parse_forced_tool_calls(text, TOOLS, "required")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c.id) for c in calls)
    assert calls[0].id != calls[1].id


def test_parse_forced_named_keeps_the_text_as_arguments():
    (call,) = parse_forced_tool_calls('{"city": "Paris"}', TOOLS, NAMED)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize("text, message", [
    ('[{"name": "get_weather", "parameters": {"ci', "not JSON"),
    ("[]", "non-empty JSON array"),
    ('{"name": "get_time", "parameters": {}}', "non-empty JSON array"),
    ('[{"name": "unknown", "parameters": {}}]', "item 0"),
    ('[{"name": "get_time"}]', "item 0"),
])
def test_parse_forced_required_refuses_other_output(text, message):
    with pytest.raises(ValueError, match=message):
        parse_forced_tool_calls(text, TOOLS, "required")


def test_parse_forced_needs_a_forced_mode():
    with pytest.raises(ValueError, match="does not constrain the output"):
        parse_forced_tool_calls("{}", TOOLS, "auto")
