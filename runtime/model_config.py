"""What the runtime needs to know about a Hugging Face model directory, read once and checked.

Reads config.json (and generation_config.json for extra EOS ids) without importing transformers,
so every unsupported architecture or option fails here, with a message naming what is supported,
before any weight is loaded.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.runtime.capacity import ModelShape

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
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
    # The attention window when the config turns sliding-window attention on, else None. Only
    # full attention is implemented, so max_model_len must stay within the window.
    sliding_window: int | None = None
    # Mixture of experts: routing (shapes are in shape.moe); None for dense models.
    routing: RoutingConfig | None = None
    # MLA (shapes in shape.mla): DeepSeek's rotary dims come in interleaved pairs (V2 always;
    # V3 unless rope_interleave is false); the loader permutes them to rotate-half order.
    rope_interleave: bool = False
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_pretrained(cls, model_dir: str | pathlib.Path) -> "ModelConfig":
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
            raise ValueError(
                f"model architecture {architectures or config.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = config.get("model_type", "")
        shape = ModelShape.from_hf_config(config)

        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"model config: hidden_act {act!r} is not supported; supported: 'silu'")
        if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("model config: partial_rotary_factor != 1.0 is not supported")
        routing = _routing(arch, config, shape) if arch in MOE_ARCHITECTURES else None
        if arch in MLA_ARCHITECTURES and shape.mla is None:
            raise ValueError(f"model config: {arch} needs kv_lora_rank (multi-head latent attention)")
        if arch in MOE_ARCHITECTURES and shape.moe is None:
            raise ValueError(f"model config: {arch} needs a positive expert count "
                             f"(num_local_experts, num_experts or n_routed_experts)")

        rotary_dim = shape.mla.qk_rope_head_dim if shape.mla is not None else shape.head_dim
        rope_theta, rope_scaling = _rope(config, rotary_dim)
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_sliding_window(arch, config),
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

    def default_max_model_len(self) -> int:
        """The longest context this model supports here: its position limit, capped by the
        sliding window when one is configured (only full attention is implemented)."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
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
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's sliding_window {self.sliding_window}; "
                f"sliding-window attention is not supported, so max_model_len must be <= {self.sliding_window}"
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


def _sliding_window(arch: str, config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if window is None:
        return None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return int(window)
    if (arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
            and config.get("use_sliding_window")):
        layer_types = config.get("layer_types")
        if layer_types is None or "sliding_attention" in layer_types:
            return int(window)
    return None


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
                       device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [max_positions, rotary_dim]: cos half then sin half, scaling folded in."""
    n = max_positions or cfg.max_position_embeddings
    inv_freq, mult = rope_inv_freq_and_scale(cfg)
    freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos() * mult, freqs.sin() * mult), dim=-1)
    return cache.to(device) if device is not None else cache
