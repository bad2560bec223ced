"""Request limits: the pure checks on raw bodies (table and property tests)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.server.limits import CHARS_PER_TOKEN_BOUND, RequestLimitError, RequestLimits, check_request

LIMITS = RequestLimits(max_stop_strings=4, max_stop_string_chars=10, max_stop_token_ids=3, max_messages=3,
                       max_prompt_chars=100, max_schema_chars=200, max_tools=2)
MSG = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("body, param, words", [
    ({"stop": ["a"] * 5}, "stop", ["5 stop strings", "limit of 4", "--max-stop-strings"]),
    ({"stop": ["a", "b" * 11]}, "stop[1]", ["11 characters", "limit of 10"]),
    ({"stop": "x" * 11}, "stop", ["11 characters"]),
    ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", ["4 token ids", "limit of 3"]),
    ({"messages": [MSG] * 4}, "messages", ["4 messages", "limit of 3", "--max-messages"]),
    ({"messages": [{"role": "user", "content": "x" * 101}]}, "messages", ["limit of 100", "--max-prompt-chars"]),
    # parts, tool calls and the tools a template renders all count
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 60}] * 2}]}, "messages",
     ["--max-prompt-chars"]),
    ({"messages": [MSG], "tools": [{"type": "function", "function": {"name": "f", "description": "d" * 90}}]},
     "messages", ["characters of messages and tools"]),
    ({"prompt": "x" * 101}, "prompt", ["101 characters", "--max-prompt-chars"]),
    ({"prompt": ["ok", "x" * 101]}, "prompt[1]", ["101 characters"]),
    ({"messages": [MSG], "tools": [TOOL] * 3}, "tools", ["3 tools", "limit of 2"]),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "g", "parameters": {"d": "x" * 200}}}]},
     "tools[1]", ["characters of JSON", "limit of 200", "--max-schema-chars"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["y" * 50] * 4}}}},
     "response_format", ["--max-schema-chars"]),
    ({"structured_outputs": {"regex": "a" * 300}}, "structured_outputs", ["limit of 200"]),
    ({"chat_template_kwargs": {"k": "v" * 300}}, "chat_template_kwargs", ["limit of 200"]),
])
def test_over_a_limit_names_the_field_and_the_limit(body, param, words):
    with pytest.raises(RequestLimitError) as info:
        check_request(body, LIMITS)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")
    for w in words:
        assert w in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("body", [
    {},
    {"stop": ["a"] * 4, "stop_token_ids": [1, 2, 3]},
    {"stop": "x" * 10},
    {"messages": [MSG] * 3},
    {"tools": [TOOL] * 2},
    {"prompt": "x" * 100},
    {"prompt": [[1] * 1000]},  # token ids: the engine checks them against the context
    # wrong types are validation's to name, not a crash here
    {"stop": 5, "messages": "x", "prompt": {"a": 1}, "tools": "x", "stop_token_ids": "x"},
    {"messages": [[[[["deep"]]]]]},
])
def test_within_the_limits_passes(body):
    check_request(body, LIMITS)


def test_prompt_size_follows_the_context_length():
    assert RequestLimits().for_model(None).max_prompt_chars is None
    assert RequestLimits().for_model(8192).max_prompt_chars == CHARS_PER_TOKEN_BOUND * 8192
    assert RequestLimits(max_prompt_chars=5).for_model(8192).max_prompt_chars == 5


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_limits_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="max_messages"):
        RequestLimits(max_messages=bad)


def test_nesting_deeper_than_python_recursion_is_counted():
    deep: list = ["x"]
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(RequestLimitError):
        check_request({"messages": [{"role": "user", "content": deep}]},
                      RequestLimits(max_prompt_chars=1))


@settings(deadline=None)
@given(st.lists(st.text(max_size=12), max_size=8), st.integers(1, 8), st.integers(1, 12))
def test_stop_limits_hold_exactly_at_the_bound(stops, max_count, max_chars):
    limits = RequestLimits(max_stop_strings=max_count, max_stop_string_chars=max_chars)
    ok = len(stops) <= max_count and all(len(s) <= max_chars for s in stops)
    try:
        check_request({"stop": stops}, limits)
    except RequestLimitError:
        assert not ok
    else:
        assert ok


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
                    max_leaves=12)
FIELDS = st.sampled_from(["messages", "prompt", "stop", "stop_token_ids", "tools", "response_format",
                          "structured_outputs", "chat_template_kwargs", "n", "model"])


@settings(deadline=None, max_examples=50)
@given(st.dictionaries(FIELDS, JSON, max_size=6))
def test_any_json_body_passes_or_names_a_field(body):
    """Whatever the JSON: through, or a RequestLimitError naming a field; never another error."""
    try:
        check_request(body, LIMITS)
    except RequestLimitError as exc:
        assert exc.param.split("[")[0] in body
