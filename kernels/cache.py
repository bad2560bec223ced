"""Triton kernel that scatters new tokens' K/V into the paged cache through a slot mapping.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V; slot ``s``
is block ``s // block_size``, offset ``s % block_size``. A slot of -1 is skipped (padding, or a
position whose K/V is already cached).

float8 pools (kv_cache_dtype fp8): each value is stored as value / scale (per-layer k_scale,
v_scale, read from one-element tensors), saturated at the format's largest finite value, then
rounded to float8 (``reference.quantize_kv_ref`` is the torch twin, and the two agree bit for
bit). The rounding is done with integer ops on the float32 bits and the byte stored through a
uint8 view: Triton's own float32 -> float8 cast is wrong under the interpreter (3.9: -7.99 became
-4.0) and has no e4m3 form on GPUs before sm_89, while this runs the same everywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_utils import kernel_for, next_pow2


@triton.jit
def _to_fp8_bits(x, MAN_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, sub_scale, fp8_max):
    """float32 -> the byte of the float8 (MAN_BITS mantissa bits, exponent bias EXP_BIAS) nearest
    x, ties to even, saturated at +-fp8_max; NaN -> 0x7F (a NaN in both formats)."""
    a = tl.minimum(tl.abs(x), fp8_max)
    bits = a.to(tl.uint32, bitcast=True)
    sign = (x.to(tl.uint32, bitcast=True) >> 31) << 7
    # Normal results: rebias the exponent, drop 23 - MAN_BITS mantissa bits rounding half to even.
    rebased = bits - ((127 - EXP_BIAS) << 23)
    rounded = (rebased + ((1 << (22 - MAN_BITS)) - 1) + ((rebased >> (23 - MAN_BITS)) & 1)) >> (23 - MAN_BITS)
    # Subnormal results: the integer nearest a / 2^(1 - EXP_BIAS - MAN_BITS) (sub_scale is its
    # inverse); adding and removing 2^23 rounds half to even in float32, exactly at these sizes.
    sub = ((a * sub_scale) + 8388608.0) - 8388608.0
    normal = bits >= ((128 - EXP_BIAS) << 23)
    mag = tl.where(normal, rounded, sub.to(tl.uint32))
    mag = tl.where(x != x, 0x7F, mag)
    return (mag | sign).to(tl.uint8)


@triton.jit
def _write_kv_kernel(
    K, V, KC, VC, SLOTS, K_SCALE, V_SCALE,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    block_size, H, D, fp8_max, sub_scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, MAN_BITS: tl.constexpr,
    EXP_BIAS: tl.constexpr,
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
        if KV_FP8:  # KC/VC are uint8 views of the float8 pools
            # div_rn: IEEE-rounded like torch's division (Triton's float32 `/` is approximate on a GPU).
            k = _to_fp8_bits(tl.math.div_rn(k.to(tl.float32), tl.load(K_SCALE)), MAN_BITS, EXP_BIAS, sub_scale,
                             fp8_max)
            v = _to_fp8_bits(tl.math.div_rn(v.to(tl.float32), tl.load(V_SCALE)), MAN_BITS, EXP_BIAS, sub_scale,
                             fp8_max)
        tl.store(KC + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
                 k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
                 v.to(VC.dtype.element_ty), mask=mask)


# float8 pool dtype -> (mantissa bits, exponent bias)
_FP8_FORMAT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


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
    k_scale: torch.Tensor | None = None,  # float8 pools: stored = value / scale (None: 1)
    v_scale: torch.Tensor | None = None,
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
    kv_fp8 = k_cache.dtype in _FP8_FORMAT
    k_arg, v_arg, man_bits, exp_bias, fp8_max = key, key, 0, 0, 0.0
    if kv_fp8:
        # The layers' scale buffers are passed as they are (a view, no copy: CUDA-graph safe).
        if k_scale is None or v_scale is None:
            one = torch.ones(1, dtype=torch.float32, device=key.device)
        k_arg = one if k_scale is None else k_scale.reshape(1).to(device=key.device, dtype=torch.float32)
        v_arg = one if v_scale is None else v_scale.reshape(1).to(device=key.device, dtype=torch.float32)
        man_bits, exp_bias = _FP8_FORMAT[k_cache.dtype]
        fp8_max = torch.finfo(k_cache.dtype).max
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    kernel_for(_write_kv_kernel, key.device)[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_arg, v_arg,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], heads, dim, fp8_max, 2.0 ** (exp_bias - 1 + man_bits),
        BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(dim), KV_FP8=kv_fp8, MAN_BITS=man_bits, EXP_BIAS=exp_bias,
        num_warps=4,
    )
