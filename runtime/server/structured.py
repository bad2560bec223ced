"""What a request's response_format / structured_outputs / tools / tool_choice mean for the engine.

Pure: a validated request in, the grammar (``StructuredOutputsParams``) and the way its answer is
read (a tool parser, or none) out. vLLM's OpenAI server is the reference:

- ``response_format`` json_object / json_schema, or vLLM's ``structured_outputs`` body field,
  constrain the text; it is returned as content.
- ``tool_choice: "required"`` constrains the answer to a JSON array of ``{"name", "parameters"}``
  objects, one of the tools each, at most one call per tool (one in all with
  ``parallel_tool_calls: false``); a named ``tool_choice`` constrains it to that function's
  arguments. Both always parse and validate,
  and are written compactly (``{"a": 1}``: arguments are for programs, not readers).
- ``tool_choice: "auto"`` leaves the text free and reads tool calls out of it with the server's
  ``--tool-call-parser`` (it needs ``--enable-auto-tool-choice``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

from .errors import APIError
from .protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice, Tool
from .tool_parsers import PARSERS, NamedParser, RequiredParser, ToolParser

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolSettings:
    """The server's ``--enable-auto-tool-choice`` / ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass
class OutputPlan:
    structured: StructuredOutputsParams | None = None
    # The request field a grammar error is reported against (a 400's `param`).
    field: str | None = None
    # Builds one parser per choice (they keep no state, but ids are per call).
    parser: Callable[[], ToolParser] | None = None
    # "auto" | "required" | "named": how finish_reason reads when tool calls come out.
    tool_mode: str | None = None
    skip_special_tokens: bool | None = None


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or EMPTY_PARAMETERS


def required_schema(tools: list[Tool], parallel_tool_calls: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each naming one of the tools with its own parameters.

    The array holds at most one call per tool (one in all without parallel calls). Unbounded, the
    grammar offers "," after every call and a small model takes it, repeating its call: SmolLM2
    did until max_tokens, so the answer ended "length" with an unfinished call. Bounded, the
    grammar allows only "]" and the end once the last call is written: the answer ends
    "tool_calls"."""
    variants = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                "parameters": _parameters(t)},
                 "required": ["name", "parameters"]} for t in tools]
    return {"type": "array", "minItems": 1, "maxItems": len(tools) if parallel_tool_calls else 1,
            "items": {"type": "object", "anyOf": variants}}


def _json_params(schema: Any, field: str, compact: bool = False) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    except ValueError as exc:
        raise APIError(400, f"{field}: {str(exc).partition(': ')[2] or exc}", param=field) from None


def plan_outputs(req: CompletionRequest | ChatCompletionRequest, tools: ToolSettings) -> OutputPlan:
    """Raises APIError 400 (naming the field) for combinations that cannot be served."""
    out = OutputPlan()
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.structured, out.field = StructuredOutputsParams(json_object=True), "response_format"
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.json_schema if rf.json_schema is not None else None
        if schema is None:
            schema = {}  # OpenAI allows a json_schema format with no schema: any JSON value
        out.structured = _json_params(schema, "response_format.json_schema.schema")
        out.field = "response_format.json_schema.schema"
    elif req.structured_outputs is not None:
        so = req.structured_outputs
        try:
            out.structured = StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                                     grammar=so.grammar, json_object=so.json_object,
                                                     disable_any_whitespace=so.disable_any_whitespace)
        except ValueError as exc:
            raise APIError(400, str(exc), param="structured_outputs") from None
        out.field = "structured_outputs"

    if not isinstance(req, ChatCompletionRequest) or not req.tools or req.tool_choice == "none":
        return out
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        index = next(i for i, t in enumerate(req.tools) if t.function.name == choice.function.name)
        field = f"tools[{index}].function.parameters"
        out.structured, out.field = _json_params(_parameters(req.tools[index]), field, compact=True), field
        name = choice.function.name
        out.parser, out.tool_mode = (lambda: NamedParser(name)), "named"
    elif choice == "required":
        schema = required_schema(req.tools, req.parallel_tool_calls)
        out.structured, out.field = _json_params(schema, "tools", compact=True), "tools"
        out.parser, out.tool_mode = RequiredParser, "required"
    else:  # auto
        if not (tools.enable_auto_tool_choice and tools.tool_call_parser):
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                           "to be set on the server", param="tool_choice")
        parser_cls = PARSERS[tools.tool_call_parser]
        out.parser, out.tool_mode = parser_cls, "auto"
        if parser_cls.needs_special_tokens:
            out.skip_special_tokens = False  # the format's markers are special tokens
    return out
