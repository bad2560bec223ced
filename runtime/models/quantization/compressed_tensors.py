"""``compressed-tensors``: llm-compressor's checkpoint format (what vLLM recommends producing).

config.json's quantization_config lists ``config_groups``, each with ``targets`` (``Linear``,
module names, or ``re:`` regexes), weight arguments and optional input-activation arguments, plus
an ``ignore`` list. Supported schemes:

- W4A16 / W8A16, ``pack-quantized``: ``weight_packed`` int32 [N, K*bits/32] (values along the
  input axis, value j of a word at bits j*bits, stored with a +2^(bits-1) offset),
  ``weight_scale`` [N, K/g] (one column for per-channel), ``weight_zero_point`` (asymmetric only)
  packed the same way along the output axis [N*bits/32, K/g], ``weight_shape`` [2], and with
  act-order ``weight_g_idx`` [K]; w = (q - zero) * scale with q and zero signed.
  4-bit becomes `Int4Weight`, symmetric 8-bit `Int8Weight`.
- W8A8 FP8, ``float-quantized``: ``weight`` float8_e4m3fn with a per-channel or per-tensor
  ``weight_scale``; activations per token (dynamic) or with ``input_scale`` (static). See `fp8`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvserve.runtime.models.quantization.base import (
    LinearMethod,
    LinearSpec,
    QuantizationConfig,
    replace_param,
    sharded_param,
)
from kvserve.runtime.models.quantization.fp8 import Fp8LinearMethod, device_has_fp8
from kvserve.runtime.models.quantization.gptq import fused_g_idx, load_part_g_idx, unpack_cols_seq
from kvserve.runtime.models.quantization.int4 import check_group, set_int4
from kvserve.runtime.models.quantization.int8 import set_int8
from kvserve.runtime.models.quantization.packed import Int4Weight, Int8Weight
from kvserve.runtime.models.quantization.unquantized import UNQUANTIZED
from kvserve.runtime.weight_formats.compressed_tensors import CompressedTensorsFormat, SchemeGroup


class CTPackedMethod(LinearMethod):
    """pack-quantized W4A16/W8A16."""

    name = "compressed-tensors"

    def __init__(self, bits: int, group_size: int | None, symmetric: bool, actorder: bool):
        self.bits, self.group_size, self.symmetric, self.actorder = bits, group_size, symmetric, actorder

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        per = 32 // self.bits
        n, k = spec.out_features, spec.in_features
        g = self.group_size or spec.input_size  # channel strategy: one group spanning the input
        if self.actorder and spec.input_is_sharded:
            raise ValueError(f"tensor_parallel_size {spec.tp_size}: compressed-tensors act-order groups span all "
                             f"{spec.input_size} input features of {spec.name}; use tensor_parallel_size 1")
        check_group(spec, g, "compressed-tensors")
        if k % per or (not self.symmetric and n % per):
            raise ValueError(f"compressed-tensors: {spec.name} ({n} x {k} on this rank) does not pack {per} values "
                             "per int32")
        layer.ct_group = g
        sharded_param(layer, "weight_packed", spec, (n, k // per), torch.int32, out_dim=0, in_dim=1, in_div=per)
        sharded_param(layer, "weight_scale", spec, (n, k // g), torch.float32, out_dim=0, in_dim=1, in_div=g)
        sharded_param(layer, "weight_shape", spec, (2,), torch.int64, loader=_check_shape)
        if not self.symmetric:
            sharded_param(layer, "weight_zero_point", spec, (n // per, k // g), torch.int32, out_dim=0, out_div=per,
                          in_dim=1, in_div=g)
        if self.actorder:
            sharded_param(layer, "weight_g_idx", spec, (len(spec.output_slices), k), torch.int32, optional=True,
                          fill=-1, loader=load_part_g_idx)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        spec: LinearSpec = layer.spec
        g, offset_bias = layer.ct_group, 1 << (self.bits - 1)
        q = unpack_cols_seq(layer.weight_packed.data, self.bits)  # [N, K] unsigned (q + 2^(bits-1))
        scale = layer.weight_scale.data.float()
        if self.symmetric:
            zero = torch.full_like(scale, float(offset_bias))
        else:  # packed along the output axis with the same +2^(bits-1) offset as the values
            zero = unpack_cols_seq(layer.weight_zero_point.data.t().contiguous(), self.bits).t().float()
        perm = None
        if self.actorder:
            g_idx = fused_g_idx(layer.weight_g_idx.data, spec, "weight_g_idx")
            k = q.shape[1]
            if not (g_idx < 0).all() and not torch.equal(g_idx, torch.arange(k, device=q.device) // g):
                perm = torch.argsort(g_idx, stable=True)
                if not (torch.bincount(g_idx, minlength=k // g) == g).all():
                    raise ValueError(f"compressed-tensors: {spec.name}.weight_g_idx does not put {g} input features "
                                     "in every group")
                q = q[:, perm]
        for name in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"):
            replace_param(layer, name, None)
        if perm is not None:
            replace_param(layer, "input_perm", perm)
        layer.ct_perm = perm
        if self.bits == 4:
            set_int4(layer, Int4Weight(q.to(torch.uint8), scale, -zero * scale, g, spec.params_dtype, what=spec.name))
        else:
            set_int8(layer, Int8Weight((q - offset_bias).to(torch.int8), scale, g, spec.params_dtype, what=spec.name))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.ct_perm is not None:
            x = x[..., layer.ct_perm]
        out = layer.int4.matmul(x) if self.bits == 4 else layer.int8.matmul(x)
        return out + bias if bias is not None else out


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    spec: LinearSpec = param.spec
    i = spec.part_index(shard_id)
    want = (spec.output_sizes[i], spec.input_size)
    if tuple(int(v) for v in loaded.reshape(-1).tolist()) != want:
        raise ValueError(f"weight {spec.prefixes[i]}.weight_shape: checkpoint says {loaded.tolist()}, the model "
                         f"config implies {list(want)}")


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith("." + target)


class CompressedTensorsConfig(CompressedTensorsFormat, QuantizationConfig):
    def check_supported(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type == "cuda" and any(g.kind == "fp8" and g.w8a8 for g in self.groups) \
                and not device_has_fp8(device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise ValueError(f"quantization: this compressed-tensors checkpoint is FP8 W8A8, which needs a GPU with "
                             f"FP8 matmuls (compute capability >= 8.9); {device} is {cap}. Use a newer GPU, or "
                             "device='cpu' (exact, slow)")

    def _group_for(self, name: str) -> SchemeGroup | None:
        if any(_matches(i, name) for i in self.ignore):
            return None
        for group in self.groups:
            if any(t == "Linear" or _matches(t, name) for t in group.targets):
                return group
        return None

    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        chosen = [self._group_for(p) for p in spec.prefixes]
        if spec.role == "lm_head" and not any(
                _matches(t, p) for g in self.groups for t in g.targets for p in spec.prefixes):
            chosen = [None]  # "Linear" targets never cover the embedding table
        if any(c is not chosen[0] for c in chosen):
            raise ValueError(f"quantization: compressed-tensors quantizes the fused parts of {spec.name} "
                             "differently; kvserve needs them in one scheme")
        group = chosen[0]
        if group is None:
            return UNQUANTIZED
        if spec.role == "lm_head":
            raise ValueError("quantization: a compressed-tensors quantized LM head is not supported")
        if group.kind == "fp8":
            return Fp8LinearMethod(from_checkpoint=True, per_channel=group.per_channel,
                                   static_input=group.static_input, w8a8=group.w8a8)
        return CTPackedMethod(group.bits, group.group_size, group.symmetric, group.actorder)
