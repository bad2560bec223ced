"""What the runtime needs to know about a Hugging Face model directory, read once and checked.

Reads config.json (and generation_config.json for extra EOS ids) without importing transformers
or torch, so every unsupported architecture or option fails here, with a message naming what is
supported, before any weight is loaded; and the operator and the agent can use it too. The
fields that decide memory and sharding are read once, into `ModelShape` (kvserve.runtime.capacity),
and ModelConfig builds on that shape. Tensors derived from the config (RoPE tables) are in
kvserve.runtime.models.rope.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvserve.runtime.architectures import (
    MLA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    attention_biases,
    standard_config,
)
from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.layer_types import FULL_ATTENTION, GEMMA_ARCHITECTURES, LAYER_TYPES, SLIDING_ATTENTION

if TYPE_CHECKING:
    import torch

__all__ = ["MLA_ARCHITECTURES", "MOE_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "RoutingConfig"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
# Activations of the gated MLP, by config.json name: SiLU (Llama family) or tanh-approximated GELU.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

# config.json's dtype spellings -> torch's names.
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


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
    # Sizes, layer kinds (sliding windows), q/k/v bias, tied embeddings, MoE and MLA shapes.
    shape: ModelShape
    max_position_embeddings: int
    dtype_name: str  # the checkpoint's dtype, as torch names it ("bfloat16")
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    pad_token_id: int | None
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; otherwise the scaling parameters with "rope_type" normalized in.
    rope_scaling: dict[str, Any] | None
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # RoPE of the sliding-window layers when it differs from the global one (Gemma 3's local
    # base frequency): (theta, scaling), else None.
    local_rope: tuple[float, dict[str, Any] | None] | None = None
    # "silu" or "gelu_tanh" (the gated MLP's activation); "gelu" for MPT's ungated MLP.
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
    # ALiBi (MPT): the largest slope exponent (slopes 2^-(i * max / H')), None for RoPE models.
    # Such models also norm with LayerNorm (weight only), run a plain (ungated) MLP, and may fix
    # the softmax scale and clamp q/k/v (clip_qkv).
    alibi_bias_max: float | None = None
    softmax_scale: float | None = None
    clip_qkv: float | None = None
    # BLOOM: its LayerNorms have biases, and the embeddings are LayerNorm-ed before the first layer.
    norm_bias: bool = False
    embed_norm: bool = False
    # Falcon scales its ALiBi biases with the scores (head_dim ** -0.5); MPT and BLOOM add them after.
    alibi_scale: float = 1.0
    # Baichuan-13B: ALiBi attention inside the Llama layer (RMSNorms, SiLU-gated MLP), not MPT's.
    alibi_llama_layers: bool = False
    # Falcon-7B/40B (RoPE): attention and MLP side by side on the same normed input (two LayerNorms,
    # one per branch, with falcon_two_norms: Falcon-40B's new decoder architecture).
    falcon_parallel: bool = False
    falcon_two_norms: bool = False

    @classmethod
    def from_pretrained(cls, model_dir: str | pathlib.Path) -> ModelConfig:
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
                  model_dir: str | pathlib.Path = ".") -> ModelConfig:
        generation = generation or {}
        config = standard_config(config)
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
        alibi = (_alibi(config) if arch == "MptForCausalLM" else _bloom(config) if arch == "BloomForCausalLM"
                 else _falcon(config, shape.head_dim) if arch == "FalconForCausalLM" else {})
        if arch == "BaichuanForCausalLM" and config.get("baichuan_alibi"):
            # Baichuan-13B (its config has no max_position_embeddings; Baichuan-7B's RoPE one does)
            alibi = {"alibi_bias_max": 8.0, "alibi_llama_layers": True}
        elif alibi:  # MPT's MLP is fixed: exact GELU, ungated (models/mpt.py); config.json names none
            act = "silu"
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

        rotary_dim = shape.mla.qk_rope_head_dim if shape.mla is not None else shape.head_dim
        rope_theta, rope_scaling, local_rope = _rope_per_layer_type(arch, config, rotary_dim)
        max_pos = int(config.get("max_position_embeddings") or 2048)

        if arch in MLA_ARCHITECTURES and config.get("attention_bias"):
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
            dtype_name=_dtype(config),
            eos_token_ids=frozenset(_ids(config.get("eos_token_id")) | _ids(generation.get("eos_token_id"))),
            bos_token_id=_first(generation.get("bos_token_id", config.get("bos_token_id"))),
            pad_token_id=_first(generation.get("pad_token_id", config.get("pad_token_id"))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            o_proj_bias=attention_biases(arch, config)[1],
            mlp_bias=((arch == "LlamaForCausalLM" and bool(config.get("mlp_bias", False))) or arch == "BloomForCausalLM"
                      or (arch == "FalconForCausalLM" and bool(config.get("bias", False)))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            local_rope=local_rope,
            hidden_act=(("gelu_tanh" if arch == "BloomForCausalLM" else "gelu")
                        if alibi and not alibi.get("alibi_llama_layers") else _ACTIVATIONS[act]),
            **gemma,
            routing=routing,
            **alibi,
            rope_interleave=(arch == "DeepseekV2ForCausalLM"
                             or (arch == "DeepseekV3ForCausalLM" and bool(config.get("rope_interleave", True)))),
            hf_config=config,
        )

    @property
    def layer_norms(self) -> bool:
        """LayerNorm layers with an ungated GELU MLP (models/mpt.py, models/falcon.py), not the
        Llama layer's RMSNorms: MPT, BLOOM, both Falcons."""
        return (self.alibi_bias_max is not None and not self.alibi_llama_layers) or self.falcon_parallel

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype as a torch dtype (only the runtime asks, and it has torch)."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def tie_word_embeddings(self) -> bool:
        return self.shape.tie_word_embeddings

    @property
    def qkv_bias(self) -> bool:
        return self.shape.attention_bias

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (a query at position i sees keys
        i - sliding_window < j <= i, as in transformers), or None when no layer has one."""
        return self.shape.sliding_window

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Per layer: "full_attention" or "sliding_attention" (empty means every layer is full)."""
        return self.shape.layer_types

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
        if self.softmax_scale is not None:
            return self.softmax_scale
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
        return self.shape.layer_window(layer)

    @property
    def all_layers_sliding(self) -> bool:
        """Every layer attends within the window: KV behind it is never read again by anyone."""
        return self.shape.all_layers_sliding

    def default_max_model_len(self) -> int:
        """The longest context this model supports: its position limit (a sliding window does
        not cap it: sliding-window layers attend within the window at any length)."""
        return self.max_position_embeddings

    def for_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config for an engine serving contexts up to `max_model_len`: LongRoPE's short or
        long factors (long when max_model_len exceeds original_max_position_embeddings)."""
        scaling = self.rope_scaling
        if scaling is None or scaling.get("rope_type") != "longrope":
            return self
        long = max_model_len > scaling["original_max_position_embeddings"]
        return self if long == scaling["long"] else replace(self, rope_scaling={**scaling, "long": long})

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
                "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ()}[rope_type]
    for key in required:
        if params.get(key) is None:
            raise ValueError(f"model config: rope scaling {rope_type!r} needs {key!r}")
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings") or config.get("max_position_embeddings"))
    if rope_type == "longrope":
        return theta, _longrope(config, params, head_dim)
    return theta, {"rope_type": rope_type, **params}


def _longrope(config: dict[str, Any], params: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE: per-frequency divisors for short contexts and for long ones, and a
    cos/sin multiplier (`attention_factor`, default sqrt(1 + ln(factor) / ln(original)) with
    factor = max_position_embeddings / original). Which divisors apply is decided once, from the
    context the engine serves (`long`: max_model_len > original_max_position_embeddings, as vLLM
    does), so every cached key is rotated the same way; defaults to the model's full context."""
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("model config: rope scaling 'longrope' needs 'original_max_position_embeddings'")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"model config: original_max_position_embeddings must be a positive integer, not {original!r}")
    out: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": original}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if (not isinstance(values, (list, tuple)) or len(values) != head_dim // 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                           for v in values)):
            raise ValueError(f"model config: rope scaling 'longrope' needs {key!r}: {head_dim // 2} positive numbers "
                             f"(one per rotary frequency), got {values!r}"[:300])
        out[key] = tuple(float(v) for v in values)
    max_pos = int(config.get("max_position_embeddings") or 2048)
    factor = params.get("factor") or max_pos / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    out.update(factor=float(factor), attention_factor=float(attention_factor), long=max_pos > original)
    return out


