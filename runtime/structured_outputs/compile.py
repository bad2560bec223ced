"""One grammar compile with xgrammar: the same code in the server and in a compile worker process."""

from __future__ import annotations

import json
from typing import Any

from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

# Whitespace allowed between JSON tokens (xgrammar's max_whitespace_cnt): enough for any
# pretty-printing, while a model that keeps choosing whitespace cannot loop until max_tokens.
MAX_JSON_WHITESPACE = 32

_WHAT_FAILED = {"json": "an invalid JSON schema", "regex": "a regex the grammar engine cannot compile",
                "grammar": "an invalid EBNF grammar", "choice": "choices that cannot be compiled",
                "json_object": "the JSON grammar failed"}


def string_lengths_as_patterns(node: Any) -> Any:
    """A copy of a JSON schema whose length-bounded strings are written as patterns.

    xgrammar 0.2.8 compiles ``{"type": "string", "maxLength": n}`` to a character class that
    lets raw control characters (U+0000..U+001F) through, which is not valid JSON; a pattern of
    the same length bounds excludes them (and, like the length rule, quotes and backslashes)."""
    if isinstance(node, list):
        return [string_lengths_as_patterns(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: string_lengths_as_patterns(v) for k, v in node.items()}
    if (out.get("type") == "string" and ("maxLength" in out or "minLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        low, high = out.get("minLength", 0), out.get("maxLength")
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (low, high) if v is not None):
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = f"^[^\\x00-\\x1f]{{{low},{'' if high is None else high}}}$"
        # anything else (not integers) is left for xgrammar to refuse
    return out


def choice_grammar(choices: list[str]) -> str:
    # JSON string escaping is a subset of what xgrammar's EBNF literals accept.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_params(compiler: Any, params: StructuredOutputsParams) -> Any:
    """xgrammar's CompiledGrammar; a ValueError naming the field if it does not compile."""
    kind = params.kind
    try:
        if kind == "json":
            schema = json.dumps(string_lengths_as_patterns(params.schema()))
            return _compile_schema(compiler, schema, params)
        if kind == "json_object":
            return _compile_schema(compiler, '{"type": "object"}', params)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
        detail = " ".join(str(exc).split())[:500]
        raise ValueError(f"structured_outputs.{kind}: {_WHAT_FAILED[kind]}: {detail}") from None


def _compile_schema(compiler: Any, schema: str, params: StructuredOutputsParams) -> Any:
    if params.disable_any_whitespace:
        return compiler.compile_json_schema(schema, any_whitespace=False)
    return compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
