"""Sizes and allocates the paged KV cache: per layer a tuple of pools sharing one block table.

Each pool is ``[num_blocks, block_size, heads, values]``. What a layer holds is the model's
cache layout (``ModelShape.kv_cache_layout``): a K pool and a V pool of
``[.., num_kv_heads_per_rank, head_dim]`` for standard attention, or one latent pool of
``[.., 1, kv_lora_rank + qk_rope_head_dim]`` for MLA. Code that handles whole layers (block
copies, byte counts) iterates over a layer's pools and never assumes two. The block count comes
from, in order: an explicit ``num_kv_blocks``; a byte budget ``kv_cache_memory_bytes``; on CUDA,
free GPU memory x ``gpu_memory_utilization`` (measured after the weights are loaded); on CPU,
``EngineConfig.DEFAULT_CPU_KV_BYTES``. Bytes per token come from the shared capacity model.

The pools hold the model's dtype, or float8 with ``kv_cache_dtype`` "fp8"/"fp8_e4m3" (e4m3fn:
more precision, range +-448) or "fp8_e5m2" (range +-57344): half the bytes of bf16, so twice the
tokens in the same budget. The attention backends scale on write and read (per-layer k/v scales).
"""

from __future__ import annotations

import torch

from kvserve.runtime.capacity import ModelShape, blocks_for_budget, kv_bytes_per_token
from kvserve.runtime.config import EngineConfig


FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the K/V pools for an EngineConfig.kv_cache_dtype value."""
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return FP8_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"kv_cache_dtype: unsupported value {kv_cache_dtype!r}; supported: "
                         f"auto, {', '.join(FP8_DTYPES)}") from None


def determine_num_blocks(config: EngineConfig, shape: ModelShape, dtype: torch.dtype,
                         device: torch.device) -> int:
    """`dtype` is the K/V pools' dtype (kv_cache_torch_dtype), which sets the bytes per token."""
    size = element_size(dtype)
    tp = config.tensor_parallel_size
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Keep (1 - utilization) of the whole GPU unused, as vLLM does, out of what is free now.
        budget = int(free - total * (1 - config.gpu_memory_utilization))
    else:
        budget = EngineConfig.DEFAULT_CPU_KV_BYTES
    blocks = blocks_for_budget(max(0, budget), shape, size, config.block_size, tp)
    if blocks < 1:
        per_block = kv_bytes_per_token(shape, size, tp) * config.block_size
        raise ValueError(f"kv_cache_memory_bytes: a budget of {budget} bytes holds no KV block "
                         f"({per_block} bytes each)")
    return blocks


def allocate_kv_cache(shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, tp: int = 1) -> list[tuple[torch.Tensor, ...]]:
    pools, heads, size = shape.kv_cache_layout(tp)
    pool_shape = (num_blocks, block_size, heads, size)
    return [tuple(torch.zeros(pool_shape, dtype=dtype, device=device) for _ in range(pools))
            for _ in range(shape.num_layers)]


def kv_cache_bytes(kv_caches: list[tuple[torch.Tensor, ...]]) -> int:
    """Bytes all layers' pools hold."""
    return sum(pool.numel() * pool.element_size() for layer in kv_caches for pool in layer)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, ...]], pairs: list[tuple[int, int]]) -> None:
    """Applies copy-on-write pairs (src_block, dst_block) to every layer's pools."""
    if not pairs:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], device=device)
    dst = torch.tensor([d for _, d in pairs], device=device)
    for layer in kv_caches:
        for pool in layer:
            pool = as_storage(pool)
            pool[dst] = pool[src]


def as_storage(cache: torch.Tensor) -> torch.Tensor:
    """A float8 pool viewed as uint8 (the same bytes): copies and scatters then work on every
    device (CPU torch has no index_copy_ for float8); other pools as they are."""
    return cache.view(torch.uint8) if cache.element_size() == 1 and cache.is_floating_point() else cache
