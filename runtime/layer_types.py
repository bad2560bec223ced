"""Which layers of a model attend within a sliding window, read from its config.json mapping.

Pure (no torch): the runtime's ModelConfig and the capacity model that the operator imports both
use it, so they agree on which layers are local.
"""

from __future__ import annotations

from typing import Any

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' names for the two kinds of attention layer (config.json "layer_types").
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def attention_layer_types(arch: str, config: dict[str, Any],
                          num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Per-layer attention kinds and the sliding window, following transformers for each family:

    - Mistral, Mixtral, Phi-3: `sliding_window` (when not null) on every layer;
    - Qwen2/Qwen3: only with `use_sliding_window`, on the layers `layer_types` names, or else on
      layers i >= `max_window_layers`;
    - Gemma 2/3: `layer_types`, or else alternating local/global layers (every second layer is
      global in Gemma 2; every `sliding_window_pattern`-th, default 6, in Gemma 3).
    """
    full = tuple([FULL_ATTENTION] * num_layers)
    window = config.get("sliding_window")
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        if config.get("use_sliding_window"):  # released Qwen MoE checkpoints all set false
            raise ValueError(f"model config: use_sliding_window true is not supported for {arch}; supported: false")
        return full, None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        if window is None:
            return full, None
        return tuple([SLIDING_ATTENTION] * num_layers), _window(window)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not config.get("use_sliding_window") or window is None:
            return full, None
        types = config.get("layer_types")
        if types is None:
            first = int(config.get("max_window_layers") or 0)
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
        types = _check_layer_types(types, num_layers)
        return types, (_window(window) if SLIDING_ATTENTION in types else None)
    if arch in GEMMA_ARCHITECTURES:
        types = config.get("layer_types")
        if types is None:
            period = 2 if arch == "Gemma2ForCausalLM" else int(config.get("sliding_window_pattern") or 6)
            if period < 1:
                raise ValueError(f"model config: sliding_window_pattern must be >= 1, got {period}")
            types = [SLIDING_ATTENTION if (i + 1) % period else FULL_ATTENTION for i in range(num_layers)]
        types = _check_layer_types(types, num_layers)
        if SLIDING_ATTENTION in types:
            if window is None:
                raise ValueError("model config: sliding_window is null but layer_types has sliding_attention "
                                 "layers; set sliding_window")
            return types, _window(window)
        return types, None
    return full, None


def _window(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model config: sliding_window must be a positive integer, got {value!r}")
    return value


def _check_layer_types(types: Any, num_layers: int) -> tuple[str, ...]:
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ValueError(f"model config: layer_types must list one type per layer ({num_layers}), got {types!r}")
    for t in types:
        if t not in LAYER_TYPES:
            raise ValueError(f"model config: layer_types entry {t!r} is not supported; "
                             f"supported: {', '.join(LAYER_TYPES)}")
    return tuple(types)
