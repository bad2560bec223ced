"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

They differ only in flags that ModelConfig reads from config.json, so one implementation serves
all four and one parity test suite covers them. Tokens are packed (no batch axis, no padding);
attention goes through the AttentionBackend, layer ops through kvserve.kernels.ops.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.runtime.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.runtime.model_config import ModelConfig, rope_cos_sin_cache
from kvserve.runtime.models.quantization import QuantizationConfig
from kvserve.runtime.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    ReplicatedWeight,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device, prefix: str = "model.layers.0",
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        shape = cfg.shape
        shape.check_tp(tp_size)
        d = shape.head_dim
        self.head_dim = d
        self.num_heads = shape.num_attention_heads // tp_size
        self.num_kv_heads = shape.kv_heads_per_rank(tp_size)
        if shape.num_kv_heads >= tp_size:
            kv_start = tp_rank * self.num_kv_heads
        else:  # fewer KV heads than ranks: each rank keeps a copy of the head its query heads use
            kv_start = tp_rank * shape.num_kv_heads // tp_size
        self.qkv_proj = MergedColumnParallelLinear(
            shape.hidden_size,
            output_sizes=[shape.num_attention_heads * d, shape.num_kv_heads * d, shape.num_kv_heads * d],
            shard_sizes=[self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d],
            shard_starts=[tp_rank * self.num_heads * d, kv_start * d, kv_start * d],
            bias=cfg.qkv_bias, dtype=dtype, device=device, part_names=["q", "k", "v"],
            prefixes=[f"{prefix}.self_attn.{p}_proj" for p in "qkv"], quant_config=quant_config,
            tp_rank=tp_rank, tp_size=tp_size,
        )
        self.o_proj = RowParallelLinear(shape.num_attention_heads * d, shape.hidden_size, bias=cfg.o_proj_bias,
                                        tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device,
                                        prefix=f"{prefix}.self_attn.o_proj", quant_config=quant_config)
        self.q_norm = ReplicatedWeight(d, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = ReplicatedWeight(d, dtype=dtype, device=device) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.scale = d**-0.5
        self.backend = backend
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.eps)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.attend(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device,
                 prefix: str = "model.layers.0", quant_config: QuantizationConfig | None = None):
        super().__init__()
        inter = cfg.shape.intermediate_size
        if inter % tp_size:
            raise ValueError(f"intermediate_size {inter} is not divisible by tensor_parallel_size {tp_size}")
        shard = inter // tp_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, output_sizes=[inter, inter], shard_sizes=[shard, shard],
            shard_starts=[tp_rank * shard, tp_rank * shard], bias=cfg.mlp_bias, dtype=dtype, device=device,
            part_names=["gate", "up"], prefixes=[f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"],
            quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size,
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias, tp_rank=tp_rank,
                                           tp_size=tp_size, dtype=dtype, device=device,
                                           prefix=f"{prefix}.mlp.down_proj", quant_config=quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, **kw):
        super().__init__()
        self.self_attn = Attention(cfg, backend, **kw)
        self.mlp = MLP(cfg, **kw)
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.input_layernorm = ReplicatedWeight(cfg.hidden_size, **dd)
        self.post_attention_layernorm = ReplicatedWeight(cfg.hidden_size, **dd)
        self.eps = cfg.rms_norm_eps

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin):
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_layernorm.weight, self.eps)
        else:
            hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.input_layernorm.weight, self.eps)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin)
        hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """A packed-token decoder: forward() gives final hidden states, compute_logits() the logits."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.config = cfg
        self.dtype, self.device = dtype, torch.device(device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_config = quant_config
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=self.device)
        qkw = dict(kw, quant_config=quant_config)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **qkw)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, prefix=f"model.layers.{i}", **qkw)
                                    for i in range(cfg.num_layers))
        self.norm = ReplicatedWeight(cfg.hidden_size, dtype=dtype, device=self.device)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, **qkw)
        # float32 regardless of the model dtype: ops.rotary_embedding casts per call, as HF does.
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(cfg, device=self.device), persistent=False)
        self.num_kv_heads = self.layers[0].self_attn.num_kv_heads if cfg.num_layers else 0
        self.head_dim = cfg.head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) pool on this rank."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected {len(self.layers)} layers, got {len(kv_caches)}")
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.cos_sin_cache)
        if residual is None:
            return ops.rms_norm(hidden, self.norm.weight, self.config.rms_norm_eps)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.norm.weight, self.config.rms_norm_eps)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [N, vocab_size] for hidden states [N, hidden_size]."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        return head.logits(hidden).float()

    def checkpoint_params(self) -> dict[str, tuple[torch.Tensor, str | None]]:
        """Maps every checkpoint tensor name this model consumes to (parameter, shard id).

        Linear layers list their own tensors (their weight format decides which: ``weight``, or
        ``qweight``/``scales``/..., one entry per fused part)."""
        out: dict[str, tuple[torch.Tensor, str | None]] = {"model.norm.weight": (self.norm.weight, None)}
        out.update(self.embed_tokens.checkpoint_params())
        if self.lm_head is not None:
            out.update(self.lm_head.checkpoint_params())
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            out.update(attn.qkv_proj.checkpoint_params())
            out.update(attn.o_proj.checkpoint_params())
            if attn.q_norm is not None:
                out[f"{pre}self_attn.q_norm.weight"] = (attn.q_norm.weight, None)
                out[f"{pre}self_attn.k_norm.weight"] = (attn.k_norm.weight, None)
            out.update(mlp.gate_up_proj.checkpoint_params())
            out.update(mlp.down_proj.checkpoint_params())
            out[f"{pre}input_layernorm.weight"] = (layer.input_layernorm.weight, None)
            out[f"{pre}post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, None)
        return out
