"""What the engine hands back per request: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution
    decoded_token: str | None = None


# One entry per generated token: {token_id: Logprob} holding the sampled token and the top-N.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """Cumulative: ``text`` and ``token_ids`` hold everything generated so far.

    ``text`` never shows a suffix that could still grow into a stop string, so successive outputs
    of one request extend each other. ``token_ids`` includes a final EOS/stop token (its text is
    not in ``text``). ``stop_reason`` is the stop string or stop token id that ended the request.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = field(default=None, repr=False)
    # The LoRARequest the request ran with (None: the base model), as vLLM reports it.
    lora_request: Any = None
