"""A GGUF file's metadata as the Hugging Face config that ModelConfig already understands.

llama.cpp names everything after the architecture (``llama.block_count``, ``qwen2.rope.freq_base``);
this module translates those keys into config.json's names, so a GGUF model goes through the same
ModelConfig checks (architecture, RoPE, heads vs tensor parallelism) as a Hugging Face directory.
It also says how each GGUF tensor name maps onto the checkpoint names CausalLM consumes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvserve.runtime.architectures import fused_parts
from kvserve.runtime.gguf.names import LAYER_RE, hf_names
from kvserve.runtime.gguf.reader import GGUFError, GGUFFile

# general.architecture -> (HF architecture, model_type, whether llama.cpp's converter permuted the
# rows of Q and K). The converter reorders LLaMA's Q/K rows from rotate-half pairs (i, i + d/2)
# into interleaved pairs (2i, 2i + 1) for ggml's RoPE; the other families keep Hugging Face's
# order. Mistral and Mixtral files say "llama" (one graph in llama.cpp; a file with experts is
# Mixtral); Mistral's sliding window is not in GGUF metadata (llama.cpp attends to everything).
# "deepseek2" holds DeepSeek V2 and V3 (V3: sigmoid gating).
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "mpt": ("MptForCausalLM", "mpt", False),
    "bloom": ("BloomForCausalLM", "bloom", False),
    "falcon": ("FalconForCausalLM", "falcon", False),
}
# ALiBi families: no RoPE keys. With Falcon: LayerNorms (attention.layer_norm_epsilon).
ALIBI = ("mpt", "bloom")
LAYER_NORM = (*ALIBI, "falcon")
GEMMA = ("gemma2", "gemma3")
# llama.cpp's ggml_expert_gating_func: 1 softmax, 2 sigmoid.
_GATING = {1: "softmax", 2: "sigmoid"}

# Tensors that carry no weight of their own here: RoPE frequency factors become part of the
# config (see rope_freqs; Phi-3's LongRoPE factors, one tensor per set).
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
CONFIG_TENSORS = (ROPE_FREQS, *LONGROPE_FACTORS.values())


def hf_config(gf: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, generation_config.json) equivalents built from the file's metadata."""
    arch = gf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {arch!r} in {gf.path} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    hf_arch, model_type, _ = ARCHITECTURES[arch]
    md = gf.metadata

    def get(key: str, default: Any = None, *, required: bool = False, kind: type = int) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            if required:
                raise GGUFError(gf.path, f"metadata key {full!r}", "is missing")
            return default
        return _checked(gf, full, md[full], kind)

    heads = get("attention.head_count", required=True)
    kv_heads = get("attention.head_count_kv", heads)
    hidden = get("embedding_length", required=True)
    layers = get("block_count", required=True)
    present = {int(m.group(1)) for name in gf.tensors if (m := LAYER_RE.match(name))}
    if present and max(present) >= layers:
        raise GGUFError(gf.path, f"metadata key '{arch}.block_count'",
                        f"{layers} layers, but the file has tensors of layer {max(present)}")
    if len(present) < layers:  # also bounds what the config allocates per layer by the file's size
        raise GGUFError(gf.path, f"metadata key '{arch}.block_count'",
                        f"{layers} layers, but the file has tensors for {len(present)}")
    embed = gf.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise GGUFError(gf.path, "tensor 'token_embd.weight'", "missing (or not a matrix)")
    vocab = embed.shape[0]
    names = set(gf.tensors)
    experts = get("expert_count", 0)
    if arch == "llama" and experts:
        hf_arch, model_type = "MixtralForCausalLM", "mixtral"
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": (get("attention.layer_norm_epsilon", 1e-5, kind=float) if arch in LAYER_NORM
                         else get("attention.layer_norm_rms_epsilon", 1e-6, kind=float)),
        "rope_theta": get("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0, kind=float),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": _checkpoint_dtype(gf),
    }
    if arch == "deepseek2":
        config.update(_deepseek2(get, gf, config, experts))
    else:
        head_dim = get("attention.key_length", hidden // heads)
        if head_dim < 1:
            raise GGUFError(gf.path, f"metadata key '{arch}.embedding_length'",
                            f"{hidden} is smaller than the head count {heads}")
        value_dim = get("attention.value_length", head_dim)
        if value_dim != head_dim:
            raise GGUFError(gf.path, f"metadata key '{arch}.attention.value_length'",
                            f"{value_dim} differs from key_length {head_dim}; not supported")
        rope_dim = get("rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise GGUFError(gf.path, f"metadata key '{arch}.rope.dimension_count'",
                            f"{rope_dim} != head dim {head_dim} (partial rotary embeddings are not supported)")
        config["head_dim"] = head_dim
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    if arch in GEMMA:
        config.update(_gemma(get, arch, config))
    if arch in ALIBI:
        config.update(_alibi(get, gf, arch, heads, kv_heads, names))
    if arch == "falcon":
        config.update(_falcon(gf, heads, kv_heads, names))
    if arch == "phi3":
        if any(n in names for n in LONGROPE_FACTORS.values()):
            config["rope_scaling"] = _longrope(get, gf, config["head_dim"])
            config["original_max_position_embeddings"] = config["rope_scaling"]["original_max_position_embeddings"]
        config["sliding_window"] = get("attention.sliding_window")
    if experts and arch != "deepseek2":
        used = get("expert_used_count", required=True)
        if arch == "llama":
            config.update(num_local_experts=experts, num_experts_per_tok=used, sliding_window=None)
        else:
            # llama.cpp renormalizes the chosen experts' weights for Qwen3-MoE and never for
            # Qwen2-MoE (the released checkpoints' norm_topk_prob); the files do not say.
            config.update(num_experts=experts, num_experts_per_tok=used,
                          moe_intermediate_size=get("expert_feed_forward_length", required=True),
                          norm_topk_prob=arch == "qwen3moe", decoder_sparse_step=1, mlp_only_layers=[],
                          use_sliding_window=False)
            if arch == "qwen2moe":
                config["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length", 0)
                config["qkv_bias"] = "blk.0.attn_q.bias" in names
    elif arch in ("qwen2moe", "qwen3moe"):
        raise GGUFError(gf.path, f"metadata key '{arch}.expert_count'", "is missing")
    # The weight format: every tensor's type, from which the gguf linear method picks a kernel
    # per layer (kvserve.runtime.models.quantization.gguf).
    config["quantization_config"] = {
        "quant_method": "gguf",
        "tensor_types": {part: info.type_name for name, info in gf.tensors.items()
                         for hf in hf_names(name, arch, len(info.shape), experts)
                         for part in fused_parts(hf_arch, hf) or (hf,)},
    }
    scaling = _rope_scaling(get, gf.path, arch) if "rope_scaling" not in config else None
    if scaling is not None:
        if arch == "deepseek2" and scaling["rope_type"] == "yarn":
            # The converter stores DeepSeek's mscale_all_dim as 0.1 * mscale_all_dim (llama.cpp's
            # legacy yarn_log_multiplier); released checkpoints set mscale equal to it.
            log_mul = get("rope.scaling.yarn_log_multiplier", kind=float)
            if log_mul is not None:
                scaling["mscale_all_dim"] = scaling["mscale"] = log_mul / 0.1
        config["rope_scaling"] = scaling
    generation: dict[str, Any] = {}
    eos = [_checked(gf, k, md[k], _TOKEN_ID) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                       "tokenizer.ggml.eom_token_id") if k in md]
    if eos:
        generation["eos_token_id"] = sorted(set(eos))
    for key, field in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                       ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if key in md:
            generation[field] = _checked(gf, key, md[key], _TOKEN_ID)
    return config, generation


