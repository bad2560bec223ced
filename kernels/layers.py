"""Triton kernels for the per-token layer ops: RMSNorm (plain and fused with the residual add;
Llama's and Gemma's (1 + weight) variant), rotary embedding, SiLU-and-mul and GELU(tanh)-and-mul.
Each mirrors its twin in ``reference.py`` step for step,
including where the twin rounds back to the activation dtype, so they agree to rounding error.

All functions return new tensors (never write their inputs), like the twins.

Arithmetic is written as float32 math with an explicit cast back after each operation that the
twin rounds: that is bit-for-bit what a native half-precision op does, and it also keeps Triton's
interpreter right, whose bfloat16 arithmetic is wrong (3.9) while its conversions are correct.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_utils import kernel_for, next_pow2


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, RES_OUT,
    stride_x, stride_r, stride_o, stride_ro,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GEMMA: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype first, as `x + residual` is in torch.
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    if GEMMA:
        # Gemma's twin stays in float32 throughout: (x / rms) * (1 + w), one rounding at the end.
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (x32 * inv_rms * (1.0 + w)).to(OUT.dtype.element_ty), mask=mask)
    else:
        normed = (x32 * inv_rms).to(x.dtype).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _rms_norm(x, residual, weight, eps, gemma=False):
    shape, hidden = x.shape, x.shape[-1]
    x2 = _rows(x)
    out_dtype = x.dtype if gemma else torch.result_type(weight, x)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = _rows(residual)
        summed = torch.empty(x2.shape, dtype=torch.result_type(x, residual), device=x.device)
    else:
        r2 = summed = x2  # unused placeholders: HAS_RESIDUAL=False never touches them
    rows = x2.shape[0]
    if rows:
        kernel_for(_rms_norm_kernel, x.device)[(rows,)](
            x2, r2, weight, out, summed,
            x2.stride(0), r2.stride(0), out.stride(0), summed.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(hidden), GEMMA=gemma,
            num_warps=_warps(hidden),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), summed.view(shape)


def _warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm(x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, None, weight, eps, gemma=True)


def gemma_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms_norm(x, residual, weight, eps, gemma=True)


@triton.jit
def _rotary_kernel(
    POS, X, OUT, CS,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
    H, D, HALF,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PASS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    hm = h < H
    im = i < HALF
    dtype = X.dtype.element_ty
    # The twin casts the float32 table to the activation dtype before multiplying.
    cos = tl.load(CS + pos * stride_cs + i, mask=im, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(CS + pos * stride_cs + HALF + i, mask=im, other=0.0).to(dtype).to(tl.float32)
    x_row = X + t * stride_xt + h * stride_xh
    o_row = OUT + t * stride_ot + h * stride_oh
    x1 = tl.load(x_row + i, mask=hm & im, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + i, mask=hm & im, other=0.0).to(tl.float32)
    # twin: out = x*cos + rotate_half(x)*sin, each product rounded, then the sum rounded
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(o_row + i, o1.to(dtype), mask=hm & im)
    tl.store(o_row + HALF + i, o2.to(dtype), mask=hm & im)
    if HAS_PASS:
        d = tl.arange(0, BLOCK_D)[None, :]
        pm = hm & (d >= 2 * HALF) & (d < D)
        tl.store(o_row + d, tl.load(x_row + d, mask=pm, other=0.0), mask=pm)


def _rotary(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"rotary input must be [num_tokens, num_heads, head_dim], got {tuple(x.shape)}")
    tokens, heads, dim = x.shape
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > dim:
        raise ValueError(f"cos_sin_cache rotary_dim {rotary_dim} must be even and <= head_dim {dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        kernel_for(_rotary_kernel, x.device)[(tokens,)](
            positions, x, out, cache,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cache.stride(0),
            heads, dim, rotary_dim // 2,
            BLOCK_H=next_pow2(heads), BLOCK_HALF=next_pow2(rotary_dim // 2), BLOCK_D=next_pow2(dim),
            HAS_PASS=rotary_dim < dim, num_warps=4,
        )
    return out


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotary(positions, query, cos_sin_cache), _rotary(positions, key, cos_sin_cache)


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch's silu rounds to the activation dtype before the multiply; so does this.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * up.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def _gated_activation(kernel, name: str, x: torch.Tensor) -> torch.Tensor:
    """act(gate) * up over x = [..., gate | up], one program per (row, block of columns)."""
    if x.shape[-1] % 2:
        raise ValueError(f"{name} needs an even last dimension, got {x.shape[-1]}")
    shape = x.shape
    x2 = _rows(x)
    n = shape[-1] // 2
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(next_pow2(n), 1024)
        kernel_for(kernel, x.device)[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
        )
    return out.view(*shape[:-1], n)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated_activation(_silu_and_mul_kernel, "silu_and_mul", x)


@triton.jit
def _gelu_tanh_and_mul_kernel(X, OUT, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), with tanh(u) = 1 - 2 / (e^2u + 1); rounded
    # to the activation dtype before the multiply, as torch's gelu is.
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    u = tl.minimum(tl.maximum(u, -20.0), 20.0)  # tanh(20) is 1 in float32; exp stays finite
    t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    act = (0.5 * g * (1.0 + t)).to(gate.dtype).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * up.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _gated_activation(_gelu_tanh_and_mul_kernel, "gelu_tanh_and_mul", x)
