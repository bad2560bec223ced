"""Tiny GGUF files of random-weight models, written with the gguf package the way llama.cpp's
converter writes them: metadata under the architecture's keys, a byte-level BPE tokenizer with
its chat template, LLaMA's Q/K rows permuted for ggml's RoPE, each matrix in the requested type.

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
         "Qwen3ForCausalLM": "qwen3"}
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


def write_gguf(hf_dir: pathlib.Path, out: pathlib.Path, kind: str = "F32", *, embed_kind: str | None = None,
               rope_freqs: np.ndarray | None = None, tensor_kinds: dict[str, str] | None = None) -> pathlib.Path:
    """Writes the HF model in `hf_dir` as a GGUF file: every 2-D weight in `kind` (embedding in
    `embed_kind`, default `kind`; `tensor_kinds` maps a GGUF tensor kind such as "attn_v" to its
    own type, as llama.cpp's mixed Q4_K_M files do), norms and biases in F32."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    config = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})

    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    w.add_vocab_size(config["vocab_size"])

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

    def add(name: str, x: np.ndarray, k: str) -> None:
        if x.ndim == 1 or k == "F32":
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
        elif k == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            packed = quantize(np.ascontiguousarray(x, dtype=np.float32), k)
            w.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType[k])

    add("token_embd.weight", state["model.embed_tokens.weight"], embed_kind or kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for i in range(config["num_hidden_layers"]):
        for hf, gg in _LAYER.items():
            name = f"model.layers.{i}.{hf}"
            if name not in state:
                continue
            x = state[name]
            if arch == "llama" and hf.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                x = llamacpp_permute(x, heads if "q_proj" in hf else kv_heads)
            add(f"blk.{i}.{gg}", x, (tensor_kinds or {}).get(gg.split(".")[0], kind))
    add("output_norm.weight", state["model.norm.weight"], "F32")
    if not config.get("tie_word_embeddings", False):
        add("output.weight", state["lm_head.weight"], kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
