"""Triton kernel that scatters new tokens' K/V into the paged cache through a slot mapping.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V; slot ``s``
is block ``s // block_size``, offset ``s % block_size``. A slot of -1 is skipped (padding, or a
position whose K/V is already cached).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_utils import kernel_for, next_pow2


@triton.jit
def _write_kv_kernel(
    K, V, KC, VC, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    block_size, H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < H) & (d < D)
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(KC + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
                 k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
                 v.to(VC.dtype.element_ty), mask=mask)


def _check_cache(name: str, cache: torch.Tensor, heads: int, dim: int) -> None:
    if cache.dim() != 4 or cache.shape[2] != heads or cache.shape[3] != dim:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, {heads}, {dim}], got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim")


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
) -> None:
    tokens, heads, dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping must be [{tokens}], got {tuple(slot_mapping.shape)}")
    _check_cache("k_cache", k_cache, heads, dim)
    _check_cache("v_cache", v_cache, heads, dim)
    if not tokens:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    kernel_for(_write_kv_kernel, key.device)[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], heads, dim,
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(dim), num_warps=4,
    )
