"""kvserve's LLM inference runtime: paged KV cache, continuous batching, HF Llama-family models.

Heavy imports (torch, transformers) happen on first use of an exported name, so that light
consumers (the operator importing ``kvserve.runtime.capacity``) stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "kvserve.runtime.llm",
    "LLMEngine": "kvserve.runtime.engine",
    "EngineConfig": "kvserve.runtime.config",
    "SamplingParams": "kvserve.runtime.sampling_params",
    "StructuredOutputsParams": "kvserve.runtime.structured_outputs.params",
    "RequestOutput": "kvserve.runtime.outputs",
    "CompletionOutput": "kvserve.runtime.outputs",
    "RequestMetrics": "kvserve.runtime.outputs",
    "EngineStats": "kvserve.runtime.stats",
    "LoRARequest": "kvserve.runtime.lora.request",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from kvserve.runtime.config import EngineConfig
    from kvserve.runtime.engine import LLMEngine
    from kvserve.runtime.llm import LLM
    from kvserve.runtime.lora.request import LoRARequest
    from kvserve.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kvserve.runtime.sampling_params import SamplingParams
    from kvserve.runtime.stats import EngineStats
    from kvserve.runtime.structured_outputs.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
