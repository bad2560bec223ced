"""How much KV cache one replica holds: the one capacity model that the runtime and operator share.

Pure arithmetic over a model's shape, with no torch and no I/O, so the operator can import it
without a GPU stack. The runtime sizes its KV pool with `plan_capacity` / `blocks_for_budget`
and exports the result as a metric; the operator's autoscaler asks the same functions what each
tensor-parallel degree would give before it changes one.

Tensor parallelism splits attention heads across ranks. When a model has fewer KV heads than
ranks, each rank keeps one KV head (replicated), so per-token KV bytes per GPU stop shrinking
there. Every rank stores its slice of every token, so a replica's capacity in tokens equals one
GPU's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

# `kv_cache_dtype` values (vLLM's names): "auto" stores K/V in the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

GiB = 1024**3


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element for a dtype given as a string ("bfloat16", "fp16", ...) or torch dtype."""
    name = str(dtype).removeprefix("torch.").lower()
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported value {dtype!r}; supported: {sorted(_DTYPE_BYTES)}") from None


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: Any) -> int:
    """Bytes per stored K/V element: the model dtype's for "auto", 1 for the fp8 formats."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unsupported value {kv_cache_dtype!r}; supported: "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return dtype_bytes(model_dtype) if kv_cache_dtype == "auto" else 1


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
    attention_bias: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        """Reads a Hugging Face `config.json` mapping (Llama, Mistral, Qwen2, Qwen3 style)."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            shape = cls(
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_attention_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False))
                or config.get("model_type") == "qwen2",
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

    def tp_error(self, tp: int) -> str | None:
        """Why this model cannot run at tensor-parallel degree `tp`, or None if it can."""
        if tp < 1:
            return f"tensor_parallel_size must be >= 1, got {tp}"
        if self.num_attention_heads % tp:
            return (f"tensor_parallel_size {tp} does not divide the model's "
                    f"{self.num_attention_heads} attention heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            return (f"tensor_parallel_size {tp} and the model's {self.num_kv_heads} KV heads: one "
                    f"must divide the other")
        return None

    def check_tp(self, tp: int) -> None:
        error = self.tp_error(tp)
        if error:
            raise ValueError(error)

    def valid_tp_degrees(self, max_tp: int) -> list[int]:
        """Powers of two up to `max_tp` at which the model can be sharded."""
        degrees = []
        tp = 1
        while tp <= max_tp:
            if self.tp_error(tp) is None:
                degrees.append(tp)
            tp *= 2
        return degrees

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        return max(1, self.num_kv_heads // tp)


def kv_bytes_per_token(shape: ModelShape, dtype_size: int, tp: int = 1) -> int:
    """KV bytes one token takes on each GPU of a replica: 2 (K and V) x layers x heads x dim."""
    return 2 * shape.num_layers * shape.kv_heads_per_rank(tp) * shape.head_dim * dtype_size


def weight_bytes_per_gpu(shape: ModelShape, dtype_size: int, tp: int = 1) -> int:
    """Weight bytes on each GPU: matmuls and the vocabulary are sharded, norms replicated."""
    h, d = shape.hidden_size, shape.head_dim
    q_out = shape.num_attention_heads * d // tp
    kv_out = shape.kv_heads_per_rank(tp) * d
    attention = h * q_out + 2 * h * kv_out + q_out * h
    if shape.attention_bias:
        attention += q_out + 2 * kv_out
    mlp = 3 * h * (math.ceil(shape.intermediate_size / tp))
    norms = 2 * h + 2 * d  # two RMSNorms per layer (+ Qwen3's q/k norms, small either way)
    per_layer = attention + mlp + norms
    vocab_shard = math.ceil(shape.vocab_size / tp) * h
    embeddings = vocab_shard if shape.tie_word_embeddings else 2 * vocab_shard
    return (shape.num_layers * per_layer + embeddings + h) * dtype_size


@dataclass(frozen=True)
class ReplicaCapacity:
    """What one replica at one tensor-parallel degree holds."""

    tensor_parallel_size: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_cache_bytes_per_gpu: int
    block_size: int
    kv_blocks: int
    kv_tokens: int

    @property
    def fits(self) -> bool:
        """True when at least one block of KV fits beside the weights."""
        return self.kv_blocks > 0


def blocks_for_budget(kv_cache_bytes: int, shape: ModelShape, dtype_size: int, block_size: int,
                      tp: int = 1) -> int:
    """How many whole blocks a per-GPU KV budget holds."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    per_block = kv_bytes_per_token(shape, dtype_size, tp) * block_size
    return max(0, int(kv_cache_bytes) // per_block)


def plan_capacity(
    shape: ModelShape,
    *,
    dtype_size: int,
    block_size: int,
    tp: int,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int | None = None,
    kv_dtype_size: int | None = None,
) -> ReplicaCapacity:
    """KV capacity of one replica at degree `tp` on GPUs of `gpu_memory_bytes` each.

    The KV budget per GPU is ``gpu_memory_bytes * gpu_memory_utilization`` minus the weight shard
    minus a reserve for activations and the CUDA context (default: 5% of the GPU, at least 512 MiB).
    ``kv_dtype_size`` is the bytes per stored K/V element (``kv_cache_dtype_bytes``; default
    ``dtype_size``): an fp8 KV cache holds twice the tokens of a bf16 one in the same budget.
    """
    kv_size = dtype_size if kv_dtype_size is None else kv_dtype_size
    shape.check_tp(tp)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes is None:
        activation_reserve_bytes = max(512 * 1024**2, int(0.05 * gpu_memory_bytes))
    weights = weight_bytes_per_gpu(shape, dtype_size, tp)
    kv_budget = max(0, int(gpu_memory_bytes * gpu_memory_utilization) - weights - activation_reserve_bytes)
    blocks = blocks_for_budget(kv_budget, shape, kv_size, block_size, tp)
    return ReplicaCapacity(
        tensor_parallel_size=tp,
        weight_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=kv_bytes_per_token(shape, kv_size, tp),
        kv_cache_bytes_per_gpu=kv_budget,
        block_size=block_size,
        kv_blocks=blocks,
        kv_tokens=blocks * block_size,
    )
