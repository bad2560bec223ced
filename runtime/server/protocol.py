"""Request models for the OpenAI API as vLLM accepts it (pydantic v2, strict types).

Strict mode so `"max_tokens": "10"` or `"stream": 1` are 400s, as OpenAI answers, instead of being
coerced. Unknown fields are ignored, as vLLM does, so newer clients keep working. Range checks
that need the model (context length, vocabulary) happen in the server, not here.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_LOGPROBS = 20
MAX_PROMPTS = 64

_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = None
    # OpenAI's field is "schema"; pydantic reserves that name on models.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is json_schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` body field (its ``StructuredOutputsParams``); exactly one kind."""

    model_config = _STRICT
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar), ("json_object", self.json_object)) if v]
        if len(given) != 1:
            raise ValueError(f"exactly one of json, regex, choice, grammar or json_object must be set, got {given or 'none'}")
        return self


class _Sampling(BaseModel):
    """Sampling fields shared by both endpoints, with vLLM's extras."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's: prompts share prefix-cache blocks only with prompts of the same salt.
    cache_salt: str | None = Field(default=None, min_length=1)
    response_format: ResponseFormat | None = None
    # vLLM's extra body: {"json": schema, "regex", "choice", "grammar", "json_object"}.
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            if any(s == "" for s in v):
                raise ValueError("stop strings must not be empty")
            return v
        raise ValueError("must be a string or a list of strings")

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _cross(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by this server")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must be <= max_tokens")
        if (self.structured_outputs is not None and self.response_format is not None
                and self.response_format.type != "text"):
            raise ValueError("structured_outputs: cannot be combined with a response_format other than text")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


Prompt = str | list[int]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)

        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v) or ids(v) or all(ids(p) and p for p in v):
                if not ids(v) and len(v) > MAX_PROMPTS:
                    raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
                return v
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    @model_validator(mode="after")
    def _completion_only(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def prompts(self) -> list[Prompt]:
        """The prompts as a list: one string or token-id list per choice group."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    model_config = _STRICT
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required on tool messages")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"part [{i}]: only text content parts are supported, not {kind!r}")
            return v
        raise ValueError("must be a string or a list of text parts")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
})


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # A request-supplied template is arbitrary Jinja run on the event loop (nested loops hang the
        # server, "x" * 10**9 exhausts memory); the rest are apply_chat_template's own arguments.
        bad = sorted(set(v or ()) & RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise ValueError(f"{', '.join(bad)} cannot be set here (a request cannot supply its own chat template "
                             "or override the server's rendering arguments)")
        return v

    @model_validator(mode="after")
    def _chat_only(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_completion_tokens: conflicts with max_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"  # OpenAI's and vLLM's default
        if self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools (none were given)")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: names the function {self.tool_choice.function.name!r}, "
                                 f"which is not in tools ({', '.join(names)})")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if forced and ((self.response_format is not None and self.response_format.type != "text")
                       or self.structured_outputs is not None):
            raise ValueError("tool_choice: a required or named tool choice already sets the output format; "
                             "it cannot be combined with response_format or structured_outputs")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: tool calls' arguments as dicts (Hugging Face's
    convention, which templates index into), tool results with their call id. Raises ValueError
    naming a tool call whose arguments are not JSON."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    args = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
                except ValueError:
                    raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments: not valid JSON") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]
