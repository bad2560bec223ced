"""bitsandbytes 4-bit (NF4 / FP4) dequant-GEMM in Triton, and its torch twin.

The weight is bitsandbytes' own packing, as runtime/models/quantization/bnb4.py holds it: codes
uint8 [N, K / 2] (two 4-bit codes per byte, the high nibble first), absmax float32 [N, K / block]
(double quantization already resolved) and the 16-value codebook (NF4's normal quantiles or FP4's
values). Weight element (n, k) is codebook[code(n, k)] * absmax[n, k // block].

Each program computes a [BLOCK_M, BLOCK_N] tile of x @ W.T over its share of the K tiles; a K tile
never straddles a block (BLOCK_K divides it). The tile's weights are rebuilt in registers from the
codes (a 16-entry gather) times the block's absmax in float32, exactly the values bitsandbytes'
dequantize_4bit produces, then rounded to x's dtype for the dot, as a dequantized layer would be;
nothing of the weight is ever written out. With SPLIT_K > 1 (decode-sized batches) programs write
float32 partial sums that are added afterwards, for enough programs to fill a GPU.

``nf4_matmul_ref`` is the twin: dequantize the whole weight, then one matmul.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the twin works without Triton
    triton = None


def dequantize_ref(codes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [N, K]: codebook[code] * absmax of its block, high nibble first."""
    n, half = codes.shape
    pairs = torch.stack((codes >> 4, codes & 0xF), dim=-1).reshape(n, 2 * half).long()
    values = codebook.float()[pairs].view(n, -1, block)
    return (values * absmax.float()[:, :, None]).view(n, 2 * half)


def nf4_matmul_ref(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
                   block: int) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype (the weight rounded to x's dtype, as a dequantized
    layer holds it)."""
    w = dequantize_ref(codes, absmax, codebook, block)
    return F.linear(x, w.to(x.dtype))


def block_k_for(block: int) -> int | None:
    """The K tile for a quantization block: a power of two in 16..64 that divides it, or None."""
    for bk in (64, 32, 16):
        if block % bk == 0:
            return bk
    return None


if triton is not None:

    @triton.jit
    def _nf4_gemm_kernel(
        X, CODES, ABSMAX, CODEBOOK, OUT,
        M, N, K, stride_xm, stride_om, stride_os,
        TILES_PER_SPLIT,
        BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BF16: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        blocks_per_row = K // BLOCK
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = pid_k * TILES_PER_SPLIT
        last = tl.minimum(first + TILES_PER_SPLIT, K // BLOCK_K)
        for tile in range(first, last):
            offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=m_mask[:, None],
                        other=0.0)
            byte = tl.load(CODES + offs_n[None, :].to(tl.int64) * (K // 2) + offs_k[:, None] // 2,
                           mask=n_mask[None, :], other=0)
            # even k: the high nibble; odd k: the low one
            code = (byte >> ((1 - offs_k[:, None] % 2) * 4).to(tl.uint8)) & 0xF
            value = tl.load(CODEBOOK + code.to(tl.int32))  # [BLOCK_K, BLOCK_N], float32
            scale = tl.load(ABSMAX + offs_n.to(tl.int64) * blocks_per_row + (tile * BLOCK_K) // BLOCK,
                            mask=n_mask, other=0.0)
            w = value * scale[None, :]
            if BF16:
                # Round to nearest even in integer bits: the interpreter's bfloat16 cast truncates,
                # and a compiled kernel rounds the result (now exact) the same way.
                bits = w.to(tl.int32, bitcast=True)
                bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
                w = bits.to(tl.float32, bitcast=True)
            w = w.to(x.dtype)
            if DOT_F32:  # the interpreter's bfloat16 dot is wrong: widen after the same rounding
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
            else:
                acc += tl.dot(x, w, input_precision=PRECISION, out_dtype=tl.float32)
        out_ptrs = OUT + pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def supports(block: int, k: int) -> bool:
    return triton is not None and block_k_for(block) is not None and k % block == 0


def nf4_matmul(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, block: int,
               split_k: int | None = None) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1): x [..., K] @ W.T
    -> [..., N] in x's dtype, float32 accumulation."""
    from kvserve.kernels.quant import default_split_k
    from kvserve.kernels.triton_utils import dot_precision, kernel_for, next_pow2

    n, half = codes.shape
    k = 2 * half
    if triton is None:
        raise RuntimeError("nf4_matmul needs Triton; nf4_matmul_ref is the torch path")
    if codes.dtype != torch.uint8 or absmax.shape != (n, k // block) or codebook.numel() != 16:
        raise ValueError(f"a 4-bit weight [{n}, {k}] in blocks of {block} needs uint8 codes [{n}, {half}], absmax "
                         f"({n}, {k // block}) and 16 codebook values; got {codes.dtype}, {tuple(absmax.shape)}, "
                         f"{codebook.numel()}")
    if not supports(block, k) or x.shape[-1] != k:
        raise ValueError(f"nf4_matmul: block {block} must be a multiple of 16 dividing K={k}; x has "
                         f"K={x.shape[-1]}")
    shape = x.shape
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    bk = block_k_for(block)
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
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
        kernel_for(_nf4_gemm_kernel, x.device)[grid](
            x2, codes.contiguous(), absmax.to(torch.float32).contiguous(),
            codebook.to(torch.float32).reshape(16).contiguous(), out,
            m, n, k, x2.stride(0), out.stride(-2), stride_os, tiles_per_split,
            BLOCK=block, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, PRECISION=dot_precision(x.dtype),
            DOT_F32=x.dtype == torch.bfloat16 and not x.is_cuda, BF16=x.dtype == torch.bfloat16,
        )
    if split > 1:
        out = out.sum(0).to(x.dtype)
    return out.view(*shape[:-1], n)
