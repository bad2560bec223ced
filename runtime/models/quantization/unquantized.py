"""Full-precision weights: one [out, in] matrix per layer in the compute dtype."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.runtime.models.quantization.base import LinearMethod, LinearSpec, QuantizationConfig, sharded_param


class UnquantizedLinearMethod(LinearMethod):
    """``F.linear`` on the checkpoint's ``weight`` (cast to the compute dtype at load).

    float32 on the CPU: after loading, the weight is repacked once into the panels of the native
    matmul kernel (kvserve.kernels.cpu), which replace it (``layer.weight`` becomes the
    [ceil(out / 16), in, 16] panels and ``layer.packed_out_features`` says so). A decode step
    then streams every weight sequentially at close to the memory bandwidth, and each output is
    summed in the same order whatever the batch size. A layer whose raw [out, in] weight is read
    elsewhere sets ``keeps_raw_weight = True`` and keeps F.linear.
    """

    name = "unquantized"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        sharded_param(layer, "weight", spec, (spec.out_features, spec.in_features), spec.params_dtype,
                      out_dim=0, in_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        if (w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2
                or getattr(layer, "keeps_raw_weight", False)):
            return
        from kvserve.kernels import ops

        if not ops.use_native(w):
            return
        from kvserve.kernels.cpu import native

        packed = nn.Parameter(native.pack_weight(w.data), requires_grad=False)
        for key, value in vars(w).items():  # weight_loader and the sharding attributes
            setattr(packed, key, value)
        layer.packed_out_features = w.shape[0]
        layer.weight = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n = getattr(layer, "packed_out_features", None)
        if n is not None:
            from kvserve.kernels.cpu import native

            return native.linear(x, layer.weight, n, bias)
        return F.linear(x, layer.weight, bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "packed_out_features", None) is not None:
            from kvserve.kernels.cpu import native

            return native.unpack_rows(layer.weight, ids).view(*ids.shape, layer.weight.shape[1])
        return F.embedding(ids, layer.weight)


UNQUANTIZED = UnquantizedLinearMethod()


class UnquantizedConfig(QuantizationConfig):
    name = "none"

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        return UNQUANTIZED
