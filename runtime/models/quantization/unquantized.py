"""Full-precision weights: one [out, in] matrix per layer in the compute dtype."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.runtime.models.quantization.base import LinearMethod, LinearSpec, QuantizationConfig, sharded_param


class UnquantizedLinearMethod(LinearMethod):
    """``F.linear`` on the checkpoint's ``weight`` (cast to the compute dtype at load)."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        sharded_param(layer, "weight", spec, (spec.out_features, spec.in_features), spec.params_dtype,
                      out_dim=0, in_dim=1)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


UNQUANTIZED = UnquantizedLinearMethod()


class UnquantizedConfig(QuantizationConfig):
    name = "none"

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        return UNQUANTIZED
