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

How a format plugs in: a new module here with a `QuantizationConfig` subclass (``name``,
``from_config(quantization_config_dict_or_None)``, ``get_linear_method(spec)``) and its
`LinearMethod`s, plus one line in `_FORMATS` below. Integer formats should not write kernels of
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
checkpoint, or FP8 quantization at load). The checkpoint's ``quantization_config`` selects its
format when ``quantization`` is not given; a mismatch is a ValueError, never a silent fallback.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from kvserve.runtime.capacity import CHECKPOINT_FORMATS, LOAD_TIME_FORMATS, WEIGHT_FORMATS
from kvserve.runtime.models.quantization.base import LinearMethod, LinearSpec, QuantizationConfig

__all__ = ["LinearMethod", "LinearSpec", "QuantizationConfig", "WEIGHT_FORMATS", "detect_quantization",
           "resolve_quantization"]

_FORMATS = {
    "int8": "int8:Int8Config",
    "int4": "int4:Int4Config",
    "awq": "awq:AWQConfig",
    "gptq": "gptq:GPTQConfig",
    "compressed-tensors": "compressed_tensors:CompressedTensorsConfig",
    "fp8": "fp8:Fp8Config",
    "gguf": "gguf:GGUFConfig",
}
assert set(_FORMATS) == set(WEIGHT_FORMATS)

# quant_method spellings that mean one of ours.
_ALIASES = {"compressed_tensors": "compressed-tensors"}


def _config_class(name: str):
    module, cls = _FORMATS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def detect_quantization(hf_config: Mapping[str, Any]) -> str | None:
    """The checkpoint's own format from config.json's ``quantization_config``, or None."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError("model config: quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    return _ALIASES.get(method, method)


def resolve_quantization(requested: str | None, hf_config: Mapping[str, Any]) -> QuantizationConfig | None:
    """The QuantizationConfig to load a checkpoint with (None: full precision).

    `requested` is the user's ``quantization`` (None: what the checkpoint says). Raises ValueError
    naming the field for an unknown name, a checkpoint format kvserve cannot load, or a request
    that contradicts the checkpoint.
    """
    detected = detect_quantization(hf_config)
    qc = hf_config.get("quantization_config") or None
    if requested is not None:
        requested = _ALIASES.get(str(requested).lower(), str(requested).lower())
        if requested not in WEIGHT_FORMATS:
            raise ValueError(f"quantization: unknown format {requested!r}; supported: {', '.join(WEIGHT_FORMATS)}")
    if detected is not None and detected not in CHECKPOINT_FORMATS:
        raise ValueError(f"quantization: the checkpoint's quantization_config.quant_method {detected!r} is not "
                         f"supported; supported checkpoint formats: {', '.join(CHECKPOINT_FORMATS)}")
    if requested is None:
        return None if detected is None else _config_class(detected).from_config(qc)
    if detected is None:
        if requested == "gguf":
            raise ValueError("quantization: 'gguf' needs a .gguf file as the model; this checkpoint is not one "
                             "(leave quantization unset to load it as it is)")
        if requested not in LOAD_TIME_FORMATS:
            raise ValueError(f"quantization: {requested!r} needs a checkpoint quantized with it (config.json "
                             f"quantization_config.quant_method), and this one is not quantized; formats that "
                             f"quantize a full-precision checkpoint at load: {', '.join(LOAD_TIME_FORMATS)}")
        return _config_class(requested).from_config(None)
    if detected != requested:
        found = ("the model is a GGUF file (its tensor types are its format)" if detected == "gguf" else
                 f"the checkpoint is quantized as {detected!r} (config.json quantization_config)")
        raise ValueError(f"quantization: {requested!r} was requested but {found}; leave quantization unset or use "
                         f"{detected!r}")
    return _config_class(detected).from_config(qc)


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
