"""Triton kernels for quantized linear layers: int4/int8 dequant-GEMM (split-K for small batches)
and the FP8 scaled matmul. Their torch twins, and the weight layouts, are in ``quant_reference.py``.

Dequant-GEMM: each program computes a [BLOCK_M, BLOCK_N] tile of x @ W.T over its share of the K
tiles. A K tile never straddles a quantization group (BLOCK_K divides the group), so the tile's
integer values go into the dot product as they are and the group's scale and offset are applied
to the tile's partial sum: sum_k x*(q*s + o) = s * sum_k x*q + o * sum_k x. With SPLIT_K > 1 each
program writes float32 partial sums that are added afterwards: at batch sizes of 1-16 a GEMM has
too few output tiles to fill a GPU, and splitting K gives it more programs (memory-bound decode).

FP8: float8_e4m3fn activations (quantized per token) times float8_e4m3fn weights, float32
accumulation, then the per-token and per-output-channel scales. The activations' quantization is
one kernel too (`quantize_fp8`: a row's absmax, its scale and its float8 bytes in one program per
row) instead of the twin's five torch ops (abs, amax, divide, clamp, cast), bit for bit the twin's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.cache import _to_fp8_bits
from kvserve.kernels.triton_utils import dot_precision, kernel_for, next_pow2


@triton.jit
def _dequant_gemm_kernel(
    X, W, SCALE, OFFSET, OUT,
    M, N, K, stride_xm, stride_om, stride_os,
    TILES_PER_SPLIT,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    num_groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_k * TILES_PER_SPLIT
    last = tl.minimum(first + TILES_PER_SPLIT, K // BLOCK_K)
    for tile in range(first, last):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        if BITS == 4:
            byte = tl.load(W + offs_n[None, :].to(tl.int64) * (K // 2) + offs_k[:, None] // 2,
                           mask=n_mask[None, :], other=0)
            q = (byte >> ((offs_k[:, None] % 2) * 4).to(tl.uint8)) & 0xF
        else:
            q = tl.load(W + offs_n[None, :].to(tl.int64) * K + offs_k[:, None], mask=n_mask[None, :], other=0)
        # Integers up to 255 in magnitude are exact in every float type the dot takes.
        part = tl.dot(x, q.to(x.dtype), input_precision=PRECISION, out_dtype=tl.float32)
        group = (tile * BLOCK_K) // GROUP
        s = tl.load(SCALE + offs_n.to(tl.int64) * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * s[None, :]
        if HAS_OFFSET:
            o = tl.load(OFFSET + offs_n.to(tl.int64) * num_groups + group, mask=n_mask, other=0.0).to(tl.float32)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * o[None, :]
    out_ptrs = OUT + pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_k_for(group_size: int) -> int | None:
    """The K tile for a group size: a power of two in 16..64 that divides the group, or None."""
    for bk in (64, 32, 16):
        if group_size % bk == 0:
            return bk
    return None


def supports_group(group_size: int) -> bool:
    return block_k_for(group_size) is not None


def default_split_k(m: int, n: int, k_tiles: int, block_n: int) -> int:
    """More programs for skinny GEMMs: split K until there are ~128 of them (at most 16 ways)."""
    if m > 16:
        return 1
    tiles = triton.cdiv(n, block_n)
    split = 1
    while split < 16 and tiles * split < 128 and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def _dequant_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                  group_size: int, bits: int, n: int, split_k: int | None) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    bk = block_k_for(group_size)
    if bk is None or k % group_size:
        raise ValueError(f"group_size {group_size} with K={k}: the kernel needs a group that is a multiple "
                         "of 16 and divides K")
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = max(16, min(64, next_pow2(m)))
    block_n = 64
    k_tiles = k // bk
    split = split_k or default_split_k(m, n, k_tiles, block_n)
    split = max(1, min(split, k_tiles))
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)
    if split == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        stride_os = 0
    else:
        out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        stride_os = out.stride(0)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    kernel_for(_dequant_gemm_kernel, x.device)[grid](
        x, w, scale, offset if offset is not None else scale, out,
        m, n, k, x.stride(0), out.stride(-2), stride_os, tiles_per_split,
        GROUP=group_size, BITS=bits, HAS_OFFSET=offset is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, PRECISION=dot_precision(x.dtype),
    )
    return out if split == 1 else out.sum(0).to(x.dtype)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                group_size: int, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ int4 weight (layout in quant_reference) -> [M, N] in x's dtype."""
    return _dequant_gemm(x, packed, scale, offset, group_size, 4, packed.shape[0], split_k)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int,
                split_k: int | None = None) -> torch.Tensor:
    return _dequant_gemm(x, q, scale, None, group_size, 8, q.shape[0], split_k)