def _alibi(config: dict[str, Any]) -> dict[str, Any]:
    """MPT's attn_config, checked: ALiBi on, no q/k LayerNorm, no biases (what transformers runs)."""
    attn = config.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise ValueError(f"model config: attn_config must be an object, got {attn!r}")
    if not attn.get("alibi", True):
        raise ValueError("model config: attn_config.alibi false (learned positions) is not supported; supported: true")
    if attn.get("qk_ln"):
        raise ValueError("model config: attn_config.qk_ln true is not supported; supported: false")
    if not config.get("no_bias", True):
        raise ValueError("model config: no_bias false is not supported for MptForCausalLM; supported: true")
    if int(config.get("expansion_ratio") or 4) != 4:  # transformers' MPT builds 4 x d_model whatever it says
        raise ValueError(f"model config: expansion_ratio {config.get('expansion_ratio')!r} is not supported; "
                         "supported: 4")
    if config.get("logit_scale") is not None:
        raise ValueError("model config: logit_scale is not supported for MptForCausalLM; supported: null")
    bias_max = attn.get("alibi_bias_max", 8)
    if bias_max != 8:  # every released MPT uses 8, and transformers' MPT applies 8 whatever the config says
        raise ValueError(f"model config: attn_config.alibi_bias_max {bias_max!r} is not supported; supported: 8")
    out: dict[str, Any] = {"alibi_bias_max": 8.0}
    for key, field_name in (("softmax_scale", "softmax_scale"), ("clip_qkv", "clip_qkv")):
        if attn.get(key) is not None:
            out[field_name] = _positive_or_none(attn, key)
    return out


