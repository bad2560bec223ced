"""GGUF tensor data as torch tensors: dequantized floats, or the group-wise integers of the block
types that map onto a weight-only quantized matmul.

Every block type of ggml quantizes along a row (the input features of a matrix) in blocks of 32
values, or 256-value super-blocks for the K types, so a matrix's rows are independent: a row
permutation (undoing llama.cpp's Q/K interleave) and a tensor-parallel split of output rows act on
quantized rows exactly as on float ones.

Group-wise forms (value = scale * code + offset, one scale and offset per 32 values of a row):

| type | block | code | scale | offset |
|------|-------|------|-------|--------|
| Q8_0 | fp16 d, 32 x int8 | int8 | d | none (symmetric) |
| Q4_0 | fp16 d, 32 x 4 bit | 0..15 | d | -8 d |
| Q4_1 | fp16 d, fp16 m, 32 x 4 bit | 0..15 | d | m |
| Q4_K | 256-value super-block: fp16 d, dmin, 8 x 6-bit (scale, min), 256 x 4 bit | 0..15 | d * sc | -dmin * m |

Q4_K's eight sub-blocks of 32 are exactly group-32 scale + min, so it maps like Q4_1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

GROUP = 32

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# Types with a group-wise integer form (kept quantized where a linear method takes it).
GROUPWISE_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K)
# Types that are dequantized once at load (the gguf package's dequantizers), tested here.
DEQUANTIZED_TYPES = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)
SUPPORTED_TYPES = FLOAT_TYPES + GROUPWISE_TYPES + DEQUANTIZED_TYPES
SUPPORTED_NAMES = tuple(t.name for t in SUPPORTED_TYPES)


def check_supported(name: str, ggml_type: T) -> None:
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"model: GGUF tensor {name!r} has type {ggml_type.name}, which is not supported; "
                         f"supported types: {', '.join(SUPPORTED_NAMES)}")


@dataclass
class GroupQuantized:
    """A matrix [rows, cols] as value = scales * codes + offsets per group of 32 columns."""

    codes: torch.Tensor  # int8 (Q8_0: -128..127) or uint8 (4-bit types: 0..15), [rows, cols]
    scales: torch.Tensor  # float32 [rows, cols // 32]
    offsets: torch.Tensor | None  # float32 [rows, cols // 32]; None when symmetric (Q8_0)
    bits: int  # 8 or 4
    ggml_type: T

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], equal to the gguf package's dequantization of the same blocks
        (numpy: about twice as fast as torch's uint8 -> float broadcast on CPU)."""
        rows, cols = self.codes.shape
        out = self.codes.numpy().reshape(rows, cols // GROUP, GROUP).astype(np.float32)
        out *= self.scales.numpy()[..., None]
        if self.offsets is not None:
            out += self.offsets.numpy()[..., None]
        return torch.from_numpy(out.reshape(rows, cols))

    def permute_rows(self, index: torch.Tensor) -> GroupQuantized:
        return GroupQuantized(take_rows(self.codes, index), take_rows(self.scales, index),
                              None if self.offsets is None else take_rows(self.offsets, index), self.bits,
                              self.ggml_type)


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along the first axis, through numpy: torch's CPU row gather of small dtypes is
    hundreds of times slower (20 ms vs 0.05 ms for a 576 x 576 uint8 matrix here)."""
    if t.dtype == torch.bfloat16:
        return take_rows(t.view(torch.int16), index).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(t.numpy()[index.numpy()]))


def to_float(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor's values as torch (F16/BF16 keep their type; everything else float32)."""
    if ggml_type == T.F32:
        return torch.from_numpy(raw.view(np.float32).reshape(shape).copy())
    if ggml_type == T.F16:
        return torch.from_numpy(raw.view(np.float16).reshape(shape).copy())
    if ggml_type == T.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(shape).copy()).view(torch.bfloat16)
    if ggml_type in GROUPWISE_TYPES:  # torch unpacking is faster than the numpy reference
        rows = math.prod(shape[:-1])  # rows of a 3-D tensor (stacked experts) are rows all the same
        return group_quantized(raw, ggml_type, (rows, shape[-1])).dequantize().reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, ggml_type)).reshape(shape))


