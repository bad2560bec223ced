"""Bytes per element of the dtypes a model's weights and KV cache are given in (names, no torch)."""

from __future__ import annotations

from typing import Any

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}

# `kv_cache_dtype` values (vLLM's names): "auto" stores K/V in the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

GiB = 1024**3


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element for a dtype given as a string ("bfloat16", "fp16", ...) or torch dtype."""
    name = str(dtype).removeprefix("torch.").lower()
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype: unsupported value {dtype!r}; supported: {sorted(_DTYPE_BYTES)}") from None


def kv_cache_dtype_bytes(kv_cache_dtype: str, model_dtype: Any) -> int:
    """Bytes per stored K/V element: the model dtype's for "auto", 1 for the fp8 formats."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unsupported value {kv_cache_dtype!r}; supported: "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return dtype_bytes(model_dtype) if kv_cache_dtype == "auto" else 1
