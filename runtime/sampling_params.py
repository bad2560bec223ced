"""Per-request generation options, validated up front (vLLM's field names and meanings)."""

from __future__ import annotations

import math
from typing import Any

from kvserve.runtime.structured_outputs.params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]

_GREEDY_EPS = 1e-5


class SamplingParams:
    """How to sample one request. Bad values raise ValueError naming the field; so do unknown fields.

    ``temperature=0`` means greedy. ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` means
    "up to max_model_len". ``logprobs=N`` returns the sampled token's and the top-N log-probabilities
    of the model's raw distribution (before penalties and temperature) for each generated token.
    ``structured_outputs=StructuredOutputsParams(json=..., regex=..., choice=..., grammar=...,
    json_object=True)`` constrains the output to a grammar (only its tokens can be sampled; the
    logprobs are those of the masked distribution).
    """

    __slots__ = (
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
        "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens",
        "include_stop_str_in_output", "structured_outputs",
    )

    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        structured_outputs: StructuredOutputsParams | dict | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            name = sorted(unknown)[0]
            raise ValueError(f"SamplingParams: unknown field {name!r}")
        self.n = n
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.min_p = min_p
        self.seed = seed
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        # A non-iterable stop (stop=5) must reach _validate's ValueError, not die in list().
        self.stop = list(stop) if isinstance(stop, (list, tuple)) else [stop]
        self.stop_token_ids = list(stop_token_ids or [])
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        # A dict of its fields is accepted too (JSON configs, kwargs); bad ones raise ValueError.
        self.structured_outputs = StructuredOutputsParams.coerce(structured_outputs)
        self._validate()

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        return cls(**fields)

    def _validate(self) -> None:
        def fail(field: str, why: str) -> None:
            raise ValueError(f"{field}: {why}, got {getattr(self, field)!r}")

        def number(field: str) -> float:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                fail(field, "must be a number")
            return value

        def integer(field: str, optional: bool = False) -> int | None:
            value = getattr(self, field)
            if value is None and optional:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                fail(field, "must be an integer")
            return value

        if integer("n") < 1:
            fail("n", "must be >= 1")
        if number("temperature") < 0 or math.isinf(self.temperature):
            fail("temperature", "must be >= 0 and finite")
        if not 0 < number("top_p") <= 1:
            fail("top_p", "must be in (0, 1]")
        if integer("top_k") < -1:
            fail("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not 0 <= number("min_p") <= 1:
            fail("min_p", "must be in [0, 1]")
        # torch generators take a signed or unsigned 64-bit seed; vLLM's bound leaves room for seed + j (n > 1).
        if integer("seed", optional=True) is not None and not -2**63 <= self.seed < 2**63:
            fail("seed", "must be in [-2**63, 2**63)")
        if not -2 <= number("presence_penalty") <= 2:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2 <= number("frequency_penalty") <= 2:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not 0 < number("repetition_penalty") < math.inf:
            fail("repetition_penalty", "must be > 0 and finite")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative integers")
        if integer("max_tokens", optional=True) is not None and self.max_tokens < 1:
            fail("max_tokens", "must be >= 1")
        if integer("min_tokens") < 0:
            fail("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if integer("logprobs", optional=True) is not None and self.logprobs < 0:
            fail("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not supported yet")
        for field in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), bool):
                fail(field, "must be a boolean")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes: Any) -> SamplingParams:
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return SamplingParams(**fields)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingParams) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"SamplingParams({fields})"
