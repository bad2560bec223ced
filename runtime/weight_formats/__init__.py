"""The weight formats kvserve loads, by vLLM's names: one torch-free registry of config classes.

Each format's config class (one module here) parses its checkpoint's ``quantization_config`` and
says how many bytes a weight takes in it. The runtime's linear methods
(`kvserve.runtime.models.quantization`) subclass these classes and add the torch parts; the
operator and the capacity model use them as they are. Which format a request means, and whether a
checkpoint can be loaded with it, is decided here (`format_name`, `resolve_format`), once.

Adding a format: a module here with a `FormatConfig` subclass, one entry in `_CLASSES`, and its
linear methods in `kvserve.runtime.models.quantization` (see docs/dev).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.runtime.weight_formats.awq import AWQFormat
from kvserve.runtime.weight_formats.base import FormatConfig, WeightFormat
from kvserve.runtime.weight_formats.bitsandbytes import BitsAndBytesFormat
from kvserve.runtime.weight_formats.compressed_tensors import CompressedTensorsFormat
from kvserve.runtime.weight_formats.fp8 import Fp8Format
from kvserve.runtime.weight_formats.gguf import GGUFFormat
from kvserve.runtime.weight_formats.gptq import GPTQFormat
from kvserve.runtime.weight_formats.int4 import Int4Format
from kvserve.runtime.weight_formats.int8 import Int8Format

__all__ = ["CHECKPOINT_FORMATS", "FORMATS", "FormatConfig", "LOAD_TIME_FORMATS", "WEIGHT_FORMATS", "WeightFormat",
           "checkpoint_format", "format_name", "resolve_format", "weight_format"]

_CLASSES: tuple[type[FormatConfig], ...] = (Int8Format, Int4Format, AWQFormat, GPTQFormat, CompressedTensorsFormat,
                                            Fp8Format, GGUFFormat, BitsAndBytesFormat)
FORMATS: dict[str, type[FormatConfig]] = {cls.name: cls for cls in _CLASSES}
# `quantization=` / `--quantization` / spec.runtime.quantization values.
WEIGHT_FORMATS = tuple(FORMATS)
# Formats a checkpoint can already be in (config.json's quantization_config.quant_method).
CHECKPOINT_FORMATS = tuple(name for name, cls in FORMATS.items() if cls.in_checkpoints)
# Formats that quantize a full-precision checkpoint while loading it.
LOAD_TIME_FORMATS = tuple(name for name, cls in FORMATS.items() if cls.at_load)


def _spelling(value: Any) -> str:
    # quant_method and flag spellings differ only in case and "_" for "-" (compressed_tensors).
    return str(value).lower().replace("_", "-")


def format_name(value: Any) -> str:
    """`value` as one of WEIGHT_FORMATS; ValueError naming the field `quantization` otherwise."""
    name = _spelling(value)
    if name not in FORMATS:
        raise ValueError(f"quantization: unknown format {value!r}; supported: {', '.join(WEIGHT_FORMATS)}")
    return name


def checkpoint_format(hf_config: Mapping[str, Any]) -> str | None:
    """The format named by config.json's ``quantization_config.quant_method`` (normalized, possibly
    one kvserve does not know), or None for a full-precision checkpoint."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError("model config: quantization_config must be a JSON object")
    return _spelling(qc.get("quant_method", ""))


def resolve_format(requested: Any, hf_config: Mapping[str, Any]) -> str | None:
    """The format to load a checkpoint with (None: full precision), from the user's `requested`
    (None: whatever the checkpoint is) and the checkpoint's config.json. ValueError naming the
    field for an unknown name, a checkpoint format kvserve cannot load, or a request that
    contradicts the checkpoint."""
    detected = checkpoint_format(hf_config)
    if requested is not None:
        requested = format_name(requested)
    if detected is not None and detected not in CHECKPOINT_FORMATS:
        raise ValueError(f"quantization: the checkpoint's quantization_config.quant_method {detected!r} is not "
                         f"supported; supported checkpoint formats: {', '.join(CHECKPOINT_FORMATS)}")
    if requested is None:
        return detected
    if detected is None:
        if requested == "gguf":
            raise ValueError("quantization: 'gguf' needs a .gguf file as the model; this checkpoint is not one "
                             "(leave quantization unset to load it as it is)")
        if requested not in LOAD_TIME_FORMATS:
            raise ValueError(f"quantization: {requested!r} needs a checkpoint quantized with it (config.json "
                             f"quantization_config.quant_method), and this one is not quantized; formats that "
                             f"quantize a full-precision checkpoint at load: {', '.join(LOAD_TIME_FORMATS)}")
        return requested
    if detected != requested:
        found = ("the model is a GGUF file (its tensor types are its format)" if detected == "gguf" else
                 f"the checkpoint is quantized as {detected!r} (config.json quantization_config)")
        raise ValueError(f"quantization: {requested!r} was requested but {found}; leave quantization unset or use "
                         f"{detected!r}")
    return detected


def weight_format(quantization: str | None, dtype_size: int, hidden_size: int = 4096,
                  quantization_config: Mapping[str, Any] | None = None) -> WeightFormat:
    """The memory a weight format takes per parameter (for TP planning and pool sizing).

    ``hidden_size`` stands in for the row length where scales are per channel; the checkpoint's
    ``quantization_config``, when given, supplies group sizes and schemes (else each format's
    common defaults)."""
    if quantization is None:
        return WeightFormat("none", dtype_size, dtype_size)
    return FORMATS[format_name(quantization)].for_planning(quantization_config).weight_format(dtype_size, hidden_size)
