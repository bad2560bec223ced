"""A GGUF file's metadata as the Hugging Face config that ModelConfig already understands.

llama.cpp names everything after the architecture (``llama.block_count``, ``qwen2.rope.freq_base``);
this module translates those keys into config.json's names, so a GGUF model goes through the same
ModelConfig checks (architecture, RoPE, heads vs tensor parallelism) as a Hugging Face directory.
It also says how each GGUF tensor name maps onto the checkpoint names CausalLM consumes.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from kvserve.runtime.gguf.reader import GGUFError, GGUFFile

# general.architecture -> (HF architecture, model_type, whether llama.cpp's converter permuted the
# rows of Q and K). The converter reorders LLaMA's Q/K rows from rotate-half pairs (i, i + d/2)
# into interleaved pairs (2i, 2i + 1) for ggml's RoPE; Qwen models keep Hugging Face's order.
# Mistral files say "llama" (same graph in llama.cpp); sliding window is not in GGUF metadata.
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
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
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# Tensors that carry no weight of their own here: RoPE frequency factors become part of the
# config (see rope_freq_factors).
ROPE_FREQS = "rope_freqs.weight"


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name for a GGUF tensor name, or None if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def permuted_heads(gguf_name: str, architecture: str, num_heads: int, num_kv_heads: int) -> int | None:
    """How many heads' rows llama.cpp interleaved in this tensor (None: stored in HF order)."""
    if not ARCHITECTURES.get(architecture, ("", "", False))[2]:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m is None:
        return None
    return {"attn_q": num_heads, "attn_k": num_kv_heads}.get(m.group(2))


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
    present = {int(m.group(1)) for name in gf.tensors if (m := _LAYER_RE.match(name))}
    if present and max(present) >= layers:
        raise GGUFError(gf.path, f"metadata key '{arch}.block_count'",
                        f"{layers} layers, but the file has tensors of layer {max(present)}")
    if len(present) < layers:  # also bounds what the config allocates per layer by the file's size
        raise GGUFError(gf.path, f"metadata key '{arch}.block_count'",
                        f"{layers} layers, but the file has tensors for {len(present)}")
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
    embed = gf.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise GGUFError(gf.path, "tensor 'token_embd.weight'", "missing (or not a matrix)")
    vocab = embed.shape[0]
    names = set(gf.tensors)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6, kind=float),
        "rope_theta": get("rope.freq_base", 10000.0, kind=float),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": _checkpoint_dtype(gf),
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    # The weight format: every tensor's type, from which the gguf linear method picks a kernel
    # per layer (kvserve.runtime.models.quantization.gguf).
    config["quantization_config"] = {
        "quant_method": "gguf",
        "tensor_types": {hf: info.type_name for name, info in gf.tensors.items() if (hf := hf_name(name))},
    }
    scaling = _rope_scaling(get, gf.path, arch)
    if scaling is not None:
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