def _gemma(get, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3: GELU(tanh), tied embeddings, local layers in a sliding window (every second
    layer global in Gemma 2, every sixth in Gemma 3, as llama.cpp fixes them), soft-capping (Gemma
    2), Gemma 3's local RoPE base. GGUF has no query_pre_attn_scalar: llama.cpp scales by
    head_dim ** -0.5, except the 27B models (46 layers of Gemma 2, 62 of Gemma 3), which scale by
    (hidden / heads) ** -0.5, their checkpoints' query_pre_attn_scalar."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    big = layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
        "sliding_window": get("attention.sliding_window", required=True),
        "final_logit_softcapping": get("final_logit_softcapping", kind=float),
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = get("attn_logit_softcapping", kind=float)
    else:
        out["rope_local_base_freq"] = get("rope.freq_base_swa", 10000.0, kind=float)
        out["sliding_window_pattern"] = 6
    return out


def _alibi(get, gf: GGUFFile, arch: str, heads: int, kv_heads: int, names: set[str]) -> dict[str, Any]:
    """MPT / BLOOM: the config.json keys their families read (models/mpt.py). The slopes' bias max
    is MPT's attention.max_alibi_bias (0: learned positions, which kvserve refuses); llama.cpp fixes
    BLOOM's at 8. What kvserve's MPT does not run (grouped KV heads, biases, q/k LayerNorm, learned
    positions) comes through as the config keys ModelConfig refuses by name."""
    if kv_heads != heads:
        raise GGUFError(gf.path, f"metadata key '{arch}.attention.head_count_kv'",
                        f"{kv_heads} differs from head_count {heads}; {arch} is served multi-head only")
    hidden, ffn = get("embedding_length"), get("feed_forward_length")
    if ffn != 4 * hidden:  # both families' MLP is 4 x hidden whatever their config says
        raise GGUFError(gf.path, f"metadata key '{arch}.feed_forward_length'",
                        f"{ffn} is not 4 x embedding_length ({4 * hidden}); {arch}'s MLP is 4 x hidden")
    if arch == "bloom":
        return {}
    bias_max = get("attention.max_alibi_bias", 8.0, kind=_SCALE)
    attn: dict[str, Any] = {"alibi": bias_max > 0 and "position_embd.weight" not in names,
                            "alibi_bias_max": bias_max or 8.0, "qk_ln": "blk.0.attn_q_norm.weight" in names}
    clip = get("attention.clamp_kqv", kind=float)
    if clip is not None:
        attn["clip_qkv"] = clip
    return {"attn_config": attn, "no_bias": "blk.0.attn_qkv.bias" not in names, "expansion_ratio": 4}


def _longrope(get, gf: GGUFFile, head_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp's converter stores it: the short and long per-frequency
    factors as F32 tensors rope_factors_short / rope_factors_long, the pretraining context as
    rope.scaling.original_context_length and the cos/sin multiplier as rope.scaling.attn_factor
    (no rope.scaling.type). ModelConfig checks the rest, as for a config.json."""
    out: dict[str, Any] = {"rope_type": "longrope",
                           "original_max_position_embeddings": get("rope.scaling.original_context_length",
                                                                   required=True)}
    for key, name in LONGROPE_FACTORS.items():
        info = gf.tensors.get(name)
        if info is None or info.type_name != "F32" or info.shape != (head_dim // 2,):
            raise GGUFError(gf.path, f"tensor {name!r}", f"must be F32 of shape ({head_dim // 2},) (head_dim / 2), "
                                                         f"not {None if info is None else (info.type_name, info.shape)}")
        out[key] = [float(v) for v in np.asarray(gf.raw(name)).view(np.float32)]
    attn_factor = get("rope.scaling.attn_factor", kind=float)
    if attn_factor is not None:
        out["attention_factor"] = attn_factor
    return out


def _falcon(gf: GGUFFile, heads: int, kv_heads: int, names: set[str]) -> dict[str, Any]:
    """llama.cpp's Falcon graph: rotary embeddings, attention and MLP in parallel, one LayerNorm
    (Falcon-7B, multi-query) or one per branch (attn_norm_2: Falcon-40B's new decoder architecture,
    grouped KV heads). Its converter writes no flag for either; the tensors and head counts say."""
    if heads % kv_heads:
        raise GGUFError(gf.path, "metadata key 'falcon.attention.head_count_kv'",
                        f"{kv_heads} does not divide head_count {heads}")
    two_norms = "blk.0.attn_norm_2.weight" in names
    new_arch = two_norms or 1 < kv_heads < heads
    return {"alibi": False, "parallel_attn": True, "new_decoder_architecture": new_arch,
            "multi_query": kv_heads == 1, "num_kv_heads": kv_heads, "num_ln_in_parallel_attn": 2 if two_norms else 1,
            "bias": "blk.0.attn_qkv.bias" in names}


def _deepseek2(get, gf: GGUFFile, config: dict[str, Any], experts: int) -> dict[str, Any]:
    """DeepSeek V2/V3 (MLA, shared experts, leading dense layers). The converter writes MLA as
    MQA over the latent (key_length = kv_lora_rank + rope dims, one KV head) and the per-head
    sizes under key_length_mla / value_length_mla; older files give them as key/value_length."""
    arch = "deepseek2"
    kv_lora = get("attention.kv_lora_rank", required=True)
    rope = get("rope.dimension_count", required=True)
    mla_keys = f"{arch}.attention.key_length_mla" in gf.metadata
    qk = get("attention.key_length_mla" if mla_keys else "attention.key_length", required=True)
    v = get("attention.value_length_mla" if mla_keys else "attention.value_length", required=True)
    if qk <= rope:
        raise GGUFError(gf.path, f"metadata key '{arch}.rope.dimension_count'",
                        f"{rope} leaves no non-rotary query dims of the {qk} per head")
    if not experts:
        raise GGUFError(gf.path, f"metadata key '{arch}.expert_count'", "is missing")
    # Files without the key: softmax (DeepSeek V2's, as llama.cpp assumes), unless the file has
    # V3's routing bias (a V3 converted from a config.json that left scoring_func at its default).
    gating = get("expert_gating_func", 2 if any(n.endswith(".exp_probs_b.bias") for n in gf.tensors) else 1)
    if gating not in _GATING:
        raise GGUFError(gf.path, f"metadata key '{arch}.expert_gating_func'",
                        f"{gating} is not supported; supported: 1 (softmax), 2 (sigmoid)")
    groups = get("expert_group_count", 1)
    used_groups = get("expert_group_used_count", groups)
    norm_key = f"{arch}.expert_weights_norm"
    norm = gf.metadata.get(norm_key, False)
    if not isinstance(norm, (bool, np.bool_)):
        raise GGUFError(gf.path, f"metadata key {norm_key!r}", f"must be a boolean, not {norm!r}")
    v3 = _GATING[gating] == "sigmoid"
    out: dict[str, Any] = {
        "num_key_value_heads": config["num_attention_heads"],  # the MQA view is llama.cpp's
        "q_lora_rank": get("attention.q_lora_rank"),
        "kv_lora_rank": kv_lora,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk - rope,
        "v_head_dim": v,
        "n_routed_experts": experts,
        "num_experts_per_tok": get("expert_used_count", required=True),
        "moe_intermediate_size": get("expert_feed_forward_length", required=True),
        "n_shared_experts": get("expert_shared_count", 0),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "routed_scaling_factor": get("expert_weights_scale", 1.0, kind=float),
        "norm_topk_prob": bool(norm),
        "scoring_func": _GATING[gating],
        "n_group": groups,
        "topk_group": used_groups,
        # Rotary rows are de-interleaved by the GGUF loader itself (kvserve.runtime.gguf.names).
        "rope_interleave": False,
    }
    if v3:
        config["architectures"], config["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
        out["topk_method"] = "noaux_tc"
    else:
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    return out


_TOKEN_ID = "token id"
_SCALE = "scale"  # a float that may be 0 (llama.cpp writes rope.scaling.factor 0 for "none")
# Sizes and counts are uint32 in every file llama.cpp writes; anything larger is corrupt.
_MAX_SIZE = 2**32 - 1


def _checked(gf: GGUFFile, key: str, value: Any, kind: Any) -> Any:
    """A metadata value of the type and range the config needs, or a GGUFError naming the key:
    sizes and counts positive integers, token ids non-negative ones, floats finite and positive,
    strings strings (a per-layer array is named as such: llama.cpp allows some, kvserve does not)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    field = f"metadata key {key!r}"
    if isinstance(value, (np.ndarray, list)) or type(value).__name__.startswith("Skipped"):
        raise GGUFError(gf.path, field, "is an array (a value per layer?); kvserve needs a single value")
    if kind is str:
        if not isinstance(value, str):
            raise GGUFError(gf.path, field, f"must be a string, not {value!r}")
        return value
    if kind in (float, _SCALE):
        number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not number or not (value >= 0 if kind == _SCALE else value > 0):
            raise GGUFError(gf.path, field, f"must be a finite {'non-negative' if kind == _SCALE else 'positive'} "
                                            f"number, not {value!r}")
        return float(value)
    low = 0 if kind == _TOKEN_ID else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _MAX_SIZE:
        raise GGUFError(gf.path, field, f"must be an integer in [{low}, {_MAX_SIZE}], not {value!r}")
    return value


def _rope_scaling(get, path, arch: str) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", kind=str)
    factor = get("rope.scaling.factor", kind=_SCALE)
    if kind is None and get("rope.scale_linear", kind=_SCALE) is not None:  # older files
        kind, factor = "linear", get("rope.scale_linear", kind=_SCALE)
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = get("rope.scaling.original_context_length")
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if get(key, kind=float) is not None:
                out[name] = get(key, kind=float)
        return out
    raise GGUFError(path, f"metadata key '{arch}.rope.scaling.type'",
                    f"{kind!r} is not supported; supported: none, linear, yarn")


def _checkpoint_dtype(gf: GGUFFile) -> str:
    """The precision the file's float weights were written in (the compute dtype "auto" picks
    on a GPU): its 16-bit type if it has one, float32 for an all-F32 file, else float16 (what
    llama.cpp computes quantized matmuls against)."""
    types = {info.type_name for info in gf.tensors.values() if len(info.shape) > 1}
    if "BF16" in types:
        return "bfloat16"
    if types == {"F32"}:
        return "float32"
    return "float16"
