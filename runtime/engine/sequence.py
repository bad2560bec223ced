"""The state of one request's sequence as the scheduler and block manager see it.

Pure data, no torch: the scheduler's tests build these directly.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass(eq=False)
class Sequence:
    """Tokens (prompt then output) and how many of them already have K/V in the cache.

    A sequence is "prefilling" while ``num_computed_tokens < len(token_ids) - 1``; in decode,
    exactly one token (the last sampled one) is waiting to be computed. Preemption by recompute
    resets ``num_computed_tokens`` to 0 and keeps the output: the next prefill covers both.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    # Prefix caching: extra key of the first block (a cache salt), keys of the full blocks so
    # far (extended by the scheduler), and prompt tokens found cached at first admission.
    cache_extra: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # Speculative decoding: draft tokens to verify in the next step (not yet in token_ids).
    spec_token_ids: list[int] = field(default_factory=list)
    # Speculative heads (Medusa): (the token count they are for, their guesses), made at the end
    # of a step; used only while the sequence still has exactly that many tokens.
    head_drafts: tuple[int, list[int]] | None = None
    # Swap preemption: where its blocks went (kvserve.runtime.kv_offload.manager.SwapState) while
    # it waits to resume; None when it holds its blocks or will recompute them.
    swapped: Any = None
    # The LoRA adapter this sequence runs with (0: the base model): the scheduler keeps at most
    # max_loras distinct adapters in a step.
    lora_int_id: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def max_kv_tokens(self) -> int:
        """K/V slots the sequence can ever need: the last sampled token is never fed back."""
        return self.num_prompt_tokens + self.max_tokens - 1
