"""``int4``: weight-only int4 quantization of a full-precision checkpoint at load time.

Group-wise asymmetric min/max (w = q * scale + offset, q in 0..15) along the input features,
128 features per group by default; a layer whose input size 128 does not divide takes the
largest of 64 and 32 that does (SmolLM2's hidden size 576 = 9 x 64), and one that none divides
is refused. Every linear layer, the LM head and the embedding table are quantized.
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
from kvserve.runtime.models.quantization.packed import Int4Weight, quantize_int4
from kvserve.runtime.models.quantization.unquantized import UnquantizedLinearMethod
from kvserve.runtime.weight_formats.int4 import Int4Format, group_size_for


def check_group(spec: LinearSpec, group_size: int, fmt: str) -> None:
    """A rank's input slice must hold whole groups (row-parallel layers split the input)."""
    start, size = spec.input_slice
    if spec.input_size % group_size:
        raise ValueError(f"{fmt}: {spec.name} has {spec.input_size} input features, not a multiple of the "
                         f"group size {group_size}")
    if start % group_size or size % group_size:
        raise ValueError(f"tensor_parallel_size {spec.tp_size}: {spec.name} would split {fmt} quantization "
                         f"groups of {group_size} input features between ranks ({spec.input_size} input "
                         f"features, {size} per rank)")


def set_int4(layer: nn.Module, weight: Int4Weight) -> None:
    """Keeps an `Int4Weight` on the layer, its tensors registered as parameters (memory, devices)."""
    layer.int4 = weight
    for name, t in weight.tensors().items():
        replace_param(layer, name, t)


class Int4Applier(PackedWeightApplier):
    """apply/embed for every method whose layers end up holding an `Int4Weight`."""

    weight_attr = "int4"


class Int4WeightOnlyMethod(Int4Applier):
    name = "int4"

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        check_group(spec, self.group_size, "int4")
        UnquantizedLinearMethod().create_weights(layer, spec)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        q, scale, offset = quantize_int4(w, self.group_size)
        set_int4(layer, Int4Weight(q, scale, offset, self.group_size, w.dtype, what=layer.spec.name))
        replace_param(layer, "weight", None)


class Int4Config(Int4Format, QuantizationConfig):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        g = group_size_for(spec.input_size, self.group_size)
        if g is None:
            raise ValueError(f"quantization: int4 needs input sizes divisible by 32; {spec.name} has "
                             f"{spec.input_size}")
        return Int4WeightOnlyMethod(g)
