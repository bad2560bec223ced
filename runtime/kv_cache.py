"""Sizes and allocates the paged KV cache: per layer a tuple of pools sharing one block table
(one per KV cache group, for models mixing local and global layers: runtime/engine/kv_cache_groups.py).

Each pool is ``[num_blocks, block_size, heads, values]``. What a layer holds is the model's
cache layout (``ModelShape.kv_cache_layout``): a K pool and a V pool of
``[.., num_kv_heads_per_rank, head_dim]`` for standard attention, or one latent pool of
``[.., 1, kv_lora_rank + qk_rope_head_dim]`` for MLA. Code that handles whole layers (block
copies, byte counts) iterates over a layer's pools and never assumes two. The block count comes
from, in order: an explicit ``num_kv_blocks``; a byte budget ``kv_cache_memory_bytes``;
on CUDA, the budget the rank's Worker profiles (``profiled_kv_budget``: total memory x
``gpu_memory_utilization`` minus what is in use, the activation peak of the largest step and the
CUDA-graph memory decode capture will take: runtime/executor/worker.py); on CPU,
``EngineConfig.DEFAULT_CPU_KV_BYTES``. Bytes per token come from the shared capacity model.

The pools hold the model's dtype, or float8 with ``kv_cache_dtype`` "fp8"/"fp8_e4m3" (e4m3fn:
more precision, range +-448) or "fp8_e5m2" (range +-57344): half the bytes of bf16, so twice the
tokens in the same budget. The attention backends scale on write and read (per-layer k/v scales).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from kvserve.runtime.capacity import ModelShape, blocks_for_budget, kv_bytes_per_token
from kvserve.runtime.config import EngineConfig
from kvserve.runtime.engine.kv_cache_groups import KVCacheGroup, hybrid_group_blocks
from kvserve.runtime.executor.platform import platform_for

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
                         device: torch.device, budget_bytes: int | None = None) -> int:
    """`dtype` is the K/V pools' dtype (kv_cache_torch_dtype), which sets the bytes per token."""
    size = element_size(dtype)
    tp = config.tensor_parallel_size
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = _kv_budget_bytes(config, device) if budget_bytes is None else budget_bytes
    blocks = blocks_for_budget(max(0, budget), shape, size, config.block_size, tp)
    if blocks < 1:
        per_block = kv_bytes_per_token(shape, size, tp) * config.block_size
        raise ValueError(f"kv_cache_memory_bytes: a budget of {budget} bytes holds no KV block "
                         f"({per_block} bytes each)")
    return blocks


def _kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        # Unprofiled (a caller without a Worker): keep (1 - utilization) of the whole GPU unused out
        # of what is free once the allocator's cache is handed back.
        free, total = platform_for(device).free_memory_bytes(device)
        return int(free - total * (1 - config.gpu_memory_utilization))
    return EngineConfig.DEFAULT_CPU_KV_BYTES


def profiled_kv_budget(total: int, utilization: float, in_use: int, activation_peak: int, graph_bytes: int) -> int:
    """vLLM's rule on a GPU: the KV pools get total x utilization, less what is in use before they
    exist (weights, the CUDA context, other processes), the activation peak of the largest step
    and the CUDA-graph pool that decode capture will take after them (it comes out of the same
    memory; left out, the capture would push the device past its utilization or out of memory)."""
    for name, value in (("in_use", in_use), ("activation_peak", activation_peak), ("graph_bytes", graph_bytes)):
        if value < 0:
            raise ValueError(f"{name}: a measured size cannot be negative, got {value}")
    return int(total * utilization) - in_use - activation_peak - graph_bytes


def graph_memory_estimate(first_graph_bytes: int, next_graph_bytes: int, num_graphs: int) -> int:
    """The memory `num_graphs` decode graphs take, from two measured captures: the largest batch
    size first (its static buffers, the pool its activations fill, the graph itself), then the
    smallest into the same pool (what each further graph adds: the pool is already big enough, so
    mostly the graph's own executable). Captured largest first, every other graph is like the second."""
    if num_graphs < 1:
        return 0
    return max(0, first_graph_bytes) + max(0, next_graph_bytes) * (num_graphs - 1)


