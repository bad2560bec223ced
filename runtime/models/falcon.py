"""Falcon with rotary embeddings (Falcon-7B/40B/180B): attention and the MLP side by side.

Each layer computes x + attn(ln_a(x)) + mlp(ln_m(x)): Falcon-7B norms once for both branches
(multi-query attention), Falcon-40B's new decoder architecture has a LayerNorm per branch and
grouped KV heads. Attention is the shared rotary one (models.llama.Attention, rotate-half as
transformers' Falcon), the MLP MPT's ungated exact-GELU one; the fused q|k|v is split per KV group
at load (architectures.fused_rows_per_head). Falcon-RW (ALiBi, sequential) is models/mpt.py's
layer. The layer carries (hidden, residual) like the others: its output is attn + mlp, the residual
x, so the next layer's norm input is their sum.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.runtime.attention.backend import AttentionBackend
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models.llama import Attention
from kvserve.runtime.models.mpt import LayerNorm, PlainMLP, layer_norm
from kvserve.runtime.models.quantization import QuantizationConfig


class FalconParallelLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, layer: int = 0,
                 quant_config: QuantizationConfig | None = None, **kw):
        super().__init__()
        self.self_attn = Attention(cfg, backend, layer=layer, quant_config=quant_config, **kw)
        self.mlp = PlainMLP(cfg, prefix=f"model.layers.{layer}.mlp", quant_config=quant_config, **kw)
        self.mlp_prefix = "mlp."
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.input_layernorm = LayerNorm(cfg.hidden_size, bias=True, **dd)
        self.mlp_layernorm = LayerNorm(cfg.hidden_size, bias=True, **dd) if cfg.falcon_two_norms else None
        self.norm_names = ()  # listed by checkpoint_extras, biases included
        self.eps = cfg.rms_norm_eps

    def checkpoint_extras(self, pre: str) -> dict[str, tuple[torch.Tensor, None]]:
        out = self.input_layernorm.checkpoint_params(f"{pre}input_layernorm")
        if self.mlp_layernorm is not None:
            out.update(self.mlp_layernorm.checkpoint_params(f"{pre}mlp_layernorm"))
        return out

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin):
        x = hidden if residual is None else hidden + residual
        ln_a = self.input_layernorm
        attn_in = layer_norm(x, ln_a.weight, self.eps, ln_a.bias)
        ln_m = self.mlp_layernorm
        mlp_in = attn_in if ln_m is None else layer_norm(x, ln_m.weight, self.eps, ln_m.bias)
        out = self.self_attn(positions, attn_in, kv_cache, meta, cos_sin)
        return out + self.mlp(mlp_in), x
