"""Which model families kvserve runs, and the per-family rules that more than one reader needs.

Pure (no torch): the runtime's ModelConfig and the capacity model that the operator imports both
take their answers from here, so they agree on a config they both read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
    "Phi3ForCausalLM",
    "MptForCausalLM",
    "BloomForCausalLM",
    "FalconForCausalLM",
    "BaichuanForCausalLM",
)
# Position information from ALiBi biases instead of rotary embeddings (Falcon: its ALiBi variant).
ALIBI_ARCHITECTURES = ("MptForCausalLM", "BloomForCausalLM", "FalconForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_MISTRAL_BIAS_RULE = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "MptForCausalLM")

# A config written by hand (an operator spec's model.config) may give only model_type.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM", "phi3": "Phi3ForCausalLM",
                  "mpt": "MptForCausalLM", "bloom": "BloomForCausalLM", "falcon": "FalconForCausalLM",
                  "baichuan": "BaichuanForCausalLM"}

# Checkpoint tensors that hold several projections stacked by rows (Phi-3's qkv_proj and
# gate_up_proj): suffix -> the parts, in row order. The loader splits them (part sizes from
# fused_part_rows), so the model keeps one layout for every family.
_FUSED = {"Phi3ForCausalLM": {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                             "self_attn.v_proj.weight"),
                              "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")},
          "MptForCausalLM": {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                            "self_attn.v_proj.weight")},
          # BLOOM's rows are per head [q_h; k_h; v_h] (fused_rows_per_head).
          "BloomForCausalLM": {f"self_attn.qkv_proj.{t}": tuple(f"self_attn.{p}_proj.{t}" for p in "qkv")
                               for t in ("weight", "bias")}}
_FUSED["FalconForCausalLM"] = _FUSED["BloomForCausalLM"]  # per KV group (fused_rows_per_head)
_FUSED["BaichuanForCausalLM"] = _FUSED["MptForCausalLM"]  # W_pack: q | k | v one after the other
_BAICHUAN_NAMES = ((".self_attn.W_pack.", ".self_attn.qkv_proj."),)
_BLOOM_NAMES = (("transformer.word_embeddings_layernorm.", "model.embed_layernorm."),
                ("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
                ("transformer.h.", "model.layers."), (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
                (".self_attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
                (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
# Falcon-40B's two parallel LayerNorms (ln_attn before attention, ln_mlp before the MLP).
_FALCON_NAMES = (*_BLOOM_NAMES, (".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".mlp_layernorm."))
# MPT's checkpoint names (transformer.blocks.N...) -> the names every other family uses.
_MPT_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
              ("transformer.blocks.", "model.layers."), (".norm_1.", ".input_layernorm."),
              (".norm_2.", ".post_attention_layernorm."), (".attn.Wqkv.", ".self_attn.qkv_proj."),
              (".attn.out_proj.", ".self_attn.o_proj."), (".ffn.up_proj.", ".mlp.up_proj."),
              (".ffn.down_proj.", ".mlp.down_proj."))


# Xiaomi's MiMo-7B is Qwen2's model (q/k/v biases included) plus MTP layers kept under
# model.mtp_layers.*, which only speculative decoding's mtp method reads (spec_decode/mtp.py).
_SAME_AS = {"MiMoForCausalLM": "Qwen2ForCausalLM"}


def architecture_of(config: Mapping[str, Any]) -> str:
    """The first supported entry of ``architectures``; else its first entry; else the family of
    ``model_type``; else ""."""
    listed = list(config.get("architectures") or [])
    supported = next((a for a in listed if a in SUPPORTED_ARCHITECTURES), None)
    if supported is not None:
        return supported
    if listed:
        return str(listed[0])
    return _BY_MODEL_TYPE.get(str(config.get("model_type") or ""), "")


def attention_biases(arch: str, config: Mapping[str, Any]) -> tuple[bool, bool]:
    """(q/k/v projections have a bias, o_proj has one), as transformers builds each family:
    Qwen2 always biases q/k/v and never o_proj; Qwen2-MoE the same unless ``qkv_bias`` is false;
    Mistral, Mixtral and Phi-3 ignore ``attention_bias``; the others bias all four with it."""
    attention_bias = bool(config.get("attention_bias", False))
    if arch == "Qwen2ForCausalLM":
        return True, False
    if arch == "BloomForCausalLM":
        return True, True
    if arch == "FalconForCausalLM":
        return bool(config.get("bias", False)), bool(config.get("bias", False))
    if arch == "Qwen2MoeForCausalLM":
        return bool(config.get("qkv_bias", True)), False
    if arch in _MISTRAL_BIAS_RULE:
        return False, False
    return attention_bias, attention_bias


def fused_parts(arch: str, name: str) -> tuple[str, ...] | None:
    """The checkpoint names a fused tensor `name` holds, in row order, or None if it is not one."""
    for suffix, parts in _FUSED.get(arch, {}).items():
        if name.endswith("." + suffix):
            prefix = name[: -len(suffix)]
            return tuple(prefix + part for part in parts)
    return None


def fused_part_rows(name: str, rows: int, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Rows of each part of a fused tensor of `rows` rows: q | k | v by heads, gate | up halves."""
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        return num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim
    return rows // 2, rows - rows // 2


