"""One pipeline stage's forward pass over a CausalLM built with ``layer_range``.

A stage runs its own layers only. The first embeds the tokens; the others start from the
(hidden, residual) pair the previous stage sent, because the residual stream is what the next
layer's fused add + norm consumes. The last stage applies the final norm and returns the final
hidden states (its ``compute_logits`` then gives the logits). Everything else (attention, TP
collectives inside a layer, KV writes) is the full model's code, so a stage computes exactly
what those layers compute in one process.
"""

from __future__ import annotations

import re

import torch

from kvserve.runtime.attention.backend import AttentionMetadata

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_ONLY = ("model.embed_tokens.",)
_LAST_ONLY = ("model.norm.", "lm_head.")


def other_stage_tensor(name: str, start: int, end: int, num_layers: int, tied: bool) -> bool:
    """Whether checkpoint tensor `name` belongs to another stage (so loading skips it quietly)."""
    m = _LAYER.match(name)
    if m:
        return not start <= int(m.group(1)) < end
    first, last = start == 0, end == num_layers
    if name.startswith(_FIRST_ONLY):
        return not (first or (last and tied))
    if name.startswith(_LAST_ONLY):
        return not last
    return False


@torch.inference_mode()
def stage_forward(model, input_ids: torch.Tensor | None, positions: torch.Tensor, kv_caches: list,
                  meta: AttentionMetadata, hidden: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs layers [model.layer_start, model.layer_end). The first stage takes `input_ids`, the
    others `hidden` and `residual` from the previous stage. Returns (hidden, residual), or on the
    last stage (final hidden states, None)."""
    cfg = model.config
    if len(kv_caches) != len(model.layers):
        raise ValueError(f"kv_caches: expected {len(model.layers)} layers, got {len(kv_caches)}")
    if model.layer_start == 0:
        hidden = model.embed_tokens(input_ids)
        if model.embed_scale is not None:
            hidden = hidden * model.embed_scale
        residual = None
    local = model.local_cos_sin_cache
    groups = meta.kv_groups
    # EAGLE-3: the residual streams of the hooked layers this stage holds (pipeline_hidden.py).
    aux = getattr(model, "aux_hidden_layers", ())
    captured: list[torch.Tensor] = []
    for offset, (layer, kv_cache) in enumerate(zip(model.layers, kv_caches)):
        i = model.layer_start + offset
        cos_sin = local if local is not None and i in model._local_rope_layers else model.cos_sin_cache
        layer_meta = meta if groups is None else groups[model._layer_windows[i]]
        hidden, residual = layer(positions, hidden, residual, kv_cache, layer_meta, cos_sin)
        if aux and i in aux:
            captured.append(hidden if residual is None else hidden + residual)
    if aux:
        model.aux_hidden = captured
    if model.layer_end < cfg.num_layers:
        return hidden, residual
    if residual is None:
        return model.first_norm(hidden, model.norm.weight, cfg.rms_norm_eps), None
    hidden, _ = model.final_norm(hidden, residual, model.norm.weight, cfg.rms_norm_eps)
    return hidden, None
