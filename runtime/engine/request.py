"""One request's state inside the engine, shared by its pieces: the scheduler reads `seq`, `row`
and the stop criteria; the output processor reads `detok`, `logprobs` and `metrics`.

One object rather than a copy per piece (as vLLM's separate processes need) because every piece
runs in one thread: a token is appended once and every piece sees it without a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.runtime.engine.detokenizer import IncrementalDetokenizer
from kvserve.runtime.engine.sequence import Sequence
from kvserve.runtime.outputs import Logprob, RequestMetrics
from kvserve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.runtime.sampler import SamplingRow


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    params: SamplingParams
    seq: Sequence
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    row: SamplingRow
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # n > 1: each sample is a Request of its own sharing request_id; `group` lists them all
    # (index order). The other samples join the scheduler by forking sample 0's blocks once
    # its prompt is computed (`unforked` until then), so the prompt's KV is held once.
    index: int = 0
    # A grammar still compiling when the request was admitted (a caller that did not compile
    # first): the core holds the request back until it is ready.
    pending_grammar: Any = None
    group: list[Request] | None = None
    unforked: list[Request] = field(default_factory=list)
    # The LoRA adapter (kvserve.runtime.lora.LoRARequest) this request runs with; None: the base model.
    lora_request: Any = None

    @property
    def samples(self) -> list[Request]:
        return self.group or [self]

    @property
    def head(self) -> Request:
        """Sample 0, which speaks for the whole request (its id, its metrics, its output)."""
        return self.group[0] if self.group else self

    @property
    def all_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)