def checkpoint_name(arch: str, name: str) -> str:
    """A checkpoint tensor's name in the layout every family shares (model.layers.N.self_attn...)."""
    for old, new in {"MptForCausalLM": _MPT_NAMES, "BloomForCausalLM": _BLOOM_NAMES,
                     "FalconForCausalLM": _FALCON_NAMES, "BaichuanForCausalLM": _BAICHUAN_NAMES}.get(arch, ()):
        name = name.replace(old, new)
    return name


def fused_rows_per_head(arch: str) -> bool:
    """Whether a fused q|k|v tensor holds its parts per KV group ([q_g...; k_g; v_g] for each KV
    head g: BLOOM and Falcon-RW one query head per group, Falcon-7B's multi-query one group,
    Falcon-40B's grouped KV) rather than one after the other."""
    return arch in ("BloomForCausalLM", "FalconForCausalLM")


def per_group_qkv_order(rows: int, num_heads: int, num_kv_heads: int) -> list[int]:
    """The row order that turns a fused q|k|v stored per KV group ([q_g...; k_g; v_g] for each
    group g, fused_rows_per_head) into q | k | v one after the other. The loader permutes the
    weights with it, and a LoRA adapter's B rows of the fused module need the same order."""
    group = num_heads // num_kv_heads
    head_dim = rows // (num_kv_heads * (group + 2))

    def rows_of(g: int, h: int) -> range:  # head h (q: 0..group-1, k: group, v: group + 1) of group g
        start = (g * (group + 2) + h) * head_dim
        return range(start, start + head_dim)

    q = [r for g in range(num_kv_heads) for h in range(group) for r in rows_of(g, h)]
    k = [r for g in range(num_kv_heads) for r in rows_of(g, group)]
    v = [r for g in range(num_kv_heads) for r in rows_of(g, group + 1)]
    return q + k + v


def standard_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with the standard names filled in where a family uses its own (MPT's d_model,
    n_heads, n_layers, expansion_ratio, max_seq_len, layer_norm_epsilon); others unchanged."""
    config = dict(config)
    if architecture_of(config) in _SAME_AS:  # a family that is another one's model plus extras
        config["architectures"] = [_SAME_AS[architecture_of(config)]]
    if architecture_of(config) == "MptForCausalLM":
        d = config.get("d_model")
        aliases = {"hidden_size": d, "num_attention_heads": config.get("n_heads"),
                   "num_hidden_layers": config.get("n_layers"),
                   "intermediate_size": None if d is None else int(config.get("expansion_ratio") or 4) * int(d),
                   "max_position_embeddings": config.get("max_seq_len"),
                   "rms_norm_eps": config.get("layer_norm_epsilon", 1e-5), "tie_word_embeddings": True}
        for key, value in aliases.items():
            if config.get(key) is None and value is not None:
                config[key] = value
        config["num_key_value_heads"] = config.get("num_attention_heads")  # MPT is multi-head
    elif architecture_of(config) == "BloomForCausalLM":
        d = config.get("hidden_size") or config.get("n_embed")
        aliases = {"hidden_size": d, "num_attention_heads": config.get("n_head"),
                   "num_hidden_layers": config.get("n_layer"), "intermediate_size": None if d is None else 4 * int(d),
                   "max_position_embeddings": config.get("seq_length") or 2048,
                   "rms_norm_eps": config.get("layer_norm_epsilon", 1e-5), "tie_word_embeddings": True}
        for key, value in aliases.items():
            if config.get(key) is None and value is not None:
                config[key] = value
        config["num_key_value_heads"] = config.get("num_attention_heads")
    elif architecture_of(config) == "FalconForCausalLM":
        d = config.get("hidden_size")
        if config.get("intermediate_size") is None and d is not None:
            config["intermediate_size"] = config.get("ffn_hidden_size") or 4 * int(d)
        config.setdefault("rms_norm_eps", config.get("layer_norm_epsilon", 1e-5))
        config.setdefault("tie_word_embeddings", True)
        # transformers' FalconAttention: num_kv_heads with the new decoder architecture (grouped)
        # or without multi-query (then one per head); one KV head for multi-query.
        heads = config.get("num_attention_heads") or config.get("n_head")
        if config.get("new_decoder_architecture") or not config.get("multi_query", True):
            config["num_key_value_heads"] = config.get("num_kv_heads") or heads
        else:
            config["num_key_value_heads"] = 1
    elif architecture_of(config) == "BaichuanForCausalLM":
        # Baichuan (remote code): multi-head; the 13B config names its context model_max_length.
        config["num_key_value_heads"] = config.get("num_attention_heads")
        if config.get("max_position_embeddings") is None and config.get("model_max_length") is not None:
            config["max_position_embeddings"] = config["model_max_length"]
            config["baichuan_alibi"] = True
    return config
