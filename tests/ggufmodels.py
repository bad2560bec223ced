"""Tiny GGUF files of random-weight models, written with the gguf package the way llama.cpp's
converter writes them: metadata under the architecture's keys, a byte-level BPE tokenizer with
its chat template, LLaMA's Q/K rows permuted for ggml's RoPE, Gemma's norms stored as 1 + w,
experts stacked into one [experts, rows, cols] tensor per projection, DeepSeek's kv_b_proj split
into attn_k_b (transposed per head) and attn_v_b, each matrix in the requested type (a matrix
whose rows do not split into the type's blocks falls back to Q8_0, else F16, as llama.cpp's
quantizer does). The layout was checked tensor by tensor against convert_hf_to_gguf.py.

`write_gguf(..., twin=dict)` also fills `twin` with the Hugging Face state dict the file encodes
(each weight replaced by the gguf package's dequantization of its blocks): transformers on that
state dict is the oracle for families whose GGUF files transformers cannot load.

The gguf package quantizes F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 itself; it has no quantizer
for the K types, so Q4_K, Q5_K and Q6_K blocks are packed here (a plain min/max quantizer, not
llama.cpp's search; the layout is what matters) and `k_blocks_reference` gives the values those
blocks encode, which tests check against the gguf package's dequantizer.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
QK_K = 256

_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
         "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
         "DeepseekV2ForCausalLM": "deepseek2", "DeepseekV3ForCausalLM": "deepseek2", "Phi3ForCausalLM": "phi3"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_MOE_LAYER = {
    **_LAYER,
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3: fused as in its checkpoints
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# Expert projections: transformers' per-expert names -> the stacked GGUF tensor.
_EXPERT_PART = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


# ---------------------------------------------------------------------------- K-quant packing


def _fp16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] six-bit scales and mins -> [n, 12] bytes, the inverse of get_scale_min_k4."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _affine_k(x: np.ndarray, levels: int):
    """Per 256-value super-block: fp16 d, dmin; per 32-value sub-block 6-bit scale and min;
    codes 0..levels-1. Returns (d, dmin, sc, m, codes) with x ~ d * sc * code - dmin * m."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / (levels - 1)
    d = _fp16(scale.max(-1) / 63).astype(np.float32)
    dmin = _fp16(-lo.min(-1) / 63).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63)
    m = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63)
    eff_scale = d[:, None] * sc
    eff_min = dmin[:, None] * m
    codes = np.clip(np.round((sub + eff_min[..., None]) / np.where(eff_scale == 0, 1, eff_scale)[..., None]),
                    0, levels - 1).astype(np.uint8)
    return d, dmin, sc, m, codes


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, codes = _affine_k(x, 16)
    n = d.shape[0]
    q = codes.reshape(n, 4, 2, 32)  # chunk c holds sub-blocks 2c (low nibbles) and 2c + 1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_fp16(d)[:, None].view(np.uint8), _fp16(dmin)[:, None].view(np.uint8),
                           _pack_scales_mins(sc, m), qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, codes = _affine_k(x, 32)
    n = d.shape[0]
    q = codes.reshape(n, 4, 2, 32)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    # Bit 2c of qh[l] is the fifth bit of value l of sub-block 2c, bit 2c + 1 that of sub-block 2c + 1.
    high = (codes.reshape(n, 8, 32) >> 4).astype(np.uint8)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    return np.concatenate([_fp16(d)[:, None].view(np.uint8), _fp16(dmin)[:, None].view(np.uint8),
                           _pack_scales_mins(sc, m), qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Symmetric: 16 sub-blocks of 16 with int8 scales, codes -32..31, fp16 d last."""
    sub = x.reshape(-1, 16, 16)
    n = sub.shape[0]
    amax = np.abs(sub).max(-1)
    scale = amax / 31
    d = _fp16(np.abs(scale).max(-1) / 127).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    eff = d[:, None] * sc
    q = np.clip(np.round(sub / np.where(eff == 0, 1, eff)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # two halves of 128 values, four runs of 32 each
    # Per half: 64 bytes of low nibbles (runs 0 | 2 << 4, then runs 1 | 3 << 4), then the top two
    # bits of the four runs packed into 32 bytes.
    ql = np.concatenate([part for h in range(2) for part in
                         ((q[:, h, 0] & 0xF) | ((q[:, h, 2] & 0xF) << 4),
                          (q[:, h, 1] & 0xF) | ((q[:, h, 3] & 0xF) << 4))], axis=1)
    qh = np.concatenate([(q[:, h, 0] >> 4) | ((q[:, h, 1] >> 4) << 2) | ((q[:, h, 2] >> 4) << 4)
                         | ((q[:, h, 3] >> 4) << 6) for h in range(2)], axis=1)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d)[:, None].view(np.uint8)], axis=1)


def k_blocks_reference(x: np.ndarray, kind: str) -> np.ndarray:
    """The values the blocks quantize_<kind>(x) writes encode, recomputed from the same integers
    (what a correct dequantizer must return)."""
    if kind == "Q6_K":
        sub = x.reshape(-1, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = _fp16(np.abs(scale).max(-1) / 127).astype(np.float32)
        sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.float32)
        eff = d[:, None] * sc
        q = np.clip(np.round(sub / np.where(eff == 0, 1, eff)[..., None]), -32, 31)
        return (eff[..., None] * q).reshape(x.shape).astype(np.float32)
    d, dmin, sc, m, codes = _affine_k(x, 16 if kind == "Q4_K" else 32)
    values = (d[:, None] * sc)[..., None] * codes - (dmin[:, None] * m)[..., None]
    return values.reshape(x.shape).astype(np.float32)


def quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """A float32 matrix [rows, cols] as the bytes of ggml type `kind` ([rows, bytes per row])."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    rows, cols = x.shape
    if kind in K_TYPES:
        packer = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}[kind]
        return packer(x.reshape(-1, QK_K)).reshape(rows, -1)
    return gguf.quants.quantize(x, qtype)


# ------------------------------------------------------------------------------ GGUF from HF


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's reordering of LLaMA Q/K rows (rotate-half pairs -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _block_kind(cols: int, kind: str) -> str:
    """The type a matrix with rows of `cols` values gets: `kind` if its rows split into that
    type's blocks, else Q8_0 (32-value blocks), else F16."""
    import gguf

    if kind in ("F32", "F16"):
        return kind
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
    if cols % block == 0:
        return kind
    return "Q8_0" if cols % 32 == 0 else "F16"


def encoded(x: np.ndarray, kind: str) -> np.ndarray:
    """The float32 values a tensor written as `kind` holds (what a dequantizer returns)."""
    import gguf

    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1 or kind == "F32":
        return x
    if kind == "F16":
        return x.astype(np.float16).astype(np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = gguf.quants.dequantize(quantize(flat, kind), gguf.GGMLQuantizationType[kind])
    return np.asarray(out, dtype=np.float32).reshape(x.shape)


def _metadata(w, arch: str, config: dict, head_dim: int) -> None:
    """The architecture keys convert_hf_to_gguf.py writes for each family."""
    import gguf

    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hidden = config["hidden_size"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:
        rope = rope["full_attention"]
    theta = rope.get("rope_theta") or config.get("rope_theta")
    if arch == "deepseek2":
        w.add_head_count_kv(1)
        kv_lora, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
        w.add_rope_freq_base(float(theta or 10000.0))
        w.add_key_length(kv_lora + rope_dim)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(config["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(config["v_head_dim"])
        w.add_kv_lora_rank(kv_lora)
        if config.get("q_lora_rank"):
            w.add_q_lora_rank(config["q_lora_rank"])
        w.add_rope_dimension_count(rope_dim)
        w.add_leading_dense_block_count(config["first_k_dense_replace"])
        w.add_expert_count(config["n_routed_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_count(config["n_shared_experts"])
        w.add_expert_weights_scale(config.get("routed_scaling_factor") or 1.0)
        if config.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        if config.get("n_group"):
            w.add_expert_group_count(config["n_group"])
            w.add_expert_group_used_count(config["topk_group"])
        if config["architectures"][0] == "DeepseekV3ForCausalLM":  # config.json's scoring_func: sigmoid
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        return
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
        w.add_sliding_window(config["sliding_window"])
        return
    if arch == "gemma3":
        w.add_rope_freq_base(float(theta or 1_000_000.0))
        local = (config.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        w.add_rope_freq_base_swa(float(local or config.get("rope_local_base_freq") or 10000.0))
        w.add_sliding_window(config["sliding_window"])
        return
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta or 10000.0))
    if arch == "phi3" and config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if arch == "phi3" and rope.get("rope_type") == "longrope":  # conversion/phi.py: no scaling type written
        import math

        original = rope.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if arch != "llama":
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _add_tokenizer(w, hf_dir: pathlib.Path) -> None:
    """The HF directory's byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer metadata."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {a["id"] for a in spec["added_tokens"] if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    merges = spec["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def _add_tensor(w, name: str, x: np.ndarray, kind: str) -> str:
    """Writes x (a norm or bias in F32, a matrix in `kind` or its fallback); returns the type used."""
    import gguf

    kind = "F32" if x.ndim == 1 else _block_kind(x.shape[-1], kind)
    if kind == "F32":
        w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    elif kind == "F16":
        w.add_tensor(name, x.astype(np.float16))
    else:
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        packed = quantize(flat, kind).reshape(*x.shape[:-1], -1)
        w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    return kind


# MPT's and BLOOM's checkpoint names (after transformer.blocks.N. / transformer.h.N.) -> GGUF's.
_MPT_LAYER = {"norm_1.weight": "attn_norm.weight", "attn.Wqkv.weight": "attn_qkv.weight",
              "attn.out_proj.weight": "attn_output.weight", "norm_2.weight": "ffn_norm.weight",
              "ffn.up_proj.weight": "ffn_up.weight", "ffn.down_proj.weight": "ffn_down.weight"}
_BLOOM_LAYER = {f"{hf}.{t}": f"{gg}.{t}" for hf, gg in (
    ("input_layernorm", "attn_norm"), ("self_attention.query_key_value", "attn_qkv"),
    ("self_attention.dense", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
    ("mlp.dense_h_to_4h", "ffn_up"), ("mlp.dense_4h_to_h", "ffn_down")) for t in ("weight", "bias")}


def write_alibi_gguf(hf_dir: pathlib.Path, out: pathlib.Path, kind: str = "F32", *,
                     twin: dict | None = None) -> pathlib.Path:
    """An MPT or BLOOM directory as llama.cpp's converter writes it (conversion/mpt.py, bloom.py):
    metadata under mpt.* / bloom.* (layer_norm_epsilon, MPT's max_alibi_bias and clamp_kqv),
    BLOOM's head-by-head q|k|v rows regrouped into q | k | v, its embedding LayerNorm as
    token_embd_norm, no output.weight (both tie their LM head). `twin` gets the checkpoint (under
    the HF directory's own names) with every weight replaced by what the file encodes."""
    import gguf
    import torch
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    bloom = config["architectures"][0] == "BloomForCausalLM"
    arch = "bloom" if bloom else "mpt"
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})
    hidden = config["hidden_size"] if bloom else config["d_model"]
    heads = config["n_head"] if bloom else config["n_heads"]
    layers = config["n_layer"] if bloom else config["n_layers"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(config.get("seq_length", hidden) if bloom else config["max_seq_len"])
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    if bloom:
        w.add_head_count_kv(heads)
        w.add_layer_norm_eps(config["layer_norm_epsilon"])
    else:
        w.add_layer_norm_eps(1e-5)
        attn = config.get("attn_config") or {}
        if attn.get("clip_qkv") is not None:
            w.add_clamp_kqv(attn["clip_qkv"])
        w.add_max_alibi_bias(attn.get("alibi_bias_max", 8) if attn.get("alibi", True) else 0.0)
    w.add_vocab_size(config["vocab_size"])
    _add_tokenizer(w, hf_dir)

    def put(hf: str, gguf_name: str, stored: np.ndarray, k: str) -> None:
        used = _add_tensor(w, gguf_name, stored, k)
        if twin is not None:  # row regrouping commutes with row-wise quantization
            twin[hf] = torch.from_numpy(encoded(state[hf], used))

    root = "transformer.word_embeddings" if bloom else "transformer.wte"
    put(f"{root}.weight", "token_embd.weight", state[f"{root}.weight"], kind)
    if bloom:
        for t in ("weight", "bias"):
            put(f"transformer.word_embeddings_layernorm.{t}", f"token_embd_norm.{t}",
                state[f"transformer.word_embeddings_layernorm.{t}"], "F32")
    for i in range(layers):
        pre = f"transformer.h.{i}." if bloom else f"transformer.blocks.{i}."
        for hf, gg in (_BLOOM_LAYER if bloom else _MPT_LAYER).items():
            x = state[pre + hf]
            if bloom and hf.startswith("self_attention.query_key_value"):
                x = x.reshape(heads, 3, hidden // heads, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
            put(pre + hf, f"blk.{i}.{gg}", x, kind)
    final = "transformer.ln_f" if bloom else "transformer.norm_f"
    for t in ("weight", "bias") if bloom else ("weight",):
        put(f"{final}.{t}", f"output_norm.{t}", state[f"{final}.{t}"], "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_FALCON_LAYER = {f"{hf}.{t}": f"{gg}.{t}" for hf, gg in (
    ("input_layernorm", "attn_norm"), ("ln_attn", "attn_norm"), ("ln_mlp", "attn_norm_2"),
    ("self_attention.query_key_value", "attn_qkv"), ("self_attention.dense", "attn_output"),
    ("mlp.dense_h_to_4h", "ffn_up"), ("mlp.dense_4h_to_h", "ffn_down")) for t in ("weight", "bias")}


def write_falcon_gguf(hf_dir: pathlib.Path, out: pathlib.Path, kind: str = "F32", *,
                      twin: dict | None = None) -> pathlib.Path:
    """A RoPE Falcon directory as llama.cpp's converter writes it (conversion/falcon.py): falcon.*
    metadata (feed_forward_length 4 x hidden, head_count_kv, layer_norm_epsilon), q|k|v regrouped
    from KV groups [q_g...; k_g; v_g] into q | k | v, ln_attn / input_layernorm as attn_norm and
    ln_mlp as attn_norm_2. The KV head count is transformers' (1 for multi-query): the converter
    reads num_kv_heads, which a config saved by transformers 5 fills with the head count even
    for multi-query models."""
    import gguf
    import torch
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    new_arch = config.get("new_decoder_architecture", False)
    kv = config.get("num_kv_heads") or heads if new_arch or not config.get("multi_query", True) else 1
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(out), "falcon")
    w.add_context_length(2048)
    w.add_tensor_data_layout("jploski")
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_eps(config["layer_norm_epsilon"])
    w.add_vocab_size(config["vocab_size"])
    _add_tokenizer(w, hf_dir)

    def put(hf: str, gguf_name: str, stored: np.ndarray, k: str) -> None:
        used = _add_tensor(w, gguf_name, stored, k)
        if twin is not None:  # row regrouping commutes with row-wise quantization
            twin[hf] = torch.from_numpy(encoded(state[hf], used))

    put("transformer.word_embeddings.weight", "token_embd.weight", state["transformer.word_embeddings.weight"], kind)
    for i in range(layers):
        pre = f"transformer.h.{i}."
        for hf, gg in _FALCON_LAYER.items():
            if pre + hf not in state:
                continue
            x = state[pre + hf]
            if hf.startswith("self_attention.query_key_value"):
                g = x.reshape(kv, heads // kv + 2, head_dim, *x.shape[1:])
                x = np.concatenate([g[:, :-2].reshape(-1, *x.shape[1:]), g[:, -2].reshape(-1, *x.shape[1:]),
                                    g[:, -1].reshape(-1, *x.shape[1:])])
            put(pre + hf, f"blk.{i}.{gg}", x, kind)
    for t in ("weight", "bias"):
        put(f"transformer.ln_f.{t}", f"output_norm.{t}", state[f"transformer.ln_f.{t}"], "F32")
    if "lm_head.weight" in state and not config.get("tie_word_embeddings", True):
        put("lm_head.weight", "output.weight", state["lm_head.weight"], kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_gguf(hf_dir: pathlib.Path, out: pathlib.Path, kind: str = "F32", *, embed_kind: str | None = None,
               rope_freqs: np.ndarray | None = None, tensor_kinds: dict[str, str] | None = None,
               twin: dict | None = None) -> pathlib.Path:
    """Writes the HF model in `hf_dir` as a GGUF file: every 2-D weight in `kind` (embedding in
    `embed_kind`, default `kind`; `tensor_kinds` maps a GGUF tensor kind such as "attn_v" to its
    own type, as llama.cpp's mixed Q4_K_M files do), norms and biases in F32. `twin`, if given,
    receives the HF state dict the file encodes (see the module docstring)."""
    import re

    import gguf
    import torch
    from safetensors.torch import load_file
    config = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})

    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, arch, config, head_dim)
    w.add_vocab_size(config["vocab_size"])

    _add_tokenizer(w, hf_dir)

    def add(name: str, x: np.ndarray, k: str) -> str:
        k = "F32" if x.ndim == 1 else _block_kind(x.shape[-1], k)
        if k == "F32":
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
        elif k == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
            packed = quantize(flat, k).reshape(*x.shape[:-1], -1)
            w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType[k])
        return k

    def record(hf: str, x: np.ndarray, k: str) -> None:
        if twin is not None:
            twin[hf] = torch.from_numpy(encoded(x, k))

    def kind_of(gguf_name: str) -> str:
        return (tensor_kinds or {}).get(gguf_name.split(".")[0], kind)

    gemma = arch in ("gemma2", "gemma3")
    layer_names = _GEMMA_LAYER if gemma else _MOE_LAYER
    record("model.embed_tokens.weight", state["model.embed_tokens.weight"],
           add("token_embd.weight", state["model.embed_tokens.weight"], embed_kind or kind))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    expert_re = re.compile(r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        stacks: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
        for name in [n for n in state if n.startswith(pre)]:
            x, hf = state[name], name[len(pre):]
            if (m := expert_re.match(hf)) is not None:
                stacks.setdefault(_EXPERT_PART[m.group(3)], {})[int(m.group(2))] = (name, x)
                continue
            if hf == "self_attn.kv_b_proj.weight":
                # The converter's MLA split: per head, key rows transposed (attn_k_b) and value rows.
                nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
                kv = x.reshape(heads, nope + v, x.shape[-1])
                k_b, v_b = np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), kv[:, nope:]
                kb_kind = add(f"blk.{i}.attn_k_b.weight", k_b, kind_of("attn_k_b"))
                vb_kind = add(f"blk.{i}.attn_v_b.weight", v_b, kind_of("attn_v_b"))
                if twin is not None:
                    both = np.concatenate((encoded(k_b, kb_kind).transpose(0, 2, 1), encoded(v_b, vb_kind)), axis=1)
                    twin[name] = torch.from_numpy(np.ascontiguousarray(both.reshape(x.shape)))
                continue
            if hf not in layer_names:
                continue
            gg = layer_names[hf]
            stored = x
            if arch == "llama" and hf.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                stored = llamacpp_permute(x, heads if "q_proj" in hf else kv_heads)
            if gemma and hf.endswith("norm.weight"):
                stored = x + 1
            if hf == "mlp.gate.e_score_correction_bias":
                stored = x
            k = add(f"blk.{i}.{gg}", stored, kind_of(gg))
            record(name, x, k)  # row permutations commute with row-wise quantization
        for gg, experts in stacks.items():
            order = sorted(experts)
            k = add(f"blk.{i}.{gg}.weight", np.stack([experts[e][1] for e in order]), kind_of(gg))
            for e in order:
                record(experts[e][0], experts[e][1], k)
    w.add_tensor("output_norm.weight", np.ascontiguousarray(state["model.norm.weight"] + (1 if gemma else 0),
                                                             dtype=np.float32))
    record("model.norm.weight", state["model.norm.weight"], "F32")
    if not config.get("tie_word_embeddings", False):
        record("lm_head.weight", state["lm_head.weight"], add("output.weight", state["lm_head.weight"], kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
