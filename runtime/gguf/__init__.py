"""GGUF files as models: ``LLM(model="x.gguf")``, ``kvserve serve x.gguf``.

- ``model_config(path)``: the ModelConfig built from the file's metadata (through the same
  ``ModelConfig.from_dict`` checks as a Hugging Face directory);
- ``checkpoint_tensors(path, cfg)``: the weights under Hugging Face checkpoint names, with
  llama.cpp's Q/K row permutation undone, each either a float tensor or (for the types with a
  group-wise integer form, when the caller asks) a ``GroupQuantized``;
- ``load_tokenizer(path)``: the tokenizer and chat template from the metadata, converted by
  transformers (``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=name)``).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Iterator

import torch

from kvserve.runtime.gguf.config import ROPE_FREQS, hf_config, hf_name, permuted_heads
from kvserve.runtime.gguf.reader import GGUFFile, is_gguf_path
from kvserve.runtime.gguf.weights import (
    GROUPWISE_TYPES,
    GroupQuantized,
    check_supported,
    group_quantized,
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
    return dataclasses.replace(cfg, rope_freq_factors=factors)


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
    with GGUFFile(path) as gf:
        arch = gf.architecture
        for gguf_name, info in gf.tensors.items():
            name = hf_name(gguf_name)
            if name is None:
                if gguf_name != ROPE_FREQS:
                    log.warning("ignoring GGUF tensor %s: not used by %s", gguf_name, cfg.architecture)
                continue
            if wanted is not None and not wanted(name):
                continue
            check_supported(gguf_name, info.ggml_type)
            raw = gf.raw(gguf_name)
            tensor: torch.Tensor | GroupQuantized
            if info.ggml_type in GROUPWISE_TYPES and len(info.shape) == 2 and keep_quantized(name, info.ggml_type):
                tensor = group_quantized(raw, info.ggml_type, info.shape)
            else:
                tensor = to_float(raw, info.ggml_type, info.shape)
            heads = permuted_heads(gguf_name, arch, shape.num_attention_heads, shape.num_kv_heads)
            if heads is not None:
                index = unpermute_index(info.shape[0], heads)
                tensor = tensor.permute_rows(index) if isinstance(tensor, GroupQuantized) else take_rows(tensor, index)
            del raw
            yield name, tensor


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
