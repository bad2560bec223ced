"""The layer operations that the model code calls: the one place that picks Triton or torch.

Model code calls these functions and never a kernel directly, so the engine can run the Triton
kernels on CUDA and their pure-torch twins everywhere else (or be forced either way for tests).
The twins follow Hugging Face's numerics (norms in float32, cast back) so that the torch path
matches transformers token for token.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 and cast back to x's dtype."""
    return _rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the pre-norm residual stream in one pass."""
    summed = x + residual
    return _rms_norm_torch(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor,  # int64 [num_tokens]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # float32 [max_positions, rotary_dim]: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX style, as HF Llama does) rotary embedding on the first rotary_dim dims.

    Scaling schemes (linear, llama3, ...) are folded into the precomputed cos/sin table.
    """
    return _rotary_torch(positions, query, cos_sin_cache), _rotary_torch(positions, key, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for x = [gate | up] along the last dimension (the fused gate_up output)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotary_torch(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((sin, sin), dim=-1)
    rot, passthrough = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, passthrough), dim=-1) if passthrough.numel() else out
