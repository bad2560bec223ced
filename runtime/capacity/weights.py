"""Weight bytes per GPU: matmuls and the vocabulary sharded, norms replicated, every expert resident.

Quantized weights are sized by their format (`kvserve.runtime.weight_formats`: each format's
config class says its bytes per weight).
"""

from __future__ import annotations

import math

from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.weight_formats import WeightFormat


def _attention_elements(shape: ModelShape, tp: int) -> int:
    h = shape.hidden_size
    if shape.mla is not None:
        m = shape.mla
        heads = shape.num_attention_heads // tp
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        # Low-rank projections and their norms are replicated; per-head up-projections split.
        q = h * heads * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk
        kv = h * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h
    d = shape.head_dim
    q_out = shape.num_attention_heads * d // tp
    kv_out = shape.kv_heads_per_rank(tp) * d
    attention = h * q_out + 2 * h * kv_out + q_out * h
    if shape.attention_bias:
        attention += q_out + 2 * kv_out
    return attention + 2 * d  # Qwen3's q/k norms, small either way


def _mlp_elements(shape: ModelShape, tp: int) -> int:
    """MLP weights of all layers on one rank: dense layers, and every expert of the MoE layers."""
    h = shape.hidden_size
    dense = 3 * h * math.ceil(shape.intermediate_size / tp)
    moe = shape.moe
    if moe is None:
        return shape.num_layers * dense
    experts = moe.num_experts * 3 * h * math.ceil(moe.expert_intermediate_size / tp)
    router = moe.num_experts * h  # replicated: every rank routes every token
    shared = 3 * h * math.ceil(moe.shared_intermediate_size / tp) + (h if moe.shared_expert_gate else 0)
    moe_layers = len(moe.moe_layers)
    return moe_layers * (experts + router + shared) + (shape.num_layers - moe_layers) * dense


def weight_bytes_per_gpu(shape: ModelShape, dtype_size: int, tp: int = 1, fmt: WeightFormat | None = None) -> int:
    """Weight bytes on each GPU: matmuls and the vocabulary are sharded, norms replicated; for
    MoE models every expert of every MoE layer is resident. `fmt` (`weight_format`) sizes
    quantized matmuls; None is full precision in `dtype_size`."""
    h = shape.hidden_size
    norms = shape.num_layers * 2 * h + h  # two RMSNorms per layer, and the final one
    linear = shape.num_layers * _attention_elements(shape, tp) + _mlp_elements(shape, tp)
    vocab_shard = math.ceil(shape.vocab_size / tp) * h
    embeddings = vocab_shard if shape.tie_word_embeddings else 2 * vocab_shard
    if fmt is None:
        return (linear + embeddings + norms) * dtype_size
    return int(math.ceil(linear * fmt.linear_bytes + embeddings * fmt.vocab_bytes + norms * dtype_size))


def active_parameters(shape: ModelShape) -> int:
    """Weights one token's forward pass reads (tp=1): the routed experts it picks, not all."""
    if shape.moe is None:
        return weight_bytes_per_gpu(shape, 1)
    moe = shape.moe
    h = shape.hidden_size
    idle = len(moe.moe_layers) * (moe.num_experts - moe.experts_per_token) * 3 * h * moe.expert_intermediate_size
    return weight_bytes_per_gpu(shape, 1) - idle
