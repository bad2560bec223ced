"""What a grammar may cost before it is compiled. Pure, no xgrammar.

A grammar's compile time grows with its size and, above all, with its number of alternatives (an
``anyOf`` of 8,000 objects takes seconds and hundreds of MB against a 49k vocabulary), so the
checks here run on the request's text before any compile starts. The defaults sit far above what
real schemas need (OpenAI's own structured outputs allow 5,000 properties, 10 levels of nesting and
1,000 enum values); a schema past one of them is refused with a message naming the limit and the
flag that raises it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

# JSON-schema keywords whose list value is a set of alternatives the compiler must branch over.
_BRANCH_KEYWORDS = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")


@dataclass(frozen=True)
class GrammarLimits:
    """Refusals before compiling: ``check`` raises a ValueError naming the field and the limit."""

    max_schema_bytes: int = 256 * 1024
    max_depth: int = 64
    max_alternatives: int = 2048
    max_grammar_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_depth", "max_alternatives", "max_grammar_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    def check(self, params: StructuredOutputsParams) -> None:
        kind = params.kind
        if kind == "json":
            self._check_schema(params.schema())
        elif kind in ("regex", "grammar"):
            size = len(getattr(params, kind).encode())
            if size > self.max_grammar_bytes:
                raise ValueError(f"structured_outputs.{kind}: {size} bytes is more than the server's limit of "
                                 f"{self.max_grammar_bytes} (--structured-outputs-max-grammar-bytes)")
        elif kind == "choice":
            if len(params.choice) > self.max_alternatives:
                raise ValueError(f"structured_outputs.choice: {len(params.choice)} choices is more than the server's "
                                 f"limit of {self.max_alternatives} (--structured-outputs-max-alternatives)")
            size = sum(len(c.encode()) for c in params.choice)
            if size > self.max_grammar_bytes:
                raise ValueError(f"structured_outputs.choice: {size} bytes of choices is more than the server's "
                                 f"limit of {self.max_grammar_bytes} (--structured-outputs-max-grammar-bytes)")

    def _check_schema(self, schema: Any) -> None:
        # Depth first: serialising a document nested thousands deep would itself overflow the stack.
        shape = schema_shape(schema, stop_depth=self.max_depth, stop_alternatives=self.max_alternatives)
        if shape.depth > self.max_depth:
            raise ValueError(f"structured_outputs.json: the schema nests deeper than the server's limit of "
                             f"{self.max_depth} levels (--structured-outputs-max-depth)")
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
        if size > self.max_schema_bytes:
            raise ValueError(f"structured_outputs.json: the schema is {size} bytes, more than the server's limit "
                             f"of {self.max_schema_bytes} (--structured-outputs-max-schema-bytes)")
        if shape.alternatives > self.max_alternatives:
            raise ValueError(f"structured_outputs.json: the schema has more than {self.max_alternatives} "
                             "alternatives (anyOf/oneOf/allOf/enum/prefixItems entries and type lists, summed "
                             "over the schema), the server's limit (--structured-outputs-max-alternatives)")


@dataclass(frozen=True)
class SchemaShape:
    depth: int  # JSON nesting levels of the schema document ({} is 1)
    alternatives: int  # entries of every branching keyword, summed


def schema_shape(schema: Any, stop_depth: int | None = None, stop_alternatives: int | None = None) -> SchemaShape:
    """Measures a parsed JSON schema without recursion (a hostile document may nest thousands of
    levels). Stops early once past ``stop_depth`` or ``stop_alternatives``: the caller only needs to
    know that a limit was crossed, and the walk itself should not cost what the compile would."""
    depth = alternatives = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            for key, value in node.items():
                if key in _BRANCH_KEYWORDS and isinstance(value, list):
                    alternatives += len(value)
                elif key == "type" and isinstance(value, list):
                    alternatives += len(value)
                stack.append((value, level + 1))
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((v, level + 1) for v in node)
        if ((stop_depth is not None and depth > stop_depth)
                or (stop_alternatives is not None and alternatives > stop_alternatives)):
            break
    return SchemaShape(depth, alternatives)
