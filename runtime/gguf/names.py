"""GGUF tensor names as the Hugging Face checkpoint names CausalLM consumes, per family.

llama.cpp's converter renames every tensor (``model.layers.3.self_attn.q_proj.weight`` becomes
``blk.3.attn_q.weight``) and, for some families, changes what a tensor holds. This module says,
for each GGUF tensor, which checkpoint tensors it becomes and what must be undone (torch-free, so
the config builder can list the per-tensor types without loading anything):

- LLaMA / Mistral / Mixtral: Q and K rows interleaved for ggml's RoPE (``permuted_heads``);
- Gemma 2/3: every RMSNorm weight stored as 1 + w (ggml multiplies by the stored weight);
  ``ffn_norm`` is Gemma's pre-feed-forward norm, not the post-attention one;
- MoE (Mixtral, Qwen2/3-MoE, DeepSeek): each layer's experts stacked into one 3-D tensor
  [experts, rows, cols] per projection (``ffn_gate_exps`` ...), split back per expert;
- DeepSeek V2/V3: kv_b_proj split into ``attn_k_b`` (each head's key rows transposed) and
  ``attn_v_b`` (older files keep ``attn_kv_b``), and the rotary rows of q and kv_a_proj in
  DeepSeek's interleaved pair order, which the loader turns into rotate-half order
  (``rope_rows``) so that no packed tensor needs permuting inside the model;
- MPT / BLOOM / Falcon: q|k|v fused in ``attn_qkv`` (MPT's Wqkv as is; BLOOM's and Falcon's
  reordered from KV groups [q_g...; k_g; v_g] into q | k | v, which ``grouped_qkv`` marks for
  undoing), LayerNorm biases, BLOOM's embedding LayerNorm ``token_embd_norm``, Falcon-40B's second
  LayerNorm ``attn_norm_2``.
"""

from __future__ import annotations

import re

LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z][a-z0-9_]*)\.(weight|bias)$")  # attn_norm_2: a digit

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output_norm.bias": "model.norm.bias",  # LayerNorm families (MPT, BLOOM)
    "token_embd_norm.weight": "model.embed_layernorm.weight",  # BLOOM
    "token_embd_norm.bias": "model.embed_layernorm.bias",
}
_COMMON = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA = {
    **_COMMON,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QWEN_MOE = {
    **_COMMON,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_MIXTRAL = {**_COMMON, "ffn_gate_inp": "block_sparse_moe.gate"}
_DEEPSEEK = {
    **_COMMON,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.kv_b_proj",  # with attn_v_b: see KV_B_PARTS
    "attn_v_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Phi-3: q|k|v and gate|up fused, as in its checkpoints (the loader splits them).
_PHI3 = {**_COMMON, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# MPT and BLOOM (ALiBi, LayerNorm, ungated MLP): q|k|v fused as in their checkpoints.
_ALIBI = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj",
          "attn_output": "self_attn.o_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Falcon (RoPE): attention and MLP in parallel; Falcon-40B's second LayerNorm (ln_mlp) is attn_norm_2.
_FALCON = {**_ALIBI, "attn_norm_2": "mlp_layernorm"}
_LAYER_NAMES = {"mpt": _ALIBI, "bloom": _ALIBI, "falcon": _FALCON,
                "phi3": _PHI3, "gemma2": _GEMMA, "gemma3": _GEMMA, "qwen2moe": _QWEN_MOE, "qwen3moe": _QWEN_MOE,
                "deepseek2": _DEEPSEEK}
# The stacked expert tensors: GGUF kind -> part (the names per family are in _expert_name).
EXPERT_PARTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
_MIXTRAL_PARTS = {"gate": "w1", "up": "w3", "down": "w2"}
# DeepSeek's kv_b_proj, written as two tensors since llama.cpp's MLA absorption.
KV_B_PARTS = ("attn_k_b", "attn_v_b")
# The routing bias of DeepSeek V3 (no .weight / .bias suffix in the checkpoint).
_EXP_PROBS_B = "exp_probs_b"


def _layer_names(arch: str, experts: int) -> dict[str, str]:
    if arch == "llama" and experts:
        return _MIXTRAL
    return _LAYER_NAMES.get(arch, _COMMON)


def _expert_name(arch: str, layer: str, expert: int, part: str) -> str:
    if arch == "llama":  # Mixtral
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL_PARTS[part]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"


def hf_names(gguf_name: str, arch: str, ndim: int = 2, experts: int = 0) -> list[str]:
    """The checkpoint names a GGUF tensor becomes: one; one per expert for a stacked expert
    tensor (``ndim`` 3); none for a tensor the runtime does not use."""
    if gguf_name in GLOBAL_NAMES:
        return [GLOBAL_NAMES[gguf_name]]
    m = LAYER_RE.match(gguf_name)
    if m is None:
        return []
    layer, kind, suffix = m.groups()
    if kind in EXPERT_PARTS:
        if ndim != 3 or not experts:
            return []
        return [_expert_name(arch, layer, e, EXPERT_PARTS[kind]) for e in range(experts)]
    if kind == _EXP_PROBS_B and arch == "deepseek2":
        return [f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
    names = _layer_names(arch, experts)
    if kind not in names:
        return []
    if kind in KV_B_PARTS:
        suffix = "weight"
    return [f"model.layers.{layer}.{names[kind]}.{suffix}"]


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The checkpoint name of a GGUF tensor that maps onto exactly one, else None."""
    names = hf_names(gguf_name, arch)
    return names[0] if len(names) == 1 else None


def permuted_heads(gguf_name: str, architecture: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads' rows llama.cpp interleaved in this tensor (None: stored in HF order)."""
    if architecture != "llama":
        return None
    m = LAYER_RE.match(gguf_name)
    if m is None:
        return None
    return {"attn_q": num_heads, "attn_k": num_kv_heads}.get(m.group(2))


def grouped_qkv(gguf_name: str, architecture: str) -> bool:
    """Whether this is BLOOM's or Falcon's attn_qkv, whose KV groups ([q_g...; k_g; v_g], the
    checkpoint's order, which the loader splits) llama.cpp's converter regrouped into q | k | v."""
    m = LAYER_RE.match(gguf_name)
    return architecture in ("bloom", "falcon") and m is not None and m.group(2) == "attn_qkv"


def norm_offset(architecture: str, hf: str) -> float:
    """What the converter added to this tensor (Gemma's norms: 1)."""
    return 1.0 if architecture in ("gemma2", "gemma3") and hf.endswith("norm.weight") else 0.0


def rope_rows(gguf_name: str, architecture: str, qk_head_dim: int, latent_dim: int) -> int | None:
    """For DeepSeek's q and kv_a projections: the size of the row groups whose last rotary rows
    are in interleaved pair order (each head's qk rows; kv_a's one latent + rotary group)."""
    if architecture != "deepseek2":
        return None
    m = LAYER_RE.match(gguf_name)
    if m is None or m.group(3) != "weight":
        return None
    return {"attn_q": qk_head_dim, "attn_q_b": qk_head_dim, "attn_kv_a_mqa": latent_dim}.get(m.group(2))
