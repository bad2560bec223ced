"""Tool-call parsers and the structured-output request plan: pure table and property tests."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.server.args import TOOL_CALL_PARSERS
from kvserve.runtime.server.errors import APIError
from kvserve.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, Tool
from kvserve.runtime.server.structured import ToolSettings, plan_outputs, required_schema
from kvserve.runtime.server.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    PythonicParser,
    RequiredParser,
)

WEATHER = {"city": "Paris", "days": [1, 2], "opts": {"unit": "C", "x": None}}


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls if c.complete]


@pytest.mark.parametrize("parser, text, content, calls", [
    (HermesParser(), 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Sure.\n", [("get_weather", {"city": "Paris"})]),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {"x": 1}, '
     '"name": "b"}</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>', "", [("a", {"x": 2})]),
    (HermesParser(), "no tools here, 1 < 2", "no tools here, 1 < 2", []),
    (HermesParser(), "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": {"x": ', '<tool_call>{"name": "a", "arguments": {"x": ', []),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": true}}', "",
     [("a", {}), ("b", {"y": True})]),
    (Llama3JsonParser(), "The answer is {42}.", "The answer is {42}.", []),
    (MistralParser(), 'ok[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "ok",
     [("a", {"x": 1}), ("b", {})]),
    (MistralParser(), "plain [TOOL", "plain [TOOL", []),
    (PythonicParser(), '[get_weather(city="Paris", days=[1, 2]), now()]', "",
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})]),
    (PythonicParser(), "[1, 2, 3]", "[1, 2, 3]", []),
    (PythonicParser(), "Hello", "Hello", []),
    (RequiredParser(), '[{"name": "a", "parameters": {"x": "y"}}, {"name": "b", "parameters": {}}]', "",
     [("a", {"x": "y"}), ("b", {})]),
    (RequiredParser(), '[{"name": "a", "parameters": {"x": "y"}}, {"name": "b", "param', "",
     [("a", {"x": "y"})]),
    (NamedParser("f"), '{"q": 1}', "", [("f", {"q": 1})]),
])
def test_final_parse(parser, text, content, calls):
    parsed = parser.parse(text, True)
    assert parsed.content == content
    assert calls_of(parsed) == calls


def _stream_equals_final(parser, text):
    """Snapshots of every prefix extend each other, and the last equals the final parse."""
    prev = None
    for end in range(len(text) + 1):
        snap = parser.parse(text[:end], end == len(text))
        if prev is not None:
            if end < len(text):
                assert snap.content.startswith(prev.content), (text[:end], snap, prev)
            for old, new in zip(prev.calls, snap.calls):
                if old.name is not None:
                    assert new.name == old.name
                    assert new.arguments.startswith(old.arguments), (text[:end], old, new)
        prev = snap
    final = parser.parse(text, True)
    assert final == prev
    return final


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}\n</tool_call>"),
    (HermesParser(), '<tool_call>{"name":"a","arguments":{"n":12.5}}</tool_call>'
                     '<tool_call>{"name":"b","arguments":{}}</tool_call>'),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}"),
    (MistralParser(), '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]"),
    (RequiredParser(), '[{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}, {"name": "t", "parameters": {}}]'),
    (NamedParser("get_weather"), json.dumps(WEATHER)),
])
def test_streaming_snapshots_extend_each_other(parser, text):
    assert _stream_equals_final(parser, text).calls


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(args=st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=4),
       name=st.from_regex(r"[a-z_]{1,10}", fullmatch=True), prefix=st.sampled_from(["", "ok. ", "<tool", "{x}"]))
def test_hermes_property_arguments_round_trip(args, name, prefix):
    text = prefix + "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
    final = _stream_equals_final(HermesParser(), text)
    assert final.content == prefix
    assert calls_of(final) == [(name, args)]


def test_parser_registry_matches_the_flag_choices():
    assert set(PARSERS) == set(TOOL_CALL_PARSERS)
    assert len({MistralParser().new_call_id() for _ in range(5)}) == 5
    assert all(len(MistralParser().new_call_id()) == 9 for _ in range(5))


# -- the request plan ------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def test_plan_response_formats_and_structured_outputs():
    assert plan_outputs(chat(), ToolSettings()).structured is None
    assert plan_outputs(chat(response_format={"type": "text"}), ToolSettings()).structured is None
    p = plan_outputs(chat(response_format={"type": "json_object"}), ToolSettings())
    assert p.structured.kind == "json_object" and p.field == "response_format"
    p = plan_outputs(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
                     ToolSettings())
    assert p.structured.schema() == {"type": "object"} and p.field == "response_format.json_schema.schema"
    p = plan_outputs(CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}),
                     ToolSettings())
    assert p.structured.choice == ["a", "b"] and p.field == "structured_outputs" and p.parser is None


@pytest.mark.parametrize("num_tools, parallel, max_items", [(1, True, 1), (2, True, 2), (5, True, 5),
                                                             (1, False, 1), (5, False, 1)])
def test_required_schema_holds_at_most_one_call_per_tool(num_tools, parallel, max_items):
    tools = [Tool.model_validate({"type": "function", "function": {"name": f"f{i}"}}) for i in range(num_tools)]
    schema = required_schema(tools, parallel)
    assert schema["minItems"] == 1 and schema["maxItems"] == max_items
    assert [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]] == [[f"f{i}"] for i in range(num_tools)]


def test_plan_tool_choices():
    assert plan_outputs(chat(tools=TOOLS, tool_choice="none"), ToolSettings()).parser is None
    p = plan_outputs(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ToolSettings())
    assert p.tool_mode == "required" and p.structured.schema() == required_schema(
        [t for t in chat(tools=TOOLS).tools], False) and p.structured.schema()["maxItems"] == 1
    p = plan_outputs(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}), ToolSettings())
    assert p.tool_mode == "named" and p.structured.schema() == {"type": "object", "properties": {}}
    assert p.field == "tools[1].function.parameters" and p.parser().parse("{}", True).calls[0].name == "now"
    with pytest.raises(APIError) as exc:
        plan_outputs(chat(tools=TOOLS), ToolSettings())  # auto is the default with tools
    assert exc.value.param == "tool_choice" and "--enable-auto-tool-choice" in exc.value.message
    p = plan_outputs(chat(tools=TOOLS), ToolSettings(True, "hermes"))
    assert p.tool_mode == "auto" and p.structured is None and p.skip_special_tokens is False


def test_template_messages_carry_tool_calls_as_dicts():
    req = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], tools=TOOLS, tool_choice="none")
    msgs = req.template_messages()
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert req.template_tools()[0]["function"]["name"] == "get_weather"
    bad = chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        bad.template_messages()


def test_auto_tool_choice_flag_needs_a_parser(capsys):
    from kvserve.runtime.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "/nonexistent", "--enable-auto-tool-choice"])
    assert exc.value.code == 2 and "--tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "/nonexistent", "--tool-call-parser", "nope"])
