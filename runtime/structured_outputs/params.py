"""What a request constrains its output to: vLLM's ``StructuredOutputsParams``. Pure, no xgrammar.

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (a list
of strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF) or ``json_object=True`` (any JSON
object) is set. ``key()`` is the canonical text a compiled grammar is cached under, so two requests
with the same schema written with different spacing share one compilation (key order is kept: it is
the order the properties are generated in).
"""

from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams:
    __slots__ = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "_key")

    def __init__(self, *, json: str | dict | None = None, regex: str | None = None,  # noqa: A002
                 choice: list[str] | None = None, grammar: str | None = None, json_object: bool | None = None,
                 disable_any_whitespace: bool = False, **unknown: Any) -> None:
        if unknown:
            raise ValueError(f"structured_outputs: unknown field {sorted(unknown)[0]!r}; "
                             f"known: {', '.join(KINDS)}, disable_any_whitespace")
        self.json = json
        self.regex = regex
        self.choice = list(choice) if isinstance(choice, (list, tuple)) else choice
        self.grammar = grammar
        self.json_object = json_object
        self.disable_any_whitespace = disable_any_whitespace
        self._key: tuple[str, str, bool] | None = None
        self._validate()

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsParams | None:
        """None, an instance, or a dict of its fields (what a JSON body or a kwargs call gives)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise ValueError(f"structured_outputs: expected StructuredOutputsParams or a dict, got {type(value).__name__}")

    def _validate(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar or json_object "
                             f"must be set, got {set_ or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
                except RecursionError:
                    raise ValueError("structured_outputs.json: nested too deeply to parse") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json: a JSON schema must be an object (or a boolean), "
                                 f"got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex: must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar: must be a non-empty EBNF string")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs.json_object: must be a boolean")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace: must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> Any:
        """The JSON schema as a Python value (json only)."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def key(self) -> tuple[str, str, bool]:
        # Kept: a big schema's canonical text costs tens of ms, and the server and the engine both ask.
        if self._key is None:
            self._key = self._make_key()
        return self._key

    def _make_key(self) -> tuple[str, str, bool]:
        kind = self.kind
        if kind == "json":
            spec = json.dumps(self.schema(), separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            spec = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec, self.disable_any_whitespace

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__ if not k.startswith("_") and getattr(self, k) not in (None, False)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return "StructuredOutputsParams(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"
