"""What one request may cost, checked on the raw JSON body before validation, templating or
tokenization spend anything on it.

Each limit bounds a cost that grows with a part of the body and is paid before the engine can
refuse the request: validating and templating every message, tokenizing a prompt far beyond the
context, matching every stop string, serializing tool and response schemas. The defaults are far
above what normal clients send; the prompt size is derived from the context length (a prompt
that cannot fit is refused before anything tokenizes it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

# More characters per token than any tokenizer averages on real text (English is about 4,
# code about 3); a prompt longer than this many characters per context token cannot fit.
CHARS_PER_TOKEN_BOUND = 32
MAX_TOOLS = 128


class RequestLimitError(ValueError):
    """A request over a limit: `param` is the field, the message names the limit and its flag."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_messages: int = 4096
    # Per prompt (a chat request's messages and tools make one prompt); None: unchecked.
    max_prompt_chars: int | None = None
    max_schema_chars: int = 64 * 1024
    max_tools: int = MAX_TOOLS

    def __post_init__(self):
        for name, value in vars(self).items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    def for_model(self, max_model_len: int | None) -> RequestLimits:
        """These limits with the prompt size derived from the context length when not set:
        CHARS_PER_TOKEN_BOUND x max_model_len (unchecked while the context length is unknown)."""
        if self.max_prompt_chars is not None or max_model_len is None:
            return self
        return replace(self, max_prompt_chars=CHARS_PER_TOKEN_BOUND * max_model_len)


def _over(param: str, what: str, count: int, limit: int, flag: str | None) -> RequestLimitError:
    where = f" ({flag})" if flag else ""
    return RequestLimitError(param, f"{count} {what} is more than the limit of {limit}{where}")


def _string_chars(obj: Any) -> int:
    """Characters in every string of a JSON value (keys included), without recursion: the body
    may nest as deep as the JSON parser allowed."""
    total, stack = 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, dict):
            total += sum(len(k) for k in x if isinstance(k, str))
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return total


def _json_chars(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


def _list(body: dict, field: str) -> list:
    value = body.get(field)
    return [value] if isinstance(value, str) else value if isinstance(value, list) else []


def check_counts(body: dict, limits: RequestLimits) -> None:
    """The counts, first: each is one len(), whatever the body holds."""
    for field, what, limit, flag in (("messages", "messages", limits.max_messages, "--max-messages"),
                                     ("stop", "stop strings", limits.max_stop_strings, "--max-stop-strings"),
                                     ("stop_token_ids", "token ids", limits.max_stop_token_ids, None),
                                     ("tools", "tools", limits.max_tools, None)):
        items = body.get(field)
        if isinstance(items, list) and len(items) > limit:
            raise _over(field, what, len(items), limit, flag)


def check_stop_lengths(body: dict, limits: RequestLimits) -> None:
    stop = body.get("stop")
    for i, s in enumerate(_list(body, "stop")):
        if isinstance(s, str) and len(s) > limits.max_stop_string_chars:
            param = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise _over(param, "characters", len(s), limits.max_stop_string_chars, None)


def check_schemas(body: dict, limits: RequestLimits) -> None:
    """The raw size of what the server parses or compiles beside the prompt. How costly a schema
    of that size is to compile is the grammar compiler's limit, not this one."""
    for i, tool in enumerate(_list(body, "tools")):
        size = _json_chars(tool)
        if size > limits.max_schema_chars:
            raise _over(f"tools[{i}]", "characters of JSON", size, limits.max_schema_chars, "--max-schema-chars")
    for field in ("response_format", "structured_outputs", "chat_template_kwargs"):
        value = body.get(field)
        if value is not None:
            size = _json_chars(value)
            if size > limits.max_schema_chars:
                raise _over(field, "characters of JSON", size, limits.max_schema_chars, "--max-schema-chars")


def check_prompt_chars(body: dict, limits: RequestLimits) -> None:
    """All the text of the messages with the tools a template renders beside them, or each
    completion prompt; token-id prompts are the engine's to check against the context."""
    if limits.max_prompt_chars is None:
        return
    messages = body.get("messages")
    if isinstance(messages, list):
        size = _string_chars(messages) + _string_chars(body.get("tools"))
        if size > limits.max_prompt_chars:
            raise _over("messages", "characters of messages and tools", size, limits.max_prompt_chars,
                        "--max-prompt-chars")
    prompt = body.get("prompt")
    for i, p in enumerate(_list(body, "prompt")):
        if isinstance(p, str) and len(p) > limits.max_prompt_chars:
            param = "prompt" if isinstance(prompt, str) else f"prompt[{i}]"
            raise _over(param, "characters", len(p), limits.max_prompt_chars, "--max-prompt-chars")


def check_request(body: dict, limits: RequestLimits) -> None:
    """Raises RequestLimitError for the first limit the raw body is over. Fields of the wrong
    type are left to validation, which names them better."""
    check_counts(body, limits)
    check_stop_lengths(body, limits)
    check_prompt_chars(body, limits)
    check_schemas(body, limits)
