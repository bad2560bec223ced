"""``bitsandbytes``: pre-quantized 4-bit (NF4/FP4, double quantization) and 8-bit checkpoints.

Layout per linear layer, as transformers saves a bitsandbytes model (checkpoint tensors under
the layer's prefix):

4-bit  ``weight``                    uint8 [N * K / 2, 1]: the row-major [N, K] codes, two per byte
                                     (the first in the high nibble)
       ``weight.absmax``             one scale per block of ``blocksize`` (64) codes of the flat
                                     weight: float32, or with double quantization uint8 codes of
       ``weight.nested_quant_map``   a 256-value codebook, times ``weight.nested_absmax`` (one per
                                     256 blocks), plus the state's ``nested_offset``
       ``weight.quant_map``          the 16-value codebook (NF4 or FP4)
       ``weight.quant_state.bitsandbytes__<type>``  JSON (as uint8): type, blocksize, dtype, shape,
                                     nested_blocksize, nested_offset
       value = quant_map[code] * absmax[block]
8-bit  ``weight`` int8 [N, K], ``SCB`` float32 [N] (row absmax), ``weight_format`` (0: row-major)
       value = code * SCB / 127

4-bit layers stay packed (`bnb4.Packed4bitWeight`: this rank's codes and float32 absmax,
dequantized slab by slab per matmul) when the rank's slice holds whole blocks of each row (the
flat blocks run across rows, so a row must be a whole number of blocks); otherwise they are
dequantized at load (whole tensor, then the slice) into the unquantized path. 8-bit ones become
the canonical per-channel `Int8Weight`.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from kvserve.runtime.models.quantization.base import (
    LinearMethod,
    LinearSpec,
    QuantizationConfig,
    replace_param,
    sharded_param,
)
from kvserve.runtime.models.quantization.bnb4 import Packed4bitWeight
from kvserve.runtime.models.quantization.int8 import Int8Applier, set_int8
from kvserve.runtime.models.quantization.packed import Int8Weight
from kvserve.runtime.models.quantization.unquantized import UNQUANTIZED, UnquantizedLinearMethod
from kvserve.runtime.weight_formats.bitsandbytes import BitsAndBytesFormat


def dequantize_4bit(packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, state: dict,
                    nested_absmax: torch.Tensor | None = None,
                    nested_quant_map: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight (state["shape"]) a bitsandbytes 4-bit checkpoint tensor encodes."""
    shape = tuple(int(s) for s in state["shape"])
    n = 1
    for s in shape:
        n *= s
    block = int(state["blocksize"])
    absmax = resolve_absmax(absmax, state, n, nested_absmax, nested_quant_map)
    flat = packed.reshape(-1)
    if flat.numel() * 2 < n:
        raise ValueError(f"bitsandbytes: {flat.numel()} bytes hold {2 * flat.numel()} codes, the shape {shape} "
                         f"needs {n}")
    codes = torch.stack(((flat >> 4) & 0xF, flat & 0xF), dim=1).reshape(-1)[:n].long()
    values = quant_map.float()[codes] * absmax.repeat_interleave(block)[:n]
    return values.reshape(shape)


