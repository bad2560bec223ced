"""GGUF files as models: ``LLM(model="x.gguf")``, ``kvserve serve x.gguf``.

- ``model_config(path)``: the ModelConfig built from the file's metadata (through the same
  ``ModelConfig.from_dict`` checks as a Hugging Face directory);
- ``checkpoint_tensors(path, cfg)``: the weights under Hugging Face checkpoint names, with what
  llama.cpp's converter changed undone (``kvserve.runtime.gguf.names``: Q/K row permutation,
  Gemma's norm offsets, stacked experts, DeepSeek's split kv_b and interleaved rotary rows,
  BLOOM's and Falcon's regrouped q|k|v), each
  either a float tensor or (for the types with a group-wise integer form, when the caller asks)
  a ``GroupQuantized``;
- ``load_tokenizer(path)``: the tokenizer and chat template from the metadata, converted by
  transformers (``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=name)``).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Iterator

import numpy as np
import torch

from kvserve.runtime.gguf.config import CONFIG_TENSORS, ROPE_FREQS, hf_config
from kvserve.runtime.gguf.names import (
    KV_B_PARTS,
    LAYER_RE,
    grouped_qkv,
    hf_names,
    norm_offset,
    permuted_heads,
    rope_rows,
)
from kvserve.runtime.gguf.reader import GGUFFile, is_gguf_path
from kvserve.runtime.gguf.weights import (
    GROUPWISE_TYPES,
    GroupQuantized,
    check_supported,
    group_quantized,
    kv_group_index,
    rope_deinterleave_index,
    take_rows,
    to_float,
    unpermute_index,
)

log = logging.getLogger(__name__)

__all__ = ["GGUFFile", "GroupQuantized", "checkpoint_tensors", "is_gguf_path", "load_tokenizer", "model_config"]


def _check_file(path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
    return path


def model_config(path: str | pathlib.Path):
    from kvserve.runtime.model_config import ModelConfig

    path = _check_file(path)
    with GGUFFile(path) as gf:
        config, generation = hf_config(gf)
        cfg = ModelConfig.from_dict(config, generation, model_dir=path)
        factors = None
        if ROPE_FREQS in gf.tensors:
            info = gf.tensors[ROPE_FREQS]
            values = to_float(gf.raw(ROPE_FREQS), info.ggml_type, info.shape).flatten()
            if values.numel() != cfg.head_dim // 2:
                raise ValueError(f"model: GGUF tensor {ROPE_FREQS} has {values.numel()} values, expected "
                                 f"head_dim / 2 = {cfg.head_dim // 2}")
            factors = tuple(float(v) for v in values)
    # DeepSeek's interleaved rotary rows are reordered by checkpoint_tensors, not by the model.
    return dataclasses.replace(cfg, rope_freq_factors=factors, rope_interleave=False)


def checkpoint_tensors(path: str | pathlib.Path, cfg, *, keep_quantized=lambda hf, ggml_type: False,
                       wanted=None) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
    """Yields (Hugging Face name, tensor) for every weight in the file, in file order.

    ``keep_quantized(hf_name, ggml_type)`` says whether a tensor of a group-wise type comes as a
    GroupQuantized instead of dequantized floats; ``wanted(hf_name)`` (default: all) skips the
    tensors this rank does not read before any of their bytes are decoded. Unsupported types raise
    ValueError naming the tensor, its type and the supported types.
    """
    path = _check_file(path)
    shape = cfg.shape
    experts = shape.moe.num_experts if shape.moe is not None else 0
    mla = shape.mla
    kv_b: dict[str, dict[str, torch.Tensor]] = {}  # DeepSeek's attn_k_b / attn_v_b, per layer
    with GGUFFile(path) as gf:
        arch = gf.architecture
        for gguf_name, info in gf.tensors.items():
            names = hf_names(gguf_name, arch, len(info.shape), experts)
            if not names:
                if gguf_name not in CONFIG_TENSORS:
                    log.warning("ignoring GGUF tensor %s: not used by %s", gguf_name, cfg.architecture)
                continue
            if wanted is not None and not any(wanted(n) for n in names):
                continue
            check_supported(gguf_name, info.ggml_type)
            raw = gf.raw(gguf_name)
            m = LAYER_RE.match(gguf_name)
            if m is not None and m.group(2) in KV_B_PARTS:
                assert mla is not None
                parts = kv_b.setdefault(m.group(1), {})
                parts[m.group(2)] = to_float(raw, info.ggml_type, info.shape).float()
                if len(parts) == 2:
                    yield names[0], _kv_b_proj(parts[KV_B_PARTS[0]], parts[KV_B_PARTS[1]], gguf_name)
                    del kv_b[m.group(1)]
                continue
            if len(names) > 1:  # stacked experts [E, rows, cols]: one matrix each
                per_expert = np.asarray(raw).reshape(len(names), -1)
                for e, name in enumerate(names):
                    if wanted is None or wanted(name):
                        yield name, _tensor(per_expert[e], info.ggml_type, info.shape[1:], name, keep_quantized)
                continue
            name = names[0]
            tensor = _tensor(raw, info.ggml_type, info.shape, name, keep_quantized)
            heads = permuted_heads(gguf_name, arch, shape.num_attention_heads, shape.num_kv_heads)
            index = unpermute_index(info.shape[0], heads) if heads is not None else None
            group = rope_rows(gguf_name, arch, mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                              mla.latent_dim) if mla is not None else None
            if group is not None:
                index = rope_deinterleave_index(info.shape[0], group, mla.qk_rope_head_dim)
            if grouped_qkv(gguf_name, arch):
                index = kv_group_index(info.shape[0], shape.num_attention_heads, shape.num_kv_heads)
            if index is not None:
                tensor = tensor.permute_rows(index) if isinstance(tensor, GroupQuantized) else take_rows(tensor, index)
            offset = norm_offset(arch, name)
            if offset:
                tensor = tensor.float() - offset
            del raw
            yield name, tensor
        if kv_b:
            layer = next(iter(kv_b))
            raise ValueError(f"model: GGUF file {str(path)!r} has {', '.join(kv_b[layer])} of layer {layer} "
                             f"without its other half ({' and '.join(KV_B_PARTS)})")


def _tensor(raw, ggml_type, shape, name: str, keep_quantized) -> torch.Tensor | GroupQuantized:
    if ggml_type in GROUPWISE_TYPES and len(shape) == 2 and keep_quantized(name, ggml_type):
        return group_quantized(raw, ggml_type, shape)
    return to_float(raw, ggml_type, shape)


def _kv_b_proj(k_b: torch.Tensor, v_b: torch.Tensor, where: str) -> torch.Tensor:
    """kv_b_proj [heads * (nope + v), kv_lora_rank] from llama.cpp's attn_k_b [heads, kv_lora_rank,
    nope] (each head's key rows transposed) and attn_v_b [heads, v, kv_lora_rank]."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"model: GGUF tensor {where!r}: attn_k_b {tuple(k_b.shape)} and attn_v_b "
                         f"{tuple(v_b.shape)} do not form one kv_b_proj")
    rank = k_b.shape[1]
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, rank).contiguous()


def load_tokenizer(path: str | pathlib.Path):
    """The file's tokenizer (vocabulary, merges, special tokens, chat template) as a transformers
    fast tokenizer. AutoTokenizer would first parse the whole file again for its config (tens of
    seconds on a 49k vocabulary); the tokenizer class itself reads only the metadata."""
    from transformers import PreTrainedTokenizerFast

    path = _check_file(path)
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises anything from a vocabulary it cannot convert
        raise ValueError(f"model: no usable tokenizer in the GGUF metadata of {str(path)!r} "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); pass tokenizer=") from None
