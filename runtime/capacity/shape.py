"""The parts of a model's config.json that decide its memory and how it shards: `ModelShape`.

Read once from the config mapping (`ModelShape.from_hf_config`); the runtime's ModelConfig builds
on this shape rather than reading these fields again, and the operator reads it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.runtime.architectures import architecture_of, attention_biases, standard_config
from kvserve.runtime.capacity import tp as _tp
from kvserve.runtime.layer_types import SLIDING_ATTENTION, attention_layer_types


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts part of a model: routed experts, shared experts, which layers."""

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    # Indices of the layers whose MLP is the expert block; the others have a dense MLP of
    # `intermediate_size` (DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers).
    moe_layers: tuple[int, ...]
    # Total width of the always-on shared expert(s) (0: none), and whether a sigmoid gate
    # (hidden -> 1, Qwen2-MoE) scales them.
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek V2/V3): low-rank queries and a cached KV latent."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the KV latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _positive(config: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"model config: missing field {key!r}")
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"model config: {key} must be an integer, got {value!r}") from None
    if value < 1:
        raise ValueError(f"model config: {key} must be >= 1, got {value}")
    return value


def _num_experts(config: Mapping[str, Any]) -> int:
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        if config.get(key):
            return _positive(config, key)
    return 0


def moe_shape_from_hf_config(config: Mapping[str, Any], num_layers: int) -> MoEShape | None:
    """The expert layout of Mixtral, Qwen2/3-MoE and DeepSeek V2/V3 configs; None for dense ones."""
    experts = _num_experts(config)
    if not experts:
        return None
    top_k = _positive(config, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"model config: num_experts_per_tok ({top_k}) exceeds the {experts} experts")
    model_type = str(config.get("model_type") or "")
    if model_type.startswith("deepseek") or config.get("n_routed_experts"):
        dense = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1)
        if freq != 1:
            raise ValueError(f"model config: moe_layer_freq {freq} is not supported; supported: 1")
        moe_layers = tuple(range(dense, num_layers))
        shared = int(config.get("n_shared_experts") or 0) * _positive(config, "moe_intermediate_size")
        return MoEShape(experts, top_k, _positive(config, "moe_intermediate_size"), moe_layers, shared)
    if not (model_type.startswith("qwen") or config.get("moe_intermediate_size")):  # Mixtral
        return MoEShape(experts, top_k, _positive(config, "intermediate_size"), tuple(range(num_layers)))
    # Qwen2-MoE / Qwen3-MoE: every decoder_sparse_step-th layer, minus mlp_only_layers.
    step = int(config.get("decoder_sparse_step") or 1)
    only_mlp = {int(i) for i in config.get("mlp_only_layers") or ()}
    moe_layers = tuple(i for i in range(num_layers) if i not in only_mlp and (i + 1) % step == 0)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    return MoEShape(experts, top_k, _positive(config, "moe_intermediate_size"), moe_layers, shared,
                    shared_expert_gate=shared > 0)


def mla_shape_from_hf_config(config: Mapping[str, Any]) -> MLAShape | None:
    if config.get("kv_lora_rank") is None:
        return None
    q_lora = config.get("q_lora_rank")
    return MLAShape(
        kv_lora_rank=_positive(config, "kv_lora_rank"),
        qk_rope_head_dim=_positive(config, "qk_rope_head_dim"),
        qk_nope_head_dim=_positive(config, "qk_nope_head_dim"),
        v_head_dim=_positive(config, "v_head_dim"),
        q_lora_rank=None if q_lora is None else _positive(config, "q_lora_rank"),
    )


@dataclass(frozen=True)
class ModelShape:
    """The parts of a decoder-only transformer's config that decide memory and sharding."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    # The q/k/v projections carry a bias (kvserve.runtime.architectures.attention_biases).
    attention_bias: bool = False
    # The window of the sliding-window layers (a query at position i sees keys
    # i - sliding_window < j <= i), or None when no layer has one.
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention" (empty: every layer is full); see layer_types.py.
    layer_types: tuple[str, ...] = ()
    moe: MoEShape | None = None
    mla: MLAShape | None = None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Reads a Hugging Face `config.json` mapping (Llama, Mistral, Qwen2, Qwen3, Gemma style;
        the expert fields of Mixtral, Qwen2/3-MoE and DeepSeek; DeepSeek's MLA fields)."""
        arch = architecture_of(config)
        config = standard_config(config)
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            layer_types, window = attention_layer_types(arch, dict(config), layers)
            shape = cls(
                num_layers=layers,
                hidden_size=hidden,
                num_attention_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=attention_biases(arch, config)[0],
                sliding_window=window,
                layer_types=layer_types if window is not None else (),
                moe=moe_shape_from_hf_config(config, layers),
                mla=mla_shape_from_hf_config(config),
            )
        except KeyError as missing:
            raise ValueError(f"model config: missing field {missing.args[0]!r}") from None
        shape.check()
        return shape

    def check(self) -> None:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"model config: {field} must be >= 1, got {getattr(self, field)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_sliding_layers(self) -> int:
        return sum(t == SLIDING_ATTENTION for t in self.layer_types)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer`, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def all_layers_sliding(self) -> bool:
        """Every layer attends within the window: K/V behind it is never read again by anyone."""
        return self.sliding_window is not None and self.num_sliding_layers == self.num_layers

    @property
    def kv_release_window(self) -> int | None:
        """The window behind which the runtime gives KV blocks back: only when every layer is a
        sliding-window layer (one block table serves all layers; a global layer reads them all)."""
        return self.sliding_window if self.all_layers_sliding else None

    def tp_error(self, tp: int) -> str | None:
        """Why this model cannot run at tensor-parallel degree `tp`, or None if it can."""
        return _tp.tp_error(self, tp)

    def check_tp(self, tp: int) -> None:
        _tp.check_tp(self, tp)

    def valid_tp_degrees(self, max_tp: int) -> list[int]:
        """Powers of two up to `max_tp` at which the model can be sharded."""
        return _tp.valid_tp_degrees(self, max_tp)

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        if self.mla is not None:
            return 1
        return max(1, self.num_kv_heads // tp)

    def kv_cache_layout(self, tp: int = 1) -> tuple[int, int, int]:
        """One layer's KV pools on a rank: (pools, heads, values per head). Each pool is
        [num_blocks, block_size, heads, values]: K and V for standard attention, one latent pool
        for MLA (its V is the first kv_lora_rank values of the latent, so no V pool)."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.kv_heads_per_rank(tp), self.head_dim
