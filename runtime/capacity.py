"""How much KV cache one replica holds: the one capacity model that the runtime and operator share.

Pure arithmetic over a model's shape, with no torch and no I/O, so the operator can import it
without a GPU stack. The runtime sizes its KV pool with `plan_capacity` / `blocks_for_budget`
and exports the result as a metric; the operator's autoscaler asks the same functions what each
tensor-parallel degree would give before it changes one.

Tensor parallelism splits attention heads across ranks. When a model has fewer KV heads than
ranks, each rank keeps one KV head (replicated), so per-token KV bytes per GPU stop shrinking
there. Every rank stores its slice of every token, so a replica's capacity in tokens equals one
GPU's.

Two model families change the arithmetic. Multi-head latent attention (MLA, DeepSeek V2/V3)
caches one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer instead of
per-head K and V; every rank needs the whole latent, so its KV bytes do not shrink with TP.
Mixture-of-experts models keep every expert resident: weights grow with the expert count while
the compute per token follows only the experts it is routed to. Experts are sharded like dense
MLPs (each expert's intermediate dimension split across ranks), so TP must divide it.

Sliding window: when every layer attends within a window (Mistral), the runtime gives back the
blocks behind each sequence's window, so a sequence holds at most about window + one step of
tokens, whatever its context length (``kv_tokens_held``); a long context then costs fewer bytes
per context token (``kv_bytes_per_context_token``), and a pool serves more such sequences
(``plan_capacity(context_len=...)``). When only some layers are local (Gemma's alternating
local/global layers, Qwen2's max_window_layers), the runtime keeps one block table and pool per
layer group (runtime/engine/kv_cache_groups.py, at tensor_parallel_size 1): the local layers hold the
window bound and the global ones the whole context, and ``kv_tokens_held`` averages the two per
layer, and ``plan_capacity(context_len=L)`` counts the L-token sequences the split pools hold.
``kv_tokens`` stays the single-table count (the ratio between TP degrees the operator uses);
the runtime's ``kvserve:kv_cache_capacity_tokens`` of a grouped model is its full-attention
group's slots, more than that.
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

# Weight formats, by vLLM's names (`quantization=` / `--quantization` / spec.runtime.quantization).
WEIGHT_FORMATS = ("int8", "int4", "awq", "gptq", "compressed-tensors", "fp8", "gguf")
# Formats a checkpoint can already be in (config.json's quantization_config.quant_method).
CHECKPOINT_FORMATS = ("awq", "gptq", "compressed-tensors", "fp8", "gguf")
# Formats that quantize a full-precision checkpoint while loading it.
LOAD_TIME_FORMATS = ("int8", "int4", "fp8")


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
    attention_bias: bool = False
    # The window of the sliding-window layers and how many layers have it (see layer_types.py).
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    moe: MoEShape | None = None
    mla: MLAShape | None = None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        """Reads a Hugging Face `config.json` mapping (Llama, Mistral, Qwen2, Qwen3 style; the
        expert fields of Mixtral, Qwen2/3-MoE and DeepSeek; DeepSeek's MLA fields)."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            shape = cls(
                num_layers=layers,
                hidden_size=hidden,
                num_attention_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False))
                or config.get("model_type") == "qwen2",
                **_sliding_layers(config, int(config["num_hidden_layers"])),
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

    def tp_error(self, tp: int) -> str | None:
        """Why this model cannot run at tensor-parallel degree `tp`, or None if it can."""
        if tp < 1:
            return f"tensor_parallel_size must be >= 1, got {tp}"
        if self.num_attention_heads % tp:
            return (f"tensor_parallel_size {tp} does not divide the model's "
                    f"{self.num_attention_heads} attention heads")
        if self.moe is not None:
            for what, size in (("expert intermediate size", self.moe.expert_intermediate_size),
                               ("shared-expert intermediate size", self.moe.shared_intermediate_size)):
                if size % tp:
                    return f"tensor_parallel_size {tp} does not divide the model's {what} {size}"
            if len(self.moe.moe_layers) < self.num_layers and self.intermediate_size % tp:
                return (f"tensor_parallel_size {tp} does not divide the model's dense intermediate size "
                        f"{self.intermediate_size}")
        if self.mla is not None:  # one latent "KV head" that every rank keeps whole
            return None
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

    @property
    def kv_release_window(self) -> int | None:
        """The window behind which the runtime gives KV blocks back: only when every layer is a
        sliding-window layer (one block table serves all layers; a global layer reads them all)."""
        if self.sliding_window is not None and self.num_sliding_layers == self.num_layers:
            return self.sliding_window
        return None


