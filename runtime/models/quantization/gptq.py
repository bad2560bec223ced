"""``gptq``: GPTQ checkpoints (AutoGPTQ / GPTQModel layout), 4-bit any symmetry, 8-bit symmetric.

Layout per linear layer (input K, output N, group g, G = K/g groups; 8/bits values per int32):
  qweight int32 [K*bits/32, N]  packed along the input axis, value j of a word at bits j*bits
  qzeros  int32 [G, N*bits/32]  zero points packed along the output axis; the classic
                                ("gptq", v1) format stores zero - 1, "gptq_v2" the zero itself
  scales  fp16  [G, N]
  g_idx   int32 [K]             each input feature's group (act-order permutes it; optional)
and w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].

With act-order (desc_act) the groups are scattered over the input features: the input features
are permuted once at load so that every group is contiguous (the activations are gathered with
the same permutation at each call), which makes the weight a plain `Int4Weight`. A row-parallel
layer cannot be split between ranks then (its groups span the whole input), so act-order
checkpoints run at tensor_parallel_size 1 only where a row-parallel layer exists.
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
from kvserve.runtime.models.quantization.int4 import check_group, set_int4
from kvserve.runtime.models.quantization.int8 import set_int8
from kvserve.runtime.models.quantization.packed import Int4Weight, Int8Weight
from kvserve.runtime.models.quantization.unquantized import UNQUANTIZED
from kvserve.runtime.weight_formats.gptq import GPTQFormat


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R*bits/32, C] -> [R, C]: value j of each word (bits j*bits) is row 32/bits*r + j."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    vals = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols_seq(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C*bits/32] -> [R, C], sequential order (value j at bits j*bits)."""
    return unpack_rows(packed.t().contiguous(), bits).t()


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `unpack_rows` (used to write test checkpoints)."""
    per = 32 // bits
    r, c = values.shape
    v = values.to(torch.int64).view(r // per, per, c)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)[None, :, None]
    return ((v << shifts).sum(1) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)


def pack_cols_seq(values: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_rows(values.t().contiguous(), bits).t().contiguous()


def load_part_g_idx(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    """One row per fused part: its g_idx, sliced to this rank's input features."""
    spec: LinearSpec = param.spec
    i = spec.part_index(shard_id)
    if tuple(loaded.shape) != (spec.input_size,):
        raise ValueError(f"weight {spec.prefixes[i]}.g_idx: checkpoint shape {tuple(loaded.shape)} does not match "
                         f"the layout (expected ({spec.input_size},))")
    start, size = spec.input_slice
    param.data[i] = loaded[start:start + size]


def fused_g_idx(rows: torch.Tensor, spec: LinearSpec, what: str) -> torch.Tensor:
    """The g_idx shared by a fused layer's parts (they see the same input, so act-order gives
    them the same order); parts that disagree cannot share one matmul."""
    loaded = [r for r in rows if not (r < 0).all()]
    if loaded and any(not torch.equal(r, loaded[0]) for r in loaded[1:]):
        raise ValueError(f"{spec.name}: the fused parts have different {what} (act-order permutations); they "
                         "cannot run as one matmul")
    return (loaded[0] if loaded else rows[0]).long()


class GPTQLinearMethod(LinearMethod):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, v2: bool):
        self.bits, self.group_size, self.desc_act, self.sym, self.v2 = bits, group_size, desc_act, sym, v2

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        per = 32 // self.bits
        n, k = spec.out_features, spec.in_features
        g = self.group_size if self.group_size != -1 else spec.input_size
        if self.desc_act and spec.input_is_sharded:
            raise ValueError(f"tensor_parallel_size {spec.tp_size}: gptq act-order (desc_act) groups span all "
                             f"{spec.input_size} input features of {spec.name}, so a row-parallel split would "
                             "split them; use tensor_parallel_size 1 or a checkpoint without act-order")
        check_group(spec, g, "gptq")
        if k % per or n % per:
            raise ValueError(f"gptq: {spec.name} ({n} x {k} on this rank) is not a multiple of {per} values per int32")
        layer.gptq_group = g
        sharded_param(layer, "qweight", spec, (k // per, n), torch.int32, out_dim=1, in_dim=0, in_div=per)
        sharded_param(layer, "qzeros", spec, (k // g, n // per), torch.int32, out_dim=1, out_div=per,
                      in_dim=0, in_div=g)
        sharded_param(layer, "scales", spec, (k // g, n), torch.float32, out_dim=1, in_dim=0, in_div=g)
        sharded_param(layer, "g_idx", spec, (len(spec.output_slices), k), torch.int32, optional=True, fill=-1,
                      loader=load_part_g_idx)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        spec: LinearSpec = layer.spec
        g = layer.gptq_group
        q = unpack_rows(layer.qweight.data, self.bits)  # [K, N]
        zeros = unpack_cols_seq(layer.qzeros.data, self.bits)  # [G, N]
        if not self.v2:
            zeros = zeros + 1
        scale = layer.scales.data.float()
        k = q.shape[0]
        g_idx = fused_g_idx(layer.g_idx.data, spec, "g_idx")
        start = spec.input_slice[0]
        plain = torch.arange(start, start + k, device=q.device) // g - start // g
        if (g_idx < 0).all():  # absent from the checkpoint: groups in input order
            g_idx = plain
        else:  # the checkpoint's groups are global; this rank's slice starts at group start // g
            g_idx = g_idx - start // g
        perm = None
        if not torch.equal(g_idx, plain):
            counts = torch.bincount(g_idx, minlength=k // g)
            if g_idx.min() < 0 or g_idx.max() >= k // g or not (counts == g).all():
                raise ValueError(f"gptq: {spec.name}.g_idx does not assign {g} input features to each of the "
                                 f"{k // g} groups; the checkpoint's layout does not match its quantization_config")
            perm = torch.argsort(g_idx, stable=True)
            q = q[perm]
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            replace_param(layer, name, None)
        if perm is not None:
            replace_param(layer, "input_perm", perm)
        layer.gptq_perm = perm
        qt, zt, st = q.t().contiguous(), zeros.t().float(), scale.t().contiguous()
        if self.bits == 4:
            set_int4(layer, Int4Weight(qt.to(torch.uint8), st, -zt * st, g, spec.params_dtype, what=spec.name))
        else:  # symmetric 8-bit: the zero is 128 everywhere (checked by the config)
            if not torch.all(zt == 128):
                raise ValueError(f"gptq: {spec.name} has 8-bit zero points other than 128; only symmetric 8-bit "
                                 "GPTQ is supported")
            set_int8(layer, Int8Weight((qt.to(torch.int16) - 128).to(torch.int8), st, g, spec.params_dtype,
                                       what=spec.name))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.gptq_perm is not None:
            x = x[..., layer.gptq_perm]
        out = layer.int4.matmul(x) if self.bits == 4 else layer.int8.matmul(x)
        return out + bias if bias is not None else out


class GPTQConfig(GPTQFormat, QuantizationConfig):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        if spec.role == "lm_head":
            return UNQUANTIZED
        return GPTQLinearMethod(self.bits, self.group_size, self.desc_act, self.sym, self.v2)