def _bloom(config: dict[str, Any]) -> dict[str, Any]:
    """BLOOM: ALiBi with the slopes of MPT's formula at bias max 8 (the two agree for every head
    count), biased LayerNorms, a LayerNorm on the embeddings."""
    if config.get("apply_residual_connection_post_layernorm"):
        raise ValueError("model config: apply_residual_connection_post_layernorm true is not supported; "
                         "supported: false")
    return {"alibi_bias_max": 8.0, "norm_bias": True, "embed_norm": True}


def _falcon(config: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Falcon: the ALiBi variant (Falcon-RW: one KV head per head, attention then MLP) or the RoPE
    one with attention and MLP in parallel (Falcon-7B: multi-query, one LayerNorm; Falcon-40B's new
    decoder architecture: grouped KV heads, a LayerNorm per branch). Other combinations are refused
    by field."""
    if (config.get("activation") or "gelu") != "gelu":
        raise ValueError(f"model config: activation {config.get('activation')!r} is not supported; supported: 'gelu'")
    new_arch = bool(config.get("new_decoder_architecture", False))
    if not config.get("alibi", False):
        if not new_arch and not config.get("parallel_attn", True):
            raise ValueError("model config: parallel_attn false is not supported for FalconForCausalLM with rotary "
                             "embeddings (alibi false); supported: true, or alibi true (Falcon-RW)")
        lns = config.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)
        if lns not in (1, 2):
            raise ValueError(f"model config: num_ln_in_parallel_attn {lns!r} is not supported; supported: 1, 2")
        return {"norm_bias": True, "falcon_parallel": True, "falcon_two_norms": new_arch and lns == 2}
    for key, want in (("multi_query", False), ("parallel_attn", False), ("new_decoder_architecture", False)):
        if bool(config.get(key, not want)) != want:
            raise ValueError(f"model config: {key} {str(not want).lower()} is not supported for FalconForCausalLM "
                             f"with alibi true (Falcon-RW); supported: {str(want).lower()}")
    return {"alibi_bias_max": 8.0, "norm_bias": True, "alibi_scale": head_dim ** -0.5}


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


def _dtype(config: dict[str, Any]) -> str:
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
