"""ALiBi families: MPT and BLOOM. ALiBi attention (no rotary embedding), LayerNorms (weight-only
for MPT, with biases for BLOOM, which also norms its embeddings) and an ungated GELU MLP (exact for
MPT; BLOOM's tanh approximation, with biases).

The decoder is the shared one (models.llama.CausalLM): the checkpoint's names are mapped onto
the shared layout at load (architectures.checkpoint_name) and the fused q|k|v is split like
Phi-3's qkv_proj (BLOOM's head by head), so only the layer differs. BLOOM's slopes are MPT's
formula at bias max 8: for every head count the two constructions give the same values.

ALiBi adds slope_h * (j - i) to the score of query position i and key position j; the attention
backend applies it (the torch backend, the Triton kernels and the native CPU decode kernel); float32
CPU decode steps run the whole stack natively (models/native_decode.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.kernels.reference import is_fp8
from kvserve.runtime.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models.layers import MergedColumnParallelLinear, ReplicatedWeight, RowParallelLinear
from kvserve.runtime.models.llama import Attention
from kvserve.runtime.models.quantization import QuantizationConfig


def alibi_slopes(num_heads: int, bias_max: float) -> torch.Tensor:
    """float32 [num_heads]: MPT's slopes 2^-(i * bias_max / H') for i = 1..H' (H' the next power of
    two), interleaved (odd then even positions) when H is not a power of two."""
    pow2 = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, pow2 + 1, dtype=torch.float32) * (bias_max / pow2)
    slopes = 1.0 / torch.pow(2.0, base)
    if pow2 != num_heads:
        slopes = torch.cat((slopes[1::2], slopes[::2]))[:num_heads]
    return slopes


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual): the shape of ops.fused_add_rms_norm."""
    residual = x + residual
    return layer_norm(residual, weight, eps, bias), residual


class LayerNorm(nn.Module):
    """A replicated LayerNorm: `weight`, and `bias` when the family has one (BLOOM)."""

    def __init__(self, size: int, *, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.norm_weight = ReplicatedWeight(size, dtype=dtype, device=device)
        self.norm_bias = ReplicatedWeight(size, dtype=dtype, device=device) if bias else None

    @property
    def weight(self) -> torch.Tensor:
        return self.norm_weight.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.norm_bias is None else self.norm_bias.weight

    def checkpoint_params(self, pre: str) -> dict[str, tuple[torch.Tensor, None]]:
        out = {f"{pre}.weight": (self.weight, None)}
        if self.norm_bias is not None:
            out[f"{pre}.bias"] = (self.bias, None)
        return out


class AlibiAttention(Attention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, tp_rank: int, tp_size: int, **kw):
        super().__init__(cfg, backend, tp_rank=tp_rank, tp_size=tp_size, **kw)
        slopes = alibi_slopes(cfg.shape.num_attention_heads, cfg.alibi_bias_max) * cfg.alibi_scale
        self.register_buffer("alibi_slopes", slopes[tp_rank * self.num_heads:(tp_rank + 1) * self.num_heads]
                             .to(kw["device"]), persistent=False)
        self.scale = cfg.attention_scale()
        self.clip_qkv = cfg.clip_qkv

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if is_fp8(k_cache) else {}
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        out = self.backend.attend(q, k, v, k_cache, v_cache, meta, self.scale, sliding_window=self.sliding_window,
                                  alibi_slopes=self.alibi_slopes, **scales)
        return self.o_proj(out.reshape(t, self.q_size))


class PlainMLP(nn.Module):
    """up_proj -> GELU (exact, or BLOOM's tanh approximation) -> down_proj (no gate)."""

    def __init__(self, cfg: ModelConfig, *, tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device,
                 prefix: str = "mlp", quant_config: QuantizationConfig | None = None):
        super().__init__()
        inter = cfg.shape.intermediate_size
        if inter % tp_size:
            raise ValueError(f"intermediate_size {inter} is not divisible by tensor_parallel_size {tp_size}")
        shard = inter // tp_size
        self.up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, output_sizes=[inter], shard_sizes=[shard], shard_starts=[tp_rank * shard], bias=cfg.mlp_bias,
            dtype=dtype, device=device, part_names=[None], prefixes=[f"{prefix}.up_proj"],
            quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias, tp_rank=tp_rank, tp_size=tp_size,
                                           dtype=dtype, device=device, prefix=f"{prefix}.down_proj",
                                           quant_config=quant_config)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))

    def checkpoint_params(self, pre: str) -> dict[str, tuple[torch.Tensor, str | None]]:
        out = self.up_proj.checkpoint_params([f"{pre}up_proj"])
        out.update(self.down_proj.checkpoint_params([f"{pre}down_proj"]))
        return out


class AlibiDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then + mlp(ln_2(.)); (hidden, residual) carried as in
    DecoderLayer, so the add that closes one sublayer is the norm's input in the next."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, layer: int = 0,
                 quant_config: QuantizationConfig | None = None, **kw):
        super().__init__()
        self.self_attn = AlibiAttention(cfg, backend, layer=layer, quant_config=quant_config, **kw)
        self.mlp = PlainMLP(cfg, prefix=f"model.layers.{layer}.mlp", quant_config=quant_config, **kw)
        self.mlp_prefix = "mlp."
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.input_layernorm = LayerNorm(cfg.hidden_size, bias=cfg.norm_bias, **dd)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, bias=cfg.norm_bias, **dd)
        self.norm_names = ()  # listed by checkpoint_extras, biases included
        self.eps = cfg.rms_norm_eps

    def checkpoint_extras(self, pre: str) -> dict[str, tuple[torch.Tensor, None]]:
        out = self.input_layernorm.checkpoint_params(f"{pre}input_layernorm")
        out.update(self.post_attention_layernorm.checkpoint_params(f"{pre}post_attention_layernorm"))
        return out

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin):
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual = hidden
            hidden = layer_norm(hidden, ln1.weight, self.eps, ln1.bias)
        else:
            hidden, residual = add_layer_norm(hidden, residual, ln1.weight, self.eps, ln1.bias)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin)
        hidden, residual = add_layer_norm(hidden, residual, ln2.weight, self.eps, ln2.bias)
        return self.mlp(hidden), residual
