"""``int8``: weight-only int8 quantization of a full-precision checkpoint at load time.

Per output channel, symmetric (absmax / 127). Every linear layer, the LM head and the embedding
table are quantized; activations stay in the compute dtype (see `packed` for the CPU kernel's
bfloat16 inputs).
"""

from __future__ import annotations

from torch import nn

from kvserve.runtime.models.quantization.base import (
    LinearMethod,
    LinearSpec,
    PackedWeightApplier,
    QuantizationConfig,
    replace_param,
)
from kvserve.runtime.models.quantization.packed import Int8Weight, quantize_int8
from kvserve.runtime.models.quantization.unquantized import UnquantizedLinearMethod
from kvserve.runtime.weight_formats.int8 import Int8Format


class Int8Applier(PackedWeightApplier):
    """apply/embed for every method whose layers end up holding an `Int8Weight`."""

    weight_attr = "int8"


class Int8WeightOnlyMethod(Int8Applier):
    name = "int8"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        UnquantizedLinearMethod().create_weights(layer, spec)  # the checkpoint's float weight, then:

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        q, scale = quantize_int8(w, w.shape[1])
        set_int8(layer, Int8Weight(q, scale, w.shape[1], layer.weight.dtype, what=layer.spec.name))
        replace_param(layer, "weight", None)


def set_int8(layer: nn.Module, weight: Int8Weight) -> None:
    """Keeps an `Int8Weight` on the layer, its tensors registered as parameters (memory, devices)."""
    layer.int8 = weight
    for name, t in weight.tensors().items():
        replace_param(layer, name, t)


class Int8Config(Int8Format, QuantizationConfig):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        return Int8WeightOnlyMethod()