def _sliding_layers(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    from kvserve.runtime.layer_types import SLIDING_ATTENTION, attention_layer_types

    arch = next(iter(config.get("architectures") or []), "")
    types, window = attention_layer_types(arch, dict(config), num_layers)
    return dict(sliding_window=window, num_sliding_layers=sum(t == SLIDING_ATTENTION for t in types))


def kv_tokens_held(shape: ModelShape, context_len: int, *, block_size: int, max_step_tokens: int,
                   kv_cache_groups: bool = True) -> int:
    """The most K/V slots (whole blocks) one sequence of `context_len` tokens holds at once when
    each step computes at most `max_step_tokens` of its tokens: all of its blocks, or, with a
    window on every layer, the window before a step plus the step at the worst block alignment
    (the same bound as BlockManager.max_blocks_held). With local and global layers and
    `kv_cache_groups` (the runtime's hybrid KV cache manager, on at tensor_parallel_size 1), the
    local layers hold that window bound and the global ones every block: the average per layer,
    rounded up, is returned (so that times ``kv_bytes_per_token`` it is the bytes held)."""
    if context_len < 1 or block_size < 1 or max_step_tokens < 1:
        raise ValueError("context_len, block_size and max_step_tokens must be >= 1")
    return -(-_layer_slots_held(shape, context_len, block_size, max_step_tokens, kv_cache_groups)
             // shape.num_layers)


def has_kv_cache_groups(shape: ModelShape) -> bool:
    """Local and global layers: the runtime keeps one block table per layer group."""
    return shape.sliding_window is not None and 0 < shape.num_sliding_layers < shape.num_layers


def _layer_slots_held(shape: ModelShape, context_len: int, block_size: int, max_step_tokens: int,
                      kv_cache_groups: bool) -> int:
    """K/V slots one sequence holds summed over the layers (see kv_tokens_held)."""
    whole = -(-context_len // block_size)

    def window_bound(window: int) -> int:
        span = window - 1 + min(max_step_tokens, context_len)
        return min(whole, -(-span // block_size) + 1)

    if shape.kv_release_window is not None:
        return window_bound(shape.kv_release_window) * block_size * shape.num_layers
    if kv_cache_groups and has_kv_cache_groups(shape):
        local = shape.num_sliding_layers
        return ((shape.num_layers - local) * whole + local * window_bound(shape.sliding_window)) * block_size
    return whole * block_size * shape.num_layers


def kv_bytes_per_context_token(shape: ModelShape, dtype_size: int, context_len: int, tp: int = 1, *,
                               block_size: int = 16, max_step_tokens: int = 2048) -> float:
    """KV bytes per GPU that one token of a `context_len`-token sequence costs on average: the
    sequence's held slots times `kv_bytes_per_token`, over its length. Without a window on every
    layer that is `kv_bytes_per_token` (plus block rounding); with one it falls as 1 / context_len."""
    held = kv_tokens_held(shape, context_len, block_size=block_size, max_step_tokens=max_step_tokens)
    return kv_bytes_per_token(shape, dtype_size, tp) * held / context_len


def kv_bytes_per_token(shape: ModelShape, dtype_size: int, tp: int = 1) -> int:
    """KV bytes one token takes on each GPU of a replica: pools (2: K and V; 1: an MLA latent)
    x layers x heads x values per head."""
    pools, heads, size = shape.kv_cache_layout(tp)
    return pools * shape.num_layers * heads * size * dtype_size


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


@dataclass(frozen=True)
class WeightFormat:
    """Bytes one weight takes in a format, as the runtime holds it (values, scales, zeros/offsets).

    `linear_bytes`: per parameter of a quantized matmul; `vocab_bytes`: per parameter of the
    embedding table and LM head (the compute dtype's size unless the format covers them)."""

    name: str
    linear_bytes: float
    vocab_bytes: float


def weight_format(quantization: str | None, dtype_size: int, hidden_size: int = 4096,
                  quantization_config: Mapping[str, Any] | None = None) -> WeightFormat:
    """The memory a weight format takes per parameter (for TP planning and pool sizing).

    Integer formats end as 4- or 8-bit values plus a scale (and, 4-bit, an offset) per group in
    the compute dtype; per-channel scales count once per row (``hidden_size`` stands in for the
    row length). FP8 keeps a float32 scale per row. Group sizes come from the checkpoint's
    ``quantization_config`` when given (else 128, the common default)."""
    s = dtype_size
    if quantization is None:
        return WeightFormat("none", s, s)
    if quantization not in WEIGHT_FORMATS:
        raise ValueError(f"quantization: unknown format {quantization!r}; supported: {', '.join(WEIGHT_FORMATS)}")
    qc = dict(quantization_config or {})

    def int4(group: int) -> float:
        return 0.5 + 2 * s / (group if group > 0 else hidden_size)

    def int8(group: int | None) -> float:
        return 1 + s / (group if group and group > 0 else hidden_size)

    if quantization == "int8":
        return WeightFormat("int8", int8(None), int8(None))
    if quantization == "int4":
        return WeightFormat("int4", int4(128), int4(128))
    if quantization == "fp8":
        return WeightFormat("fp8", 1 + 4 / hidden_size, s)
    if quantization == "gguf":
        # As a GPU holds a GGUF file (kvserve.runtime.models.quantization.gguf): 4-bit types as
        # int4 group 32, Q8_0 as int8 group 32, the rest dequantized. Matmul tensors averaged by
        # count (the file's tensor_types carry no sizes): close when one type dominates.
        types = qc.get("tensor_types") or {}

        def gguf_bytes(t: str) -> float:
            return int4(32) if t in ("Q4_0", "Q4_1", "Q4_K") else int8(32) if t == "Q8_0" else s

        linear = [gguf_bytes(t) for n, t in types.items()
                  if ".layers." in n and n.endswith(".weight") and not n.endswith("norm.weight")]
        vocab = [gguf_bytes(types[n]) for n in ("model.embed_tokens.weight", "lm_head.weight") if n in types]
        return WeightFormat("gguf", sum(linear) / len(linear) if linear else s, max(vocab) if vocab else s)
    if quantization == "awq":
        return WeightFormat("awq", int4(int(qc.get("group_size", qc.get("q_group_size", 128)))), s)
    if quantization == "gptq":
        group = int(qc.get("group_size", 128))
        return WeightFormat("gptq", int4(group) if int(qc.get("bits", 4)) == 4 else int8(group), s)
    weights = {}
    for group in (qc.get("config_groups") or {}).values():  # compressed-tensors: the first group decides
        weights = group.get("weights") or {}
        break
    bits, kind = int(weights.get("num_bits", 4)), str(weights.get("type", "int"))
    group = int(weights.get("group_size") or 0) if weights.get("strategy", "group") == "group" else 0
    if kind == "float":
        return WeightFormat("compressed-tensors", 1 + 4 / hidden_size, s)
    return WeightFormat("compressed-tensors", int4(group or 128 if weights else 128) if bits == 4 else int8(group), s)


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
    # With plan_capacity(context_len=L): how many L-token sequences the pool holds at once
    # (window-bounded when every layer is local), and the context tokens they add up to.
    context_len: int | None = None
    max_sequences_at_context_len: int | None = None
    context_tokens: int | None = None

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
    weight_format: WeightFormat | None = None,
    kv_dtype_size: int | None = None,
    context_len: int | None = None,
    max_step_tokens: int = 2048,
) -> ReplicaCapacity:
    """KV capacity of one replica at degree `tp` on GPUs of `gpu_memory_bytes` each.

    The KV budget per GPU is ``gpu_memory_bytes * gpu_memory_utilization`` minus the weight shard
    minus a reserve for activations and the CUDA context (default: 5% of the GPU, at least 512 MiB).
    `weight_format` sizes quantized weights (an AWQ model's shard is about a quarter of bf16's);
    `kv_dtype_size` is the bytes per stored K/V element (``kv_cache_dtype_bytes``; default
    `dtype_size`): an fp8 KV cache holds twice the tokens of a bf16 one in the same budget.
    ``kv_tokens`` counts the pool's slots (what ``kvserve:kv_cache_capacity_tokens`` reports);
    with `context_len`, the plan also says how many sequences of that length fit at once when
    each step computes at most `max_step_tokens` (max_num_batched_tokens) of a sequence.
    """
    kv_size = dtype_size if kv_dtype_size is None else kv_dtype_size
    shape.check_tp(tp)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes is None:
        activation_reserve_bytes = max(512 * 1024**2, int(0.05 * gpu_memory_bytes))
    weights = weight_bytes_per_gpu(shape, dtype_size, tp, weight_format)
    kv_budget = max(0, int(gpu_memory_bytes * gpu_memory_utilization) - weights - activation_reserve_bytes)
    blocks = blocks_for_budget(kv_budget, shape, kv_size, block_size, tp)
    at_context: dict[str, int] = {}
    if context_len is not None:
        groups = tp == 1  # the runtime keeps one block table for all layers at higher degrees
        if groups and has_kv_cache_groups(shape):
            # Each group's pool is sized for this length (kvserve.runtime.engine.kv_cache_groups), so the
            # budget divides by the bytes one such sequence holds across the layers.
            layer_bytes = kv_bytes_per_token(shape, kv_size, tp) // shape.num_layers
            held_bytes = _layer_slots_held(shape, context_len, block_size, max_step_tokens, True) * layer_bytes
            sequences = kv_budget // held_bytes
        else:
            held = kv_tokens_held(shape, context_len, block_size=block_size, max_step_tokens=max_step_tokens,
                                  kv_cache_groups=groups)
            sequences = blocks * block_size // held
        at_context = dict(context_len=context_len, max_sequences_at_context_len=sequences,
                          context_tokens=sequences * context_len)
    return ReplicaCapacity(
        tensor_parallel_size=tp,
        weight_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=kv_bytes_per_token(shape, kv_size, tp),
        kv_cache_bytes_per_gpu=kv_budget,
        block_size=block_size,
        kv_blocks=blocks,
        kv_tokens=blocks * block_size,
        **at_context,
    )
