"""EngineClient: what a server may use of an engine, and nothing of its insides.

The server's async engine (runtime/server/async_engine.py) drives an engine through these calls
from its one engine thread; the HTTP handlers read the constant facts (tokenizer, lengths, the
vocabulary) and ask for grammar admission from any thread. `LLMEngine` is the implementation;
a test may drive the server with any object of this shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from kvserve.runtime.outputs import RequestOutput
from kvserve.runtime.stats import EngineStats


@runtime_checkable
class EngineClient(Protocol):
    # Constant facts, safe to read from any thread.
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    # Grammar compilation with per-client limits (runtime/structured_outputs/manager.py), thread-safe:
    # handlers compile before adding, so a bad schema is a 400 and a busy compiler a 429.
    structured_outputs: Any

    @property
    def max_num_seqs(self) -> int: ...

    def check_token_ids(self, ids: Iterable[Any], field: str) -> None:
        """Raises ValueError naming `field` for anything that is not a token id of the vocabulary."""

    # Engine thread only.
    def add_requests(self, requests: Iterable[tuple[str, Any, Any]]) -> None:
        """(request_id, prompt, params) as one group, all or nothing (ValueError naming the field).
        An engine with LoRA also takes ``lora_request=`` (one LoRARequest for the group)."""

    # LoRA adapters (engine thread; an engine without enable_lora raises ValueError, or lists none):
    # add_lora(LoRARequest) -> bool, remove_lora(lora_int_id) -> bool, pin_lora(lora_int_id) -> bool,
    # list_loras() -> set[int], get_lora(lora_int_id) -> LoRARequest | None. They are not part of
    # the protocol, so a test engine without them still qualifies.

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> EngineStats: ...

    def check_health(self) -> None: ...

    def close(self) -> None: ...
