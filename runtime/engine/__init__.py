"""The engine: requests in, one scheduled forward pass per step, RequestOutputs out.

The request side of serving, one module per piece:

- ``input_processor``: tokenizing, validation, grammar compilation, n > 1 expansion; a request
  (or a batch) is admitted whole or not at all, before anything is queued.
- ``core``: ``EngineCore.step()``: schedule, ``executor.execute_model``, update from the output.
- ``scheduler``, ``block_manager``, ``kv_cache_groups``, ``prefix_cache``, ``sequence``: what runs
  next and where its K/V lives (pure, no torch).
- ``output_processor``, ``detokenizer``, ``stop_strings``: text, stop strings, logprobs, outputs.
- ``client``: the small interface the server's async engine talks to.
- ``llm_engine``: ``LLMEngine``, the four pieces and an executor put together.

Names are loaded on first use so that the pure modules (the operator's capacity model imports
``kv_cache_groups``) never pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLMEngine": "kvserve.runtime.engine.llm_engine",
    "Prompt": "kvserve.runtime.engine.llm_engine",
    "resolve_device": "kvserve.runtime.engine.llm_engine",
    "resolve_dtype": "kvserve.runtime.engine.llm_engine",
    "check_kv_cache_dtype_for_model": "kvserve.runtime.engine.llm_engine",
    "kv_release_window": "kvserve.runtime.engine.llm_engine",
    "hybrid_kv_groups": "kvserve.runtime.engine.llm_engine",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from kvserve.runtime.engine.llm_engine import (
        LLMEngine,
        Prompt,
        check_kv_cache_dtype_for_model,
        hybrid_kv_groups,
        kv_release_window,
        resolve_device,
        resolve_dtype,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve.runtime.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
