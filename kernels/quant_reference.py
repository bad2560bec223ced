"""Pure-torch twins of the quantized matmul kernels in ``quant.py``: the oracle of their tests, and
the dequantize-then-matmul path wherever no faster kernel applies.

Weight layouts (shared with the kernels):

- int4: ``packed`` uint8 [N, K/2], input feature 2j in the low nibble of byte j and 2j+1 in the
  high one; ``scale`` and ``offset`` [N, K/group] in the compute dtype; w = q * scale + offset.
- int8: ``q`` int8 [N, K]; ``scale`` [N, K/group]; w = q * scale (group == K: per channel).
- fp8: ``w`` float8_e4m3fn [N, K] with ``w_scale`` [N] (float32); activations quantized per token
  to float8_e4m3fn with ``x_scale`` [M] (or one [1] for the tensor).

The twins dequantize in float32 and multiply in the compute dtype (float32 accumulation for fp8),
which is what the kernels do tile by tile.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = packed.shape[0]
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1)
    k = q.shape[1]
    w = q.view(n, k // group_size, group_size).float() * scale.float()[..., None] + offset.float()[..., None]
    return w.view(n, k).to(dtype)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = q.shape
    w = q.view(n, k // group_size, group_size).float() * scale.float()[..., None]
    return w.view(n, k).to(dtype)


def int4_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """x [M, K] @ dequantized(W)[N, K].T -> [M, N] in x's dtype."""
    return x @ dequantize_int4(packed, scale, offset, group_size, x.dtype).t()


def int8_matmul_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    return x @ dequantize_int8(q, scale, group_size, x.dtype).t()


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: (x_fp8 [M, K], x_scale float32 [M])."""
    amax = x.float().abs().amax(dim=-1).clamp(min=1e-12)
    # Divided by a tensor, not the Python float: torch's CUDA division by a CPU scalar multiplies by
    # the rounded reciprocal (1 ulp off in about half of all values), its CPU division does not, and
    # the kernel divides IEEE-rounded on both.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static activation quantization with a checkpoint's per-tensor input scale."""
    # On x's device: a CPU 0-dim scale would be a CPU scalar, which CUDA divides by reciprocal.
    return (x.float() / scale.float().to(x.device)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_scaled_matmul_ref(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale).T with float32 accumulation, cast to out_dtype."""
    acc = x_fp8.float() @ w_fp8.float().t()
    acc = acc * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    return acc.to(out_dtype)