def resolve_absmax(absmax: torch.Tensor, state: dict, n: int, nested_absmax: torch.Tensor | None = None,
                   nested_quant_map: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [blocks]: one scale per block of the n codes, double quantization undone."""
    block = int(state["blocksize"])
    blocks = -(-n // block)
    if absmax.numel() != blocks:
        raise ValueError(f"bitsandbytes: {blocks} blocks of {block} need as many absmax values, got {absmax.numel()}")
    if "nested_blocksize" in state:
        if nested_absmax is None or nested_quant_map is None:
            raise ValueError("bitsandbytes: a double-quantized tensor needs nested_absmax and nested_quant_map")
        nb = int(state["nested_blocksize"])
        scales = nested_quant_map.float()[absmax.reshape(-1).long()]
        per_block = nested_absmax.float().reshape(-1).repeat_interleave(nb)[: scales.numel()]
        absmax = scales * per_block + float(state.get("nested_offset", 0.0))
    return absmax.float().reshape(-1)


class _Staged:
    """Collects a layer's checkpoint tensors whole, per fused part, for process_weights_after_loading
    (a bitsandbytes tensor cannot be sliced for a tensor-parallel rank before it is decoded)."""

    @staticmethod
    def param(layer: nn.Module, spec: LinearSpec, name: str, suffix: str, dtype: torch.dtype) -> None:
        def stash(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
            layer.bnb_parts.setdefault(spec.part_index(shard_id), {})[suffix] = loaded.clone()

        p = sharded_param(layer, name, spec, (0,), dtype, fill=None, loader=stash)
        p.load_dtype = dtype
        p.checkpoint_suffix = suffix


def _dequantized(layer: nn.Module, spec: LinearSpec, part: int, decode) -> torch.Tensor:
    """This rank's rows and columns of fused part `part`, decoded from its whole checkpoint tensors."""
    staged = layer.bnb_parts.get(part)
    if staged is None:
        raise ValueError(f"weight {spec.prefixes[part]}: no bitsandbytes tensors were loaded")
    full = decode(staged, spec.prefixes[part])
    if full.shape != (spec.output_sizes[part], spec.input_size):
        raise ValueError(f"weight {spec.prefixes[part]}: bitsandbytes shape {tuple(full.shape)} does not match "
                         f"the layer ({spec.output_sizes[part]}, {spec.input_size})")
    start, size = spec.output_slices[part]
    in_start, in_size = spec.input_slice
    return full[start:start + size, in_start:in_start + in_size]


class BnB4bitMethod(UnquantizedLinearMethod):
    """Kept packed (`Packed4bitWeight`, dequantized per matmul) where this rank's slice holds
    whole blocks of each row; otherwise, or with `keep_packed` off, dequantized once at load into
    the unquantized path (native CPU panels included)."""

    name = "bitsandbytes"
    #: False: hold every 4-bit layer dequantized (the faster matmul, the compute dtype's memory).
    keep_packed = True

    def __init__(self, quant_type: str, double_quant: bool):
        self.quant_type, self.double_quant = quant_type, double_quant

    def _state(self, staged: dict, what: str) -> dict:
        try:
            state = json.loads(bytes(staged[f"weight.quant_state.bitsandbytes__{self.quant_type}"].tolist()))
        except ValueError:
            raise ValueError(f"weight {what}: its bitsandbytes quant_state is not JSON") from None
        if state.get("quant_type") != self.quant_type:
            raise ValueError(f"weight {what}: quant_state says {state.get('quant_type')!r}, quantization_config."
                             f"bnb_4bit_quant_type says {self.quant_type!r}")
        if ("nested_blocksize" in state) != self.double_quant:
            raise ValueError(f"weight {what}: double quantization in the tensor and quantization_config."
                             f"bnb_4bit_use_double_quant ({self.double_quant}) disagree")
        return state

    def _packed_part(self, layer: nn.Module, spec: LinearSpec, part: int):
        """(codes [rows, cols / 2], absmax [rows, cols / block], quant_map, block) of this rank's
        slice of fused part `part`, or None when the slice would split a block or a byte."""
        staged = layer.bnb_parts.get(part)
        if staged is None:
            raise ValueError(f"weight {spec.prefixes[part]}: no bitsandbytes tensors were loaded")
        what = spec.prefixes[part]
        state = self._state(staged, what)
        shape = tuple(int(s) for s in state["shape"])
        if shape != (spec.output_sizes[part], spec.input_size):
            raise ValueError(f"weight {what}: bitsandbytes shape {shape} does not match the layer "
                             f"({spec.output_sizes[part]}, {spec.input_size})")
        n, k = shape
        block = int(state["blocksize"])
        in_start, in_size = spec.input_slice
        if k % block or in_start % block or in_size % block or block % 2:
            return None
        flat = staged["weight"].reshape(-1)
        if flat.numel() * 2 != n * k:
            raise ValueError(f"weight {what}: {flat.numel()} bytes hold {2 * flat.numel()} codes, the shape "
                             f"{shape} needs {n * k}")
        absmax = resolve_absmax(staged["weight.absmax"], state, n * k, staged.get("weight.nested_absmax"),
                                staged.get("weight.nested_quant_map")).view(n, k // block)
        start, size = spec.output_slices[part]
        codes = flat.view(n, k // 2)[start:start + size, in_start // 2:(in_start + in_size) // 2]
        absmax = absmax[start:start + size, in_start // block:(in_start + in_size) // block]
        return codes, absmax, staged["weight.quant_map"].float().reshape(-1), block

    def _keep_packed(self, layer: nn.Module) -> bool:
        """Holds the layer as a Packed4bitWeight when every part's slice is block-aligned and the
        parts share one codebook and block size."""
        spec: LinearSpec = layer.spec
        parts = [self._packed_part(layer, spec, i) for i in range(len(spec.prefixes))]
        if any(p is None for p in parts) or len({p[3] for p in parts}) != 1:
            return False
        quant_map = parts[0][2]
        if any(not torch.equal(p[2], quant_map) for p in parts):
            return False
        block = parts[0][3]
        n, k = spec.out_features, spec.in_features
        codes = torch.zeros(n, k // 2, dtype=torch.uint8, device=spec.device)
        absmax = torch.zeros(n, k // block, dtype=torch.float32, device=spec.device)
        for offset, (c, a, _, _) in zip(spec.output_offsets, parts):
            codes[offset:offset + c.shape[0]] = c
            absmax[offset:offset + a.shape[0]] = a
        weight = Packed4bitWeight(codes, absmax, quant_map.to(spec.device), block, spec.params_dtype,
                                  what=spec.name)
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            replace_param(layer, name, None)
        del layer.bnb_parts
        layer.bnb4 = weight
        for name, t in weight.tensors().items():
            replace_param(layer, name, t)
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = getattr(layer, "bnb4", None)
        if packed is None:
            return super().apply(layer, x, bias)
        out = packed.matmul(x)
        return out + bias if bias is not None else out

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        packed = getattr(layer, "bnb4", None)
        return super().embed(layer, ids) if packed is None else packed.rows(ids)

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        layer.bnb_parts = {}
        _Staged.param(layer, spec, "weight", "weight", torch.uint8)
        _Staged.param(layer, spec, "bnb_absmax", "weight.absmax",
                      torch.uint8 if self.double_quant else torch.float32)
        _Staged.param(layer, spec, "bnb_quant_map", "weight.quant_map", torch.float32)
        _Staged.param(layer, spec, "bnb_quant_state", f"weight.quant_state.bitsandbytes__{self.quant_type}",
                      torch.uint8)
        if self.double_quant:
            _Staged.param(layer, spec, "bnb_nested_absmax", "weight.nested_absmax", torch.float32)
            _Staged.param(layer, spec, "bnb_nested_quant_map", "weight.nested_quant_map", torch.float32)

    def _decode(self, staged: dict, what: str) -> torch.Tensor:
        state = self._state(staged, what)
        return dequantize_4bit(staged["weight"], staged["weight.absmax"], staged["weight.quant_map"], state,
                               staged.get("weight.nested_absmax"), staged.get("weight.nested_quant_map"))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.keep_packed and self._keep_packed(layer):
            return
        spec: LinearSpec = layer.spec
        rows = [_dequantized(layer, spec, i, self._decode) for i in range(len(spec.prefixes))]
        weight = torch.zeros(spec.out_features, spec.in_features, dtype=spec.params_dtype, device=spec.device)
        for offset, part in zip(spec.output_offsets, rows):
            weight[offset:offset + part.shape[0]] = part.to(spec.params_dtype)
        for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
            replace_param(layer, name, None)
        del layer.bnb_parts
        replace_param(layer, "weight", weight)
        super().process_weights_after_loading(layer)


class BnB8bitMethod(Int8Applier):
    name = "bitsandbytes"

    def create_weights(self, layer: nn.Module, spec: LinearSpec) -> None:
        n, k = spec.out_features, spec.in_features
        w = sharded_param(layer, "weight", spec, (n, k), torch.int8, out_dim=0, in_dim=1)
        w.load_dtype = torch.int8
        scb = sharded_param(layer, "SCB", spec, (n,), torch.float32, out_dim=0, shard_input=False)
        scb.load_dtype = torch.float32

        def check_format(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
            if loaded.numel() != 1 or int(loaded.reshape(-1)[0]) != 0:
                raise ValueError(f"weight {spec.name}: bitsandbytes weight_format {loaded.tolist()} is not "
                                 "supported; supported: 0 (row-major)")

        fmt = sharded_param(layer, "weight_format", spec, (0,), torch.uint8, fill=None, optional=True,
                            loader=check_format)
        fmt.load_dtype = torch.uint8

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        spec: LinearSpec = layer.spec
        scale = (layer.SCB.data.float() / 127.0)[:, None]
        weight = Int8Weight(layer.weight.data, scale, spec.in_features, spec.params_dtype, what=spec.name)
        for name in ("weight", "SCB", "weight_format"):
            replace_param(layer, name, None)
        set_int8(layer, weight)


class BitsAndBytesConfig(BitsAndBytesFormat, QuantizationConfig):
    def get_linear_method(self, spec: LinearSpec) -> LinearMethod:
        if spec.role == "lm_head" or any(m in p for p in spec.prefixes for m in self.skip_modules):
            return UNQUANTIZED
        if self.bits == 8:
            return BnB8bitMethod()
        return BnB4bitMethod(self.quant_type, self.double_quant)