def group_quantized(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> GroupQuantized:
    """Unpacks a Q8_0 / Q4_0 / Q4_1 / Q4_K matrix into its group-wise integer form (numpy: its
    uint8 shifts and concatenations run several times faster than torch's on CPU)."""
    if len(shape) != 2:
        raise ValueError(f"expected a matrix, got shape {shape}")
    rows, cols = shape
    data = np.asarray(raw).reshape(rows, -1)
    if ggml_type == T.Q8_0:  # 34 bytes: fp16 d, 32 x int8
        blocks = data.reshape(rows, cols // 32, 34)
        codes = blocks[..., 2:].view(np.int8).reshape(rows, cols)
        return GroupQuantized(torch.from_numpy(codes.copy()), _f16(blocks[..., 0:2]), None, 8, ggml_type)
    if ggml_type in (T.Q4_0, T.Q4_1):  # 18 / 20 bytes: fp16 d (, fp16 m), 16 bytes of nibbles
        width = 18 if ggml_type == T.Q4_0 else 20
        blocks = data.reshape(rows, cols // 32, width)
        d = _f16(blocks[..., 0:2])
        offsets = -8.0 * d if ggml_type == T.Q4_0 else _f16(blocks[..., 2:4])
        packed = blocks[..., width - 16:]
        # Values 0..15 of a block are the low nibbles, 16..31 the high ones.
        codes = np.concatenate((packed & 0xF, packed >> 4), axis=-1).reshape(rows, cols)
        return GroupQuantized(torch.from_numpy(codes), d, offsets, 4, ggml_type)
    if ggml_type == T.Q4_K:  # 144 bytes per 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
        blocks = data.reshape(rows, cols // 256, 144)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, m = _k_scales_mins(blocks[..., 4:16])  # [rows, supers, 8] each
        q = blocks[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
        # 64 values per 32 bytes: the low nibbles are sub-block 2c, the high ones sub-block 2c + 1.
        codes = np.concatenate((q & 0xF, q >> 4), axis=3).reshape(rows, cols)
        scales = (d[..., None] * torch.from_numpy(sc).float()).reshape(rows, cols // 32)
        offsets = (-(dmin[..., None] * torch.from_numpy(m).float())).reshape(rows, cols // 32)
        return GroupQuantized(torch.from_numpy(codes), scales, offsets, 4, ggml_type)
    raise ValueError(f"GGUF type {ggml_type.name} has no group-wise form")


def _f16(two_bytes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32))


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a K super-block, packed in 12 bytes: sub-blocks 0-3 in the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take their low 4 bits from
    bytes 8-11 and their top 2 bits from the top bits of bytes 0-3 / 4-7."""
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate((lo_sc, hi_sc), axis=-1), np.concatenate((lo_m, hi_m), axis=-1)


def unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: within each head, its rows were stored
    as interleaved pairs (2i, 2i + 1); Hugging Face's order is (i, i + head_dim / 2)."""
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"cannot undo the Q/K permutation of {rows} rows over {num_heads} heads")
    return torch.arange(rows).view(num_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def kv_group_index(rows: int, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Row order that turns q | k | v stored one after the other (llama.cpp's layout) back into KV
    groups [q_g...; k_g; v_g] (BLOOM's and Falcon's fused layout: one query head per group for
    BLOOM, all of them for multi-query Falcon-7B)."""
    group = num_heads // num_kv_heads
    if num_heads % num_kv_heads or rows % (num_kv_heads * (group + 2)):
        raise ValueError(f"cannot regroup {rows} rows into {num_kv_heads} KV groups of {num_heads} heads")
    d = rows // (num_kv_heads * (group + 2))
    g = torch.arange(num_kv_heads)[:, None, None]
    j = torch.arange(group + 2)[None, :, None]
    i = torch.arange(d)[None, None, :]
    q = (g * group + j) * d + i
    k = num_heads * d + g * d + i
    v = (num_heads + num_kv_heads) * d + g * d + i
    return torch.where(j < group, q, torch.where(j == group, k, v)).reshape(-1)


def rope_deinterleave_index(rows: int, group: int, rope_dim: int) -> torch.Tensor:
    """Row order that turns the last rope_dim rows of every group of `group` rows from
    interleaved pairs (x0, x1), (x2, x3), ... into rotate-half order (x0, x2, ..., x1, x3, ...)."""
    if rows % group or rope_dim > group or rope_dim % 2:
        raise ValueError(f"cannot de-interleave {rope_dim} rotary rows in groups of {group} of {rows} rows")
    base = torch.arange(rows).view(rows // group, group)
    nope, rope = base.split([group - rope_dim, rope_dim], dim=1)
    order = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    return torch.cat((nope, rope[:, order]), dim=1).reshape(-1)
