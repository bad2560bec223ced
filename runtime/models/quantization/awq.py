"""``awq``: AutoAWQ's GEMM checkpoints (4-bit, group-wise, with zero points).

Layout per linear layer (input K, output N, group g):
  qweight int32 [K, N/8]   eight 4-bit values per int32 along the output axis, in AWQ's order:
                           nibble i of a word holds output column ORDER[i] of its 8 (0 2 4 6 1 3 5 7)
  qzeros  int32 [K/g, N/8] zero points, packed the same way
  scales  fp16  [K/g, N]
and w[n, k] = (q[k, n] - zero[k/g, n]) * scale[k/g, n]. At load every layer is unpacked into the
canonical `Int4Weight` (offset = -zero * scale). The LM head and embeddings stay full precision.
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
from kvserve.runtime.models.quantization.packed import Int4Weight
from kvserve.runtime.models.quantization.unquantized import UNQUANTIZED
from kvserve.runtime.weight_formats.awq import AWQFormat

PACK = 8
# Nibble i of a packed word holds column AWQ_ORDER[i] of its group of eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = AWQ_ORDER) -> torch.Tensor:
    """int32 [R, C/8] -> [R, C] 4-bit values, column j of each eight taken from its nibble."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 0xF  # [R, C/8, 8]: nibble i
    if order is not None:
        inverse = [order.index(c) for c in range(PACK)]
        nibbles = nibbles[..., inverse]
    return nibbles.reshape(packed.shape[0], -1)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] | None = AWQ_ORDER) -> torch.Tensor:
    """Inverse of `unpack_cols` (used to write test checkpoints)."""
    r, c = values.shape
    v = values.to(torch.int64).view(r, c // PACK, PACK)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return ((v << shifts).sum(-1) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)


class AWQLinearMethod(Int4Applier):
    name = "awq"

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        g = self.group_size
        check_group(spec, g, "awq")
        n, k = spec.out_features, spec.in_features
        if n % PACK:
            raise ValueError(f"awq: {spec.name} has {n} output features on this rank, not a multiple of {PACK}")
        sharded_param(layer, "qweight", spec, (k, n // PACK), torch.int32, out_dim=1, out_div=PACK, in_dim=0)
        sharded_param(layer, "qzeros", spec, (k // g, n // PACK), torch.int32, out_dim=1, out_div=PACK,
                      in_dim=0, in_div=g)
        sharded_param(layer, "scales", spec, (k // g, n), torch.float32, out_dim=1, in_dim=0, in_div=g)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_cols(layer.qweight.data).t()  # [N, K]
        zeros = unpack_cols(layer.qzeros.data).t().float()  # [N, K/g]
        scale = layer.scales.data.t().float()
        weight = Int4Weight(q.to(torch.uint8), scale, -zeros * scale, self.group_size, layer.spec.params_dtype,
                            what=layer.spec.name)
        for name in ("qweight", "qzeros", "scales"):
            replace_param(layer, name, None)
        set_int4(layer, weight)


class AWQConfig(AWQFormat, QuantizationConfig):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        if spec.role == "lm_head" or any(m in p for p in spec.prefixes for m in self.modules_to_not_convert):
            return UNQUANTIZED
        return AWQLinearMethod(self.group_size)
