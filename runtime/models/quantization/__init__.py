"""Weight formats of linear layers: one module per format, chosen by vLLM's names.

Every linear layer of a model (`kvserve.runtime.models.layers`: fused column-parallel q|k|v and
gate|up, row-parallel o_proj/down_proj, the vocabulary table that is also the LM head) asks the
model's `QuantizationConfig` for a `LinearMethod` and holds its weights through it. Unquantized
weights are a method too (`unquantized.UnquantizedLinearMethod`). The interface is in `base`:

    method.create_weights(layer, spec)          # this TP rank's parameters, named as in the checkpoint
    param.weight_loader(param, tensor, shard)   # whole checkpoint tensor in, this rank's slice kept
    method.process_weights_after_loading(layer) # unpack / quantize / repack for the kernel
    method.apply(layer, x, bias=None) -> y      # x [tokens, in] -> [tokens, out of this rank]
    method.embed(layer, ids) -> rows            # only for formats that cover the vocabulary

`apply`'s signature is stable: other work builds on it.

How a format plugs in: its torch-free config class in `kvserve.runtime.weight_formats` (``name``,
``from_config(quantization_config_dict_or_None)``, bytes per weight), then a module here with a
subclass of it and `QuantizationConfig` (``get_linear_method(spec)``) and its `LinearMethod`s,
plus one line in `_FORMATS` below. Integer formats should not write kernels of
their own: they unpack their checkpoint layout into one of the two canonical forms of `packed`
(`Int4Weight`: 4-bit values with a float scale and offset per group, ``w = q * scale + offset``;
`Int8Weight`: int8 with a scale per group or per channel) and share `int4.Int4Applier` / the int8
methods' ``apply``, which pick torch's packed CPU kernels, the Triton GPU kernels or the twins.

- GGUF: Q4_0 (``(q - 8) * d``), Q4_1 (``q * d + m``) and Q4_K (per-32 sub-block scales and mins)
  are `Int4Weight` with group 32 (scale = d, offset = -8d or m); Q8_0 is `Int8Weight` with group
  32; a GGUF method creates parameters for the decoded values with `base.sharded_param`
  (``in_div=32`` for per-group tensors, so TP refuses a degree that would split a block).
- Mixture-of-experts layers can hold one method per expert weight the same way.
- The fast CPU float32 matmul belongs in `UnquantizedLinearMethod.apply`.

Formats: ``int8`` and ``int4`` (weight-only, quantized at load from a full-precision checkpoint),
``awq``, ``gptq``, ``compressed-tensors`` (pack-quantized W4A16/W8A16, FP8 W8A8), ``fp8`` (an FP8
checkpoint, or FP8 quantization at load), ``bitsandbytes`` (pre-quantized NF4/FP4 and LLM.int8
checkpoints). The checkpoint's ``quantization_config`` selects its
format when ``quantization`` is not given; a mismatch is a ValueError, never a silent fallback.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from kvserve.runtime.models.quantization.base import LinearMethod, LinearSpec, QuantizationConfig
from kvserve.runtime.weight_formats import WEIGHT_FORMATS, checkpoint_format, resolve_format

__all__ = ["LinearMethod", "LinearSpec", "QuantizationConfig", "WEIGHT_FORMATS", "detect_quantization",
           "resolve_quantization"]

# The torch half of each format in kvserve.runtime.weight_formats, imported when a model needs it.
_FORMATS = {
    "int8": "int8:Int8Config",
    "int4": "int4:Int4Config",
    "awq": "awq:AWQConfig",
    "gptq": "gptq:GPTQConfig",
    "compressed-tensors": "compressed_tensors:CompressedTensorsConfig",
    "fp8": "fp8:Fp8Config",
    "gguf": "gguf:GGUFConfig",
    "bitsandbytes": "bitsandbytes:BitsAndBytesConfig",
}
assert set(_FORMATS) == set(WEIGHT_FORMATS)

detect_quantization = checkpoint_format


def _config_class(name: str):
    module, cls = _FORMATS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def resolve_quantization(requested: str | None, hf_config: Mapping[str, Any]) -> QuantizationConfig | None:
    """The QuantizationConfig to load a checkpoint with (None: full precision).

    `requested` is the user's ``quantization`` (None: what the checkpoint says); which format that
    means, and every refusal, is `kvserve.runtime.weight_formats.resolve_format`'s.
    """
    name = resolve_format(requested, hf_config)
    if name is None:
        return None
    from_checkpoint = checkpoint_format(hf_config) is not None
    return _config_class(name).from_config(hf_config.get("quantization_config") if from_checkpoint else None)


def check_quantization(requested: str | None, hf_config: Mapping[str, Any], device: str = "auto",
                       dtype: str = "auto") -> QuantizationConfig | None:
    """`resolve_quantization` plus the device check, from the engine's option strings (the CLI's
    preflight: it refuses before the server starts listening)."""
    from kvserve.runtime.engine import resolve_device, resolve_dtype
    from kvserve.runtime.model_config import ModelConfig

    quant_config = resolve_quantization(requested, hf_config)
    if quant_config is not None:
        dev = resolve_device(device)
        quant_config.check_supported(dev, resolve_dtype(dtype, ModelConfig.from_dict(dict(hf_config)).dtype, dev))
    return quant_config