def determine_group_blocks(config: EngineConfig, shape: ModelShape, dtype: torch.dtype, device: torch.device,
                           groups: Sequence[KVCacheGroup], *, max_model_len: int, max_step_tokens: int,
                           budget_bytes: int | None = None) -> list[int]:
    """Blocks per KV cache group (runtime/engine/kv_cache_groups.py). An explicit ``num_kv_blocks`` gives
    every group that many; a byte budget (as in ``determine_num_blocks``) is split between the
    groups in proportion to what a sequence of `max_model_len` tokens holds in each."""
    if config.num_kv_blocks is not None:
        return [config.num_kv_blocks] * len(groups)
    size, tp = element_size(dtype), config.tensor_parallel_size
    budget = max(0, _kv_budget_bytes(config, device) if budget_bytes is None else budget_bytes)
    per_block = kv_bytes_per_token(shape, size, tp) * config.block_size  # one block of every layer
    blocks = hybrid_group_blocks(groups, budget_blocks=budget / per_block, block_size=config.block_size,
                                 max_model_len=max_model_len, max_step_tokens=max_step_tokens)
    if blocks[0] < 1:
        raise ValueError(f"kv_cache_memory_bytes: a budget of {budget} bytes holds no KV block in every layer "
                         f"group ({per_block} bytes for a block of every layer)")
    return blocks


def allocate_kv_cache(shape: ModelShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, tp: int = 1,
                      layer_blocks: Sequence[int] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's pools of `num_blocks` blocks, or of `layer_blocks[i]` for layer i (KV cache
    groups: a layer has its group's blocks)."""
    pools, heads, size = shape.kv_cache_layout(tp)
    if layer_blocks is None:
        layer_blocks = [num_blocks] * shape.num_layers
    return [tuple(zeroed((n, block_size, heads, size), dtype, device) for _ in range(pools))
            for n in layer_blocks]


# Below this a pool is filled as usual: the mapping's own cost would not pay.
LAZY_ZERO_BYTES = 1 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of zeros. On the CPU a large one is an anonymous memory map the kernel zero-fills
    page by page on first write, so a pool costs nothing until its blocks are used: torch.zeros
    writes every byte up front (seconds for the CPU default of 1 GiB on a busy host), which made
    the pool fill the largest part of an engine start and of a live reshape (docs/reshape.md)."""
    device = torch.device(device)
    nbytes = element_size(dtype) * math.prod(shape)
    if device.type != "cpu" or nbytes < LAZY_ZERO_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Private: Python's default for an anonymous map is shared memory, which a forked child
    # would share and which transparent huge pages do not cover. The tensor holds a reference:
    # unmapped when the tensor goes.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults as blocks fill, where THP allows it
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def layer_group_blocks(groups: Sequence[KVCacheGroup], group_blocks: Sequence[int]) -> list[int]:
    """Per layer, the block count of its group."""
    out = [0] * sum(len(g.layers) for g in groups)
    for g, n in zip(groups, group_blocks):
        for layer in g.layers:
            out[layer] = n
    return out


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


def copy_group_blocks(kv_caches: list[tuple[torch.Tensor, ...]], groups: Sequence[KVCacheGroup],
                      triples: list[tuple[int, int, int]]) -> None:
    """Applies copy-on-write (group, src_block, dst_block) triples to the pools of that group's layers."""
    for g, group in enumerate(groups):
        pairs = [(src, dst) for tg, src, dst in triples if tg == g]
        if pairs:
            copy_blocks([kv_caches[layer] for layer in group.layers], pairs)


def as_storage(cache: torch.Tensor) -> torch.Tensor:
    """A float8 pool viewed as uint8 (the same bytes): copies and scatters then work on every
    device (CPU torch has no index_copy_ for float8); other pools as they are."""
    return cache.view(torch.uint8) if cache.element_size() == 1 and cache.is_floating_point() else cache
