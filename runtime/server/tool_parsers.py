"""Tool calls out of a model's text: ``--tool-call-parser`` formats, and the grammar-forced shapes.

Pure functions of the text so far. Every parser answers ``parse(text, final)`` with a ``Parsed``
snapshot: the content that is safe to show (never a prefix of a tool-call marker that may still
be completing) and the tool calls seen so far, each with its name (once known) and its arguments
text so far. Snapshots of a growing text only ever extend each other, which is what lets the
streaming side send just the difference (name first, then argument fragments) and lets the
official client's reassembly give exactly the non-streaming answer.

Arguments are the model's JSON text as written (a JSON object), so streamed fragments and the
final answer agree byte for byte. JSON values are read with the standard library's decoder;
nothing here parses JSON by hand beyond walking an object's keys.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


@dataclass
class ToolCall:
    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class Malformed(Exception):
    """The text is not (a prefix of) the expected tool-call shape."""


def _skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def walk_call_object(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[ToolCall, int | None]:
    """Reads ``{"name": ..., "<args key>": {...}}`` starting at text[i] == "{". Returns the call
    so far and the index after the closing brace (None while incomplete). Raises Malformed."""
    call = ToolCall(name=None)
    i += 1
    n = len(text)
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            return call, None
        if text[i] == "}":
            call.complete = call.name is not None
            if not call.complete:
                raise Malformed("a tool call without a name")
            if not call.arguments:
                call.arguments = "{}"
            return call, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            if i >= n:
                return call, None
        if text[i] != '"':
            raise Malformed(f"expected a key at {i}")
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return call, None  # the key is still being written
        i = _skip_ws(text, i)
        if i >= n:
            return call, None
        if text[i] != ":":
            raise Malformed(f"expected ':' at {i}")
        i = _skip_ws(text, i + 1)
        if i >= n:
            return call, None
        try:
            value, j = _DECODER.raw_decode(text, i)
        except ValueError:
            if key in args_keys and text[i] == "{":
                call.arguments = text[i:]  # an unfinished object: all of it is arguments so far
            return call, None
        if j == n and isinstance(value, (int, float)) and not isinstance(value, bool):
            return call, None  # a number at the very end may still grow
        if key == "name":
            if not isinstance(value, str) or not value:
                raise Malformed("name must be a non-empty string")
            call.name = value
        elif key in args_keys:
            if isinstance(value, dict):
                call.arguments = text[i:j]
            elif isinstance(value, str):  # some models write the arguments as a JSON string
                try:
                    if not isinstance(json.loads(value), dict):
                        raise ValueError
                except ValueError:
                    raise Malformed("arguments must be a JSON object") from None
                call.arguments = value
            else:
                raise Malformed("arguments must be a JSON object")
        i = j


def walk_call_array(text: str, i: int, args_keys: tuple[str, ...]) -> tuple[list[ToolCall], int | None]:
    """Reads ``[call, call, ...]`` starting at text[i] == "[" (a trailing partial call included)."""
    calls: list[ToolCall] = []
    i += 1
    n = len(text)
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            return calls, None
        c = text[i]
        if c == "]":
            return calls, i + 1
        if c == ",":
            i += 1
            continue
        if c != "{":
            raise Malformed(f"expected a tool call object at {i}")
        call, end = walk_call_object(text, i, args_keys)
        calls.append(call)
        if end is None:
            return calls, None
        i = end


def _held_back(text: str, marker: str) -> int:
    """Length of text's longest suffix that is a proper prefix of marker (it may become one)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _drop_incomplete_on_final(parsed: Parsed, text: str) -> Parsed:
    """At the end, a call that never completed makes the whole answer plain content (vLLM's rule:
    a tool call is only reported when it parses)."""
    if any(not c.complete for c in parsed.calls):
        return Parsed(content=text)
    return parsed


