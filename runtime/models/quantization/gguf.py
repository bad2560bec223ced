"""``gguf``: the quantized tensors of a GGUF file, kept quantized where a kernel takes them.

A GGUF file chooses a type per tensor (a Q4_K_M file mixes Q4_K, Q6_K and F32), so the method is
chosen per layer from the file's types (``quantization_config.tensor_types``, which the GGUF
reader puts in the config): a layer whose parts (q|k|v, gate|up, one projection, the vocabulary
table) are all

- Q4_0, Q4_1 or Q4_K: `Int4Weight`, group 32, w = code * scale + offset (scale = d, offset = -8d
  for Q4_0; d and m for Q4_1; each 32-value sub-block's d * sc and -dmin * m for Q4_K);
- Q8_0 on a GPU, or on a CPU with kvserve's native kernels loaded: `Int8Weight`, group 32 (the
  Triton grouped int8 kernel; the native AVX2 int8 kernel). Otherwise on a CPU (torch's int8
  kernel is per-channel only) Q8_0 is dequantized at load (exactly) and multiplied by the
  unquantized path, which is faster than dequantizing every step;
- anything else (F32/F16/BF16, Q5_0/Q5_1/Q5_K/Q6_K, or a mix of families in one fused layer):
  dequantized once at load into the model dtype (`UnquantizedLinearMethod`).

The loader hands a kept tensor over as its group-wise integers (`kvserve.runtime.gguf.weights.
GroupQuantized`): ``<prefix>.weight`` gets the codes, ``<prefix>.gguf_scale`` / ``gguf_offset``
one value per 32 input features (so tensor parallelism refuses a degree that splits a block).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.runtime.models.quantization.base import (
    LinearMethod,
    LinearSpec,
    QuantizationConfig,
    replace_param,
    sharded_param,
)
from kvserve.runtime.models.quantization.int4 import Int4Applier, check_group, set_int4
from kvserve.runtime.models.quantization.int8 import Int8Applier, set_int8
from kvserve.runtime.models.quantization.packed import Int4Weight, Int8Weight, native_enabled
from kvserve.runtime.models.quantization.unquantized import UnquantizedLinearMethod
from kvserve.runtime.weight_formats.gguf import GROUP, INT4_TYPES, INT8_TYPES, GGUFFormat


def _group_params(layer: nn.Module, spec: LinearSpec, codes_dtype: torch.dtype, offsets: bool) -> None:
    check_group(spec, GROUP, "gguf")
    out, k = spec.out_features, spec.in_features
    codes = sharded_param(layer, "weight", spec, (out, k), codes_dtype, out_dim=0, in_dim=1)
    codes.load_dtype = codes_dtype
    codes.gguf_codes = True  # the loader then hands this layer its GroupQuantized form
    names = ("gguf_scale", "gguf_offset") if offsets else ("gguf_scale",)
    for name in names:
        p = sharded_param(layer, name, spec, (out, k // GROUP), torch.float32, out_dim=0, in_dim=1, in_div=GROUP)
        p.load_dtype = torch.float32


class GGUFInt4Method(Int4Applier):
    name = "gguf"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        _group_params(layer, spec, torch.uint8, offsets=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        spec = layer.spec
        set_int4(layer, Int4Weight(layer.weight.data, layer.gguf_scale.data, layer.gguf_offset.data, GROUP,
                                   spec.params_dtype, what=spec.name))
        for name in ("weight", "gguf_scale", "gguf_offset"):
            replace_param(layer, name, None)


class GGUFInt8Method(Int8Applier):
    name = "gguf"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        _group_params(layer, spec, torch.int8, offsets=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        spec = layer.spec
        set_int8(layer, Int8Weight(layer.weight.data, layer.gguf_scale.data, GROUP, spec.params_dtype,
                                   what=spec.name))
        for name in ("weight", "gguf_scale"):
            replace_param(layer, name, None)


class GGUFConfig(GGUFFormat, QuantizationConfig):
    def layer_types(self, spec: LinearSpec) -> set[str | None]:
        return {self.tensor_types.get(f"{prefix}.weight") for prefix in spec.prefixes}

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        types = self.layer_types(spec)
        if types <= INT4_TYPES:
            return GGUFInt4Method()
        if types <= INT8_TYPES and (spec.device.type == "cuda" or native_enabled(spec.device)):
            return GGUFInt8Method()
        return UnquantizedLinearMethod()
