"""The pure parts of grammar-compile protection: limits checked before compiling, who may start
a compile and which waiting compile runs next."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.runtime.structured_outputs.admission import CompileSettings, GrammarCompileBusy, check_admission, pick_next
from kvserve.runtime.structured_outputs.limits import GrammarLimits, SchemaShape, schema_shape
from kvserve.runtime.structured_outputs.params import StructuredOutputsParams as P


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("schema, shape", [
    ({}, SchemaShape(1, 0)),
    ({"type": "string"}, SchemaShape(1, 0)),
    ({"type": ["string", "null"]}, SchemaShape(2, 2)),
    ({"enum": ["a", "b", "c"]}, SchemaShape(2, 3)),
    ({"anyOf": [{"type": "integer"}, {"enum": [1, 2]}]}, SchemaShape(4, 4)),
    ({"properties": {"a": {"oneOf": [{}, {}]}, "b": {"allOf": [{}]}}}, SchemaShape(5, 3)),
    ({"prefixItems": [{}, {}, {}], "items": {"anyOf": [{}, {}]}}, SchemaShape(4, 5)),
    # "anyOf" as a property name is not a keyword, but its value is walked like any schema
    ({"properties": {"anyOf": {"type": "string"}}}, SchemaShape(3, 0)),
    (nested(3), SchemaShape(7, 0)),
])
def test_schema_shape(schema, shape):
    assert schema_shape(schema) == shape


def test_schema_shape_walks_thousands_of_levels_without_recursion():
    deep: list = []
    for _ in range(50_000):
        deep = [deep]
    assert schema_shape({"x": deep}).depth == 50_002
    assert schema_shape({"x": deep}, stop_depth=10).depth == 11  # stops as soon as it knows


@given(st.recursive(st.none() | st.integers() | st.text(max_size=3),
                    lambda children: st.lists(children, max_size=4)
                    | st.dictionaries(st.sampled_from(["anyOf", "enum", "type", "x", "properties"]), children,
                                      max_size=4),
                    max_leaves=30))
@settings(max_examples=200, deadline=None)
def test_schema_shape_matches_a_recursive_definition(doc):
    def depth(node):
        if isinstance(node, dict):
            return 1 + max((depth(v) for v in node.values()), default=0)
        if isinstance(node, list):
            return 1 + max((depth(v) for v in node), default=0)
        return 0

    def alternatives(node):
        if isinstance(node, dict):
            own = sum(len(v) for k, v in node.items() if k in ("anyOf", "enum", "type") and isinstance(v, list))
            return own + sum(alternatives(v) for v in node.values())
        if isinstance(node, list):
            return sum(alternatives(v) for v in node)
        return 0

    assert schema_shape(doc) == SchemaShape(depth(doc), alternatives(doc))


LIMITS = GrammarLimits(max_schema_bytes=200, max_depth=6, max_alternatives=5, max_grammar_bytes=20)


@pytest.mark.parametrize("params, message", [
    (P(json={"enum": list(range(5))}), None),
    (P(json={"enum": list(range(6))}), "more than 5 alternatives"),
    (P(json={"anyOf": [{"enum": [1, 2, 3]}, {"type": ["string", "null"]}]}), "more than 5 alternatives"),
    (P(json=nested(2)), None),
    (P(json=nested(3)), "deeper than the server's limit of 6 levels (--structured-outputs-max-depth)"),
    (P(json={"description": "x" * 200}), "bytes, more than the server's limit of 200 "
                                          "(--structured-outputs-max-schema-bytes)"),
    (P(json=json.dumps({"description": "x" * 150})), None),  # measured compact, not as sent
    (P(regex="a" * 20), None),
    (P(regex="a" * 21), "structured_outputs.regex: 21 bytes is more than the server's limit of 20 "
                        "(--structured-outputs-max-grammar-bytes)"),
    (P(regex="é" * 11), "22 bytes"),
    (P(grammar='root ::= "' + "a" * 20 + '"'), "structured_outputs.grammar: 31 bytes"),
    (P(choice=["a", "b", "c", "d", "e"]), None),
    (P(choice=list("abcdef")), "structured_outputs.choice: 6 choices is more than the server's limit of 5 "
                               "(--structured-outputs-max-alternatives)"),
    (P(choice=["aaaaaaaaaaa", "bbbbbbbbbbb"]), "22 bytes of choices"),
    (P(json_object=True), None),
])
def test_limits_refuse_before_compiling_naming_field_and_flag(params, message):
    if message is None:
        LIMITS.check(params)
        return
    with pytest.raises(ValueError) as exc:
        LIMITS.check(params)
    assert str(exc.value).startswith(f"structured_outputs.{params.kind}: "), exc.value
    assert message in str(exc.value), exc.value


def test_default_limits_accept_what_real_schemas_use():
    # OpenAI's structured outputs allow 1,000 enum values and 10 levels of nesting; a forced
    # choice among 128 tools is an anyOf of 128.
    tools = {"type": "array", "items": {"anyOf": [
        {"properties": {"name": {"enum": [f"tool{i}"]}, "parameters": nested(10)}} for i in range(128)]}}
    for params in (P(json={"enum": [f"v{i}" for i in range(1000)]}), P(json=nested(10)), P(json=tools),
                   P(regex=r"\d{4}-\d{2}-\d{2}"), P(choice=[f"c{i}" for i in range(1000)])):
        GrammarLimits().check(params)


def test_the_attack_schema_is_refused_by_default():
    attack = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]}
                        for i in range(8000)]}
    with pytest.raises(ValueError, match="--structured-outputs-max"):
        GrammarLimits().check(P(json=attack))


@pytest.mark.parametrize("field, value", [("max_depth", 0), ("max_alternatives", -1), ("max_schema_bytes", 1.5),
                                          ("max_grammar_bytes", True)])
def test_limits_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=field):
        GrammarLimits(**{field: value})


@pytest.mark.parametrize("field, value", [("workers", 0), ("timeout_s", 0), ("timeout_s", float("inf")),
                                          ("timeout_s", float("nan")), ("max_per_client", 0), ("max_queued", -1),
                                          ("cache_entries", 0), ("cache_bytes", 0), ("max_compile_bytes", 0)])
def test_compile_settings_must_be_positive(field, value):
    with pytest.raises(ValueError, match=field):
        CompileSettings(**{field: value})


S = CompileSettings(workers=3, max_per_client=2, max_queued=4)


@pytest.mark.parametrize("client, owned, queued, busy", [
    ("a", 0, 0, None),
    ("a", 1, 3, None),
    ("a", 2, 0, "this client already has 2 grammar compiles waiting or running"),
    ("a", 0, 4, "4 grammar compiles are already waiting"),
    (None, 99, 99, None),  # the in-process caller is trusted
])
def test_admission(client, owned, queued, busy):
    if busy is None:
        check_admission(client, owned, queued, S)
        return
    with pytest.raises(GrammarCompileBusy, match=busy):
        check_admission(client, owned, queued, S)


@pytest.mark.parametrize("waiting, running, workers, expected", [
    ([], {}, 2, None),
    (["a"], {}, 2, 0),
    (["a", "b"], {"a": 1}, 2, 1),  # a already runs its share (workers - 1): b goes first
    (["a", "a"], {"a": 1}, 2, None),
    (["a", "b"], {"a": 1}, 3, 0),
    (["a", None], {"a": 1}, 2, 1),
    (["a", "b", "c"], {"a": 1, "b": 1}, 2, 2),
    (["a"], {"a": 1}, 1, None),  # one worker: one at a time, whoever it is
])
def test_pick_next_is_fifo_within_each_clients_share(waiting, running, workers, expected):
    assert pick_next(waiting, running, CompileSettings(workers=workers)) == expected
