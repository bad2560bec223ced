"""RoPE tables from a model's config: inverse frequencies per rope type and the cos/sin cache.

Follows transformers' RoPE initialisers; the config side (which rope types, which parameters) is
checked by ModelConfig, torch-free.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from kvserve.runtime.model_config import ModelConfig


def rope_inv_freq_and_scale(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32 [rotary_dim / 2]) and the cos/sin multiplier, following
    transformers' RoPE initialisers for each supported rope type."""
    dim = cfg.rotary_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if cfg.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "dynamic":
        # NTK-aware scaling only changes the frequencies past max_position_embeddings, which
        # resolve_max_model_len never allows, so within range it is plain RoPE (as in transformers).
        return inv_freq, 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(cfg, scaling, factor)
    if kind == "longrope":  # the factors ModelConfig chose (short or long) divide each frequency
        ext = torch.tensor(scaling["long_factor" if scaling["long"] else "short_factor"], dtype=torch.float32)
        inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, float(scaling["attention_factor"])
    raise ValueError(f"rope type {kind!r} is not supported")  # unreachable: checked in _rope


def _yarn(cfg: ModelConfig, p: dict[str, Any], factor: float) -> tuple[torch.Tensor, float]:
    dim, base = cfg.rotary_dim, cfg.rope_theta
    orig = float(p["original_max_position_embeddings"])

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (mscale_of(factor, m) / mscale_of(factor, m_all)) if (m and m_all) else mscale_of(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_cos_sin_cache(cfg: ModelConfig, max_positions: int | None = None,
                       device: torch.device | str | None = None, *, local: bool = False) -> torch.Tensor:
    """float32 [max_positions, rotary_dim]: cos half then sin half, scaling folded in. With `local`,
    the sliding-window layers' RoPE (it differs from the global one in Gemma 3 only)."""
    n = max_positions or cfg.max_position_embeddings
    if local and cfg.local_rope is not None:
        cfg = replace(cfg, rope_theta=cfg.local_rope[0], rope_scaling=cfg.local_rope[1])
    inv_freq, mult = rope_inv_freq_and_scale(cfg)
    freqs = torch.arange(n, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos() * mult, freqs.sin() * mult), dim=-1)
    return cache.to(device) if device is not None else cache