@triton.jit
def _fp8_gemm_kernel(
    X, W, XS, WS, OUT, M, N, K, stride_xm, stride_wn, stride_om,
    X_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x, w, out_dtype=tl.float32)
    if X_PER_TOKEN:
        xs = tl.load(XS + offs_m, mask=m_mask, other=0.0)
    else:
        xs = tl.load(XS + offs_m * 0)
    if W_PER_CHANNEL:
        ws = tl.load(WS + offs_n, mask=n_mask, other=0.0)
    else:
        ws = tl.load(WS + offs_n * 0)
    acc = acc * xs[:, None] * ws[None, :]
    tl.store(OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def fp8_scaled_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale).T: scales float32, [M] or [1] and [N] or [1]."""
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    x_fp8 = x_fp8 if x_fp8.stride(-1) == 1 else x_fp8.contiguous()
    w_fp8 = w_fp8 if w_fp8.stride(-1) == 1 else w_fp8.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    block_m = max(16, min(64, next_pow2(m)))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    kernel_for(_fp8_gemm_kernel, x_fp8.device)[grid](
        x_fp8, w_fp8, x_scale.float().contiguous(), w_scale.float().contiguous(), out, m, n, k,
        x_fp8.stride(0), w_fp8.stride(0), out.stride(0),
        X_PER_TOKEN=x_scale.numel() > 1, W_PER_CHANNEL=w_scale.numel() > 1,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
    )
    return out


@triton.jit
def _fp8_quant_kernel(
    X, Q, SCALE, stride_x, stride_q, K, min_amax, fp8_max, sub_scale,
    STATIC: tl.constexpr, BLOCK_K: tl.constexpr, MAN_BITS: tl.constexpr, EXP_BIAS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    if STATIC:
        scale = tl.load(SCALE)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # IEEE-rounded divisions (div_rn): Triton's float32 `/` is the GPU's approximate division,
        # up to 2 ulp off torch's, which moves a value across a float8 rounding boundary now and then.
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), min_amax), fp8_max)
        tl.store(SCALE + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        # _to_fp8_bits saturates at +-fp8_max before rounding: the twin's clamp, then its cast.
        tl.store(Q + row * stride_q + k, _to_fp8_bits(tl.math.div_rn(x, scale), MAN_BITS, EXP_BIAS, sub_scale, fp8_max),
                 mask=k < K)


def quantize_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn activations and their float32 scales: per token ([M]) from each row's absmax,
    or the checkpoint's static per-tensor scale ([1]). quant_reference's quantize_fp8_per_token /
    quantize_fp8_static are the twins, bit for bit."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, features], got {tuple(x.shape)}")
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    if static_scale is None:
        scale = torch.empty(m, dtype=torch.float32, device=x.device)
    else:
        scale = static_scale.reshape(1).to(device=x.device, dtype=torch.float32)
    if m:
        fp8 = torch.float8_e4m3fn
        kernel_for(_fp8_quant_kernel, x.device)[(m,)](
            x, q, scale, x.stride(0), q.stride(0), k, 1e-12, torch.finfo(fp8).max, 2.0 ** (7 - 1 + 3),
            STATIC=static_scale is not None, BLOCK_K=min(1024, max(16, next_pow2(k))), MAN_BITS=3, EXP_BIAS=7,
            num_warps=4,
        )
    return q.view(torch.float8_e4m3fn), scale
