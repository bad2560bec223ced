"""What the runtime needs to know about a Hugging Face model directory, read once and checked.

Reads config.json (and generation_config.json for extra EOS ids) without importing transformers,
so every unsupported architecture or option fails here, with a message naming what is supported,
before any weight is loaded.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvserve.runtime.capacity import ModelShape
from kvserve.runtime.layer_types import (
    FULL_ATTENTION,
    GEMMA_ARCHITECTURES,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    attention_layer_types,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")
# Activations of the gated MLP, by config.json name: SiLU (Llama family) or tanh-approximated GELU.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}



def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:  # name the file: a bare JSONDecodeError does not
        raise ValueError(f"model: {path} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model: {path} must hold a JSON object")
    return data

@dataclass(frozen=True)
class RoutingConfig:
    """How an MoE layer picks each token's experts and weighs them, as transformers does it.

    scoring "softmax" (Mixtral, Qwen-MoE, DeepSeek V2) or "sigmoid" (DeepSeek V3) over the
    router logits; topk_method "greedy" (plain top-k), "group_limited_greedy" (V2: top-k within
    the topk_group groups of highest max score) or "noaux_tc" (V3: groups ranked by the sum of
    their two best bias-corrected scores, experts chosen on score + e_score_correction_bias but
    weighted by the uncorrected score); then the chosen weights are renormalized to sum to 1 when
    norm_topk_prob, and multiplied by routed_scaling_factor.
    """

    scoring: str = "softmax"
    topk_method: str = "greedy"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # Router logits in float32 from float32 weights (DeepSeek), rather than in the model dtype.
    float32_logits: bool = False
    # Apply the routing weights in float32 (Mixtral) or cast to the model dtype first (Qwen-MoE).
    float32_weights: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """A supported decoder-only model's architecture, shape, RoPE and special tokens."""

    model_dir: pathlib.Path
    architecture: str
    model_type: str
    shape: ModelShape
    max_position_embeddings: int
    dtype: torch.dtype  # the checkpoint's dtype
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    pad_token_id: int | None
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; otherwise the scaling parameters with "rope_type" normalized in.
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # The attention window of the sliding-window layers (a query at position i sees keys
    # i - sliding_window < j <= i, as in transformers), or None when no layer has one.
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention" (empty means every layer is full).
    layer_types: tuple[str, ...] = ()
    # RoPE of the sliding-window layers when it differs from the global one (Gemma 3's local
    # base frequency): (theta, scaling), else None.
    local_rope: tuple[float, dict[str, Any] | None] | None = None
    # "silu" or "gelu_tanh" (the gated MLP's activation).
    hidden_act: str = "silu"
    # Gemma: RMSNorm scales by (1 + weight), embeddings are multiplied by sqrt(hidden_size), each
    # layer also norms the attention and MLP outputs (post-attention, pre/post feed-forward norms).
    gemma_norms: bool = False
    # The attention scale is query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma).
    query_pre_attn_scalar: float | None = None
    # tanh soft-capping: cap * tanh(x / cap) on the attention scores / the final logits (Gemma 2).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts: routing (shapes are in shape.moe); None for dense models.
    routing: RoutingConfig | None = None
    # MLA (shapes in shape.mla): DeepSeek's rotary dims come in interleaved pairs (V2 always;
    # V3 unless rope_interleave is false); the loader permutes them to rotate-half order.
    rope_interleave: bool = False
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Per-frequency RoPE divisors stored by a GGUF file (llama.cpp's rope_freqs tensor, how it
    # encodes Llama 3's rope scaling), applied on top of rope_scaling; None for none.
    rope_freq_factors: tuple[float, ...] | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | pathlib.Path) -> "ModelConfig":
        """Reads a Hugging Face directory's config.json, or a GGUF file's metadata."""
        from kvserve.runtime.gguf.reader import is_gguf_path, resolve_model_path

        model_dir = resolve_model_path(str(model_dir))  # a directory holding one .gguf: that file
        if is_gguf_path(model_dir):
            from kvserve.runtime.gguf import model_config

            return model_config(model_dir)
        model_dir = pathlib.Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model: no config.json in {str(model_dir)!r}")
        config = _read_json(config_path)
        generation: dict[str, Any] = {}
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            generation = _read_json(gen_path)
        return cls.from_dict(config, generation, model_dir=model_dir)

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation: dict[str, Any] | None = None, *,
                  model_dir: str | pathlib.Path = ".") -> "ModelConfig":
        generation = generation or {}
        architectures = config.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            hint = ""
            if "Gemma3ForConditionalGeneration" in architectures:
                hint = (" (Gemma 3's multimodal checkpoint: serve a text-only Gemma3ForCausalLM "
                        "checkpoint, whose config is Gemma 3's text config)")
            raise ValueError(
                f"model architecture {architectures or config.get('model_type')!r} is not supported{hint}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = config.get("model_type", "")
        shape = ModelShape.from_hf_config(config)
        is_gemma = arch in GEMMA_ARCHITECTURES

        # Gemma configs name the activation hidden_activation (hidden_act is a legacy alias).
        act_field = "hidden_activation" if is_gemma and config.get("hidden_activation") else "hidden_act"
        act = config.get(act_field) or ("gelu_pytorch_tanh" if is_gemma else "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"model config: {act_field} {act!r} is not supported; "
                             f"supported: {', '.join(repr(a) for a in _ACTIVATIONS)}")
        if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("model config: partial_rotary_factor != 1.0 is not supported")
        routing = _routing(arch, config, shape) if arch in MOE_ARCHITECTURES else None
        if arch in MOE_ARCHITECTURES and act != "silu":  # the fused experts are SiLU-gated
            raise ValueError(f"model config: hidden_act {act!r} is not supported for {arch}; supported: 'silu'")
        if arch in MLA_ARCHITECTURES and shape.mla is None:
            raise ValueError(f"model config: {arch} needs kv_lora_rank (multi-head latent attention)")
        if arch in MOE_ARCHITECTURES and shape.moe is None:
            raise ValueError(f"model config: {arch} needs a positive expert count "
                             f"(num_local_experts, num_experts or n_routed_experts)")

        layer_types, window = attention_layer_types(arch, config, shape.num_layers)
        rotary_dim = shape.mla.qk_rope_head_dim if shape.mla is not None else shape.head_dim
        rope_theta, rope_scaling, local_rope = _rope_per_layer_type(arch, config, rotary_dim)
        max_pos = int(config.get("max_position_embeddings") or 2048)

        is_qwen2 = arch == "Qwen2ForCausalLM"
        is_mistral = arch in ("MistralForCausalLM", "MixtralForCausalLM")
        attention_bias = bool(config.get("attention_bias", False))
        if arch == "Qwen2MoeForCausalLM":  # q/k/v bias unless qkv_bias is false; never o_proj's
            is_qwen2, attention_bias = bool(config.get("qkv_bias", True)), False
        if arch in MLA_ARCHITECTURES and attention_bias:
            raise ValueError(f"model config: attention_bias true is not supported for {arch}; supported: false")
        if arch in MLA_ARCHITECTURES and config.get("mlp_bias"):
            raise ValueError(f"model config: mlp_bias true is not supported for {arch}; supported: false")
        gemma: dict[str, Any] = {}
        if is_gemma:
            if config.get("use_bidirectional_attention"):
                raise ValueError("model config: use_bidirectional_attention is not supported; supported: false "
                                 "(causal decoding)")
            gemma = dict(
                gemma_norms=True,
                query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
                final_logit_softcapping=_positive_or_none(config, "final_logit_softcapping"),
                # transformers 5 does not apply attn_logit_softcapping to Gemma 3 (its checkpoints
                # set it to null); follow the oracle.
                attn_logit_softcapping=(_positive_or_none(config, "attn_logit_softcapping")
                                        if arch == "Gemma2ForCausalLM" else None),
            )
        return cls(
            model_dir=pathlib.Path(model_dir),
            architecture=arch,
            model_type=model_type,
            shape=shape,
            max_position_embeddings=max_pos,
            dtype=_dtype(config),
            eos_token_ids=frozenset(_ids(config.get("eos_token_id")) | _ids(generation.get("eos_token_id"))),
            bos_token_id=_first(generation.get("bos_token_id", config.get("bos_token_id"))),
            pad_token_id=_first(generation.get("pad_token_id", config.get("pad_token_id"))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or (attention_bias and not is_mistral),
            o_proj_bias=attention_bias and not (is_qwen2 or is_mistral),
            mlp_bias=arch == "LlamaForCausalLM" and bool(config.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=window,
            layer_types=layer_types,
            local_rope=local_rope,
            hidden_act=_ACTIVATIONS[act],
            **gemma,
            routing=routing,
            rope_interleave=(arch == "DeepseekV2ForCausalLM"
                             or (arch == "DeepseekV3ForCausalLM" and bool(config.get("rope_interleave", True)))),
            hf_config=config,
        )

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def rotary_dim(self) -> int:
        """Dimensions the rotary embedding turns: the head, or MLA's qk_rope_head_dim."""
        return self.shape.mla.qk_rope_head_dim if self.shape.mla is not None else self.shape.head_dim

    def attention_scale(self) -> float:
        """The softmax scale: head_dim ** -0.5; for MLA (nope + rope dims) ** -0.5 times yarn's
        mscale(factor, mscale_all_dim) squared, as DeepSeek (and transformers) apply it."""
        mla = self.shape.mla
        if mla is None:
            return self.head_dim**-0.5
        scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
        params = self.rope_scaling or {}
        m_all = params.get("mscale_all_dim")
        if params and m_all:
            factor = float(params["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer`, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def all_layers_sliding(self) -> bool:
        """Every layer attends within the window: KV behind it is never read again by anyone."""
        return self.sliding_window is not None and all(t == SLIDING_ATTENTION for t in self.layer_types)

    def default_max_model_len(self) -> int:
        """The longest context this model supports: its position limit (a sliding window does
        not cap it: sliding-window layers attend within the window at any length)."""
        return self.max_position_embeddings

    def resolve_max_model_len(self, max_model_len: int | None) -> int:
        """`max_model_len` checked against the model (None gives `default_max_model_len()`)."""
        limit = self.default_max_model_len()
        if max_model_len is None:
            return limit
        max_model_len = int(max_model_len)
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{self.max_position_embeddings}"
            )
        return max_model_len


def _rope(config: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes rope_parameters (theta included); 4.x writes rope_theta + rope_scaling.
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"model config: rope_parameters must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("model config: per-layer-type rope_parameters are not supported")
    params = dict(params)
    theta = float(params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"model config: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("model config: partial_rotary_factor != 1.0 is not supported")
    if head_dim % 2:
        raise ValueError(f"model config: head_dim must be even for rotary embeddings, got {head_dim}")
    if rope_type == "default":
        return theta, None
    required = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor")}[rope_type]
    for key in required:
        if params.get(key) is None:
            raise ValueError(f"model config: rope scaling {rope_type!r} needs {key!r}")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings") or config.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _positive_or_none(config: dict[str, Any], name: str) -> float | None:
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model config: {name} must be a positive number or null, got {value!r}")
    return float(value)


def _rope_per_layer_type(arch: str, config: dict[str, Any], head_dim: int
                         ) -> tuple[float, dict[str, Any] | None, tuple[float, dict[str, Any] | None] | None]:
    """(global theta, global scaling, local (theta, scaling) or None).

    Gemma 3 has two RoPEs: global layers use `rope_theta` (default 1e6) with `rope_scaling`, local
    layers `rope_local_base_freq` (default 1e4) without scaling; transformers 5 writes both as
    per-layer-type `rope_parameters` {"full_attention": {...}, "sliding_attention": {...}}.
    """
    params = config.get("rope_parameters")
    per_type = isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values())
    if arch != "Gemma3ForCausalLM":
        if per_type:
            unknown = sorted(set(params) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"model config: rope_parameters key {unknown[0]!r} is not supported; "
                                 f"supported: {', '.join(LAYER_TYPES)}")
            if len({json.dumps(v, sort_keys=True) for v in params.values()}) > 1:
                raise ValueError(f"model config: per-layer-type rope_parameters are only supported for "
                                 f"Gemma3ForCausalLM, not {arch}")
            config = {**config, "rope_parameters": next(iter(params.values()))}
        theta, scaling = _rope(config, head_dim)
        return theta, scaling, None
    if per_type:
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"model config: rope_parameters key {unknown[0]!r} is not supported; "
                             f"supported: {', '.join(LAYER_TYPES)}")
        global_params = params.get(FULL_ATTENTION) or {"rope_type": "default"}
        local_params = params.get(SLIDING_ATTENTION) or {"rope_type": "default"}
        global_params = {"rope_theta": 1_000_000.0, **global_params}
        local_params = {"rope_theta": 10_000.0, **local_params}
    else:
        scaling = config.get("rope_scaling") or (params if isinstance(params, dict) else None) or {}
        global_params = {"rope_theta": config.get("rope_theta") or 1_000_000.0, **scaling}
        local_params = {"rope_theta": config.get("rope_local_base_freq") or 10_000.0}
    bare = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    theta, scaling = _rope({**bare, "rope_parameters": global_params}, head_dim)
    local_theta, local_scaling = _rope({**bare, "rope_parameters": local_params}, head_dim)
    return theta, scaling, (local_theta, local_scaling)


_TOPK_METHODS = {"DeepseekV2ForCausalLM": ("greedy", "group_limited_greedy"),
                 "DeepseekV3ForCausalLM": ("noaux_tc",)}
_SCORING = {"DeepseekV2ForCausalLM": "softmax", "DeepseekV3ForCausalLM": "sigmoid"}


def _routing(arch: str, config: dict[str, Any], shape: ModelShape) -> RoutingConfig:
    """The routing each architecture's transformers implementation applies; anything else in the
    config is refused with the field and the values this runtime supports."""
    if arch == "MixtralForCausalLM":
        return RoutingConfig(norm_topk_prob=True, float32_weights=True)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return RoutingConfig(norm_topk_prob=bool(config.get("norm_topk_prob", False)))
    scoring = config.get("scoring_func") or _SCORING[arch]
    if scoring != _SCORING[arch]:
        raise ValueError(f"model config: scoring_func {scoring!r} is not supported for {arch}; "
                         f"supported: {_SCORING[arch]!r}")
    method = config.get("topk_method") or _TOPK_METHODS[arch][0]
    if method not in _TOPK_METHODS[arch]:
        raise ValueError(f"model config: topk_method {method!r} is not supported for {arch}; "
                         f"supported: {', '.join(repr(m) for m in _TOPK_METHODS[arch])}")
    norm = bool(config.get("norm_topk_prob", False))
    if arch == "DeepseekV2ForCausalLM" and norm:
        # transformers' DeepSeek-V2 ignores it while DeepSeek's own code renormalizes; released V2
        # checkpoints all set false, so refuse rather than pick one silently.
        raise ValueError(f"model config: norm_topk_prob true is not supported for {arch}; supported: false")
    experts = shape.moe.num_experts if shape.moe is not None else 0
    grouped = method != "greedy"
    n_group = int(config.get("n_group") or 1) if grouped else 1
    topk_group = int(config.get("topk_group") or 1) if grouped else 1
    if grouped:
        if n_group < 1 or experts % n_group:
            raise ValueError(f"model config: n_group {n_group} must divide the {experts} routed experts")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"model config: topk_group {topk_group} must be in [1, n_group {n_group}]")
        per_group = experts // n_group
        if method == "noaux_tc" and per_group < 2:
            raise ValueError(f"model config: noaux_tc routing ranks groups by their two best experts; "
                             f"n_group {n_group} leaves {per_group} per group")
        if shape.moe is not None and shape.moe.experts_per_token > topk_group * per_group:
            raise ValueError(f"model config: num_experts_per_tok {shape.moe.experts_per_token} exceeds the "
                             f"{topk_group * per_group} experts in topk_group {topk_group} groups")
    return RoutingConfig(scoring=scoring, topk_method=method, norm_topk_prob=norm,
                         routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
                         n_group=n_group, topk_group=topk_group, float32_logits=True, float32_weights=True)


def _dtype(config: dict[str, Any]) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    name = str(name).removeprefix("torch.")
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"model config: dtype {name!r} is not supported; supported: {sorted(_DTYPES)}") from None


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value}
    return {int(value)}


def _first(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def rope_inv_freq_and_scale(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32 [rotary_dim / 2]) and the cos/sin multiplier, following
    transformers' RoPE initialisers for each supported rope type."""
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if cfg.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        # NTK-aware scaling only changes the frequencies past max_position_embeddings, which
        # resolve_max_model_len never allows, so within range it is plain RoPE (as in transformers).
        return inv_freq, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(cfg, scaling, factor)
    raise ValueError(f"rope type {kind!r} is not supported")  # unreachable: checked in _rope


def _yarn(cfg: ModelConfig, p: dict[str, Any], factor: float) -> tuple[torch.Tensor, float]:
    dim, base = cfg.rotary_dim, cfg.rope_theta
    orig = float(p["original_max_position_embeddings"])

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (mscale_of(factor, m) / mscale_of(factor, m_all)) if (m and m_all) else mscale_of(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_cos_sin_cache(cfg: ModelConfig, max_positions: int | None = None,
                       device: torch.device | str | None = None, *, local: bool = False) -> torch.Tensor:
    """float32 [max_positions, rotary_dim]: cos half then sin half, scaling folded in. With `local`,
    the sliding-window layers' RoPE (it differs from the global one in Gemma 3 only)."""
    n = max_positions or cfg.max_position_embeddings
    if local and cfg.local_rope is not None:
        cfg = replace(cfg, rope_theta=cfg.local_rope[0], rope_scaling=cfg.local_rope[1])
    inv_freq, mult = rope_inv_freq_and_scale(cfg)
    freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos() * mult, freqs.sin() * mult), dim=-1)
    return cache.to(device) if device is not None else cache