class ToolParser:
    name = ""
    # Special tokens the format uses: the request must keep them in the detokenized text.
    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5/3, Hermes, ...),
    after optional content; several calls are several tagged blocks."""

    name = "hermes"
    needs_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.OPEN)
        if first < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.OPEN)
            return Parsed(content=text[:keep])
        parsed = Parsed(content=text[:first])
        pos = first
        try:
            while pos >= 0:
                i = _skip_ws(text, pos + len(self.OPEN))
                if i >= len(text):
                    break
                if text[i] != "{":
                    raise Malformed("expected a JSON object after <tool_call>")
                call, end = walk_call_object(text, i, ("arguments", "parameters"))
                parsed.calls.append(call)
                if end is None:
                    break
                pos = text.find(self.OPEN, end)
        except Malformed:
            if final:
                return Parsed(content=text)
            return Parsed(content=parsed.content, calls=[c for c in parsed.calls if c.complete])
        return _drop_incomplete_on_final(parsed, text) if final else parsed


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``
    (optionally after ``<|python_tag|>``; several separated by ``;``). Any other answer is content."""

    name = "llama3_json"
    needs_special_tokens = True
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        i = _skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = _skip_ws(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]) and i < len(text):
            return Parsed(content="")
        if i >= len(text):
            return Parsed(content=text if final else "")
        if text[i] != "{":
            return Parsed(content=text)
        parsed = Parsed(content="")
        try:
            while True:
                call, end = walk_call_object(text, i, ("parameters", "arguments"))
                parsed.calls.append(call)
                if end is None:
                    break
                i = _skip_ws(text, end)
                if i < len(text) and text[i] == ";":
                    i = _skip_ws(text, i + 1)
                if i >= len(text):
                    break
                if text[i] != "{":
                    raise Malformed("text after the tool calls")
        except Malformed:
            if final:
                return Parsed(content=text)
            return Parsed(content="", calls=[c for c in parsed.calls if c.complete])
        return _drop_incomplete_on_final(parsed, text) if final else parsed


class MistralParser(ToolParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after optional content."""

    name = "mistral"
    needs_special_tokens = True
    MARKER = "[TOOL_CALLS]"
    _ALNUM = string.ascii_letters + string.digits

    def new_call_id(self) -> str:
        # Mistral's chat templates accept only 9-character alphanumeric tool call ids.
        return "".join(secrets.choice(self._ALNUM) for _ in range(9))

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.MARKER)
        if first < 0:
            keep = len(text) if final else len(text) - _held_back(text, self.MARKER)
            return Parsed(content=text[:keep])
        parsed = Parsed(content=text[:first])
        i = _skip_ws(text, first + len(self.MARKER))
        if i >= len(text):
            return Parsed(content=text) if final else parsed
        try:
            if text[i] == "[":
                parsed.calls, _ = walk_call_array(text, i, ("arguments", "parameters"))
            elif text[i] == "{":
                call, _ = walk_call_object(text, i, ("arguments", "parameters"))
                parsed.calls = [call]
            else:
                raise Malformed("expected a JSON array after [TOOL_CALLS]")
        except Malformed:
            return Parsed(content=text) if final else Parsed(content=parsed.content)
        return _drop_incomplete_on_final(parsed, text) if final else parsed


class PythonicParser(ToolParser):
    """``[get_weather(city="Paris"), get_time()]`` (Llama 3.2/4 pythonic style): read with
    Python's own ``ast`` once the answer is complete; streamed as whole calls at the end."""

    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        stripped = text.strip()
        if not stripped.startswith("["):
            return Parsed(content=text if final or stripped else "")
        if not final:
            return Parsed(content="")
        try:
            tree = ast.parse(stripped, mode="eval").body
            if not isinstance(tree, ast.List):
                raise ValueError
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    raise ValueError
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
                calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False), True))
        except (SyntaxError, ValueError, TypeError):
            return Parsed(content=text)
        return Parsed(content="", calls=calls)


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the grammar makes the answer ``[{"name", "parameters"}, ...]``."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = _skip_ws(text, 0)
        if i >= len(text):
            return Parsed(content="")
        try:
            calls, _ = walk_call_array(text, i, ("parameters",))
        except Malformed:
            return Parsed(content=text) if final else Parsed(content="")
        if final:  # cut short (max_tokens, a stop string): report the calls that did complete
            calls = [c for c in calls if c.complete]
            if not calls:
                return Parsed(content=text)
        return Parsed(content="", calls=calls)


class NamedParser(ToolParser):
    """A named ``tool_choice``: the grammar makes the whole answer that function's arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed(content="", calls=[ToolCall(self.function, text, final)])


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}
