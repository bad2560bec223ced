"""How many KV bytes a token costs on each GPU, and how many slots a sequence holds at once.

Every rank stores its slice of every token, so a replica's capacity in tokens equals one GPU's.
With a window on every layer the runtime gives back the blocks behind each sequence's window
(``kv_tokens_held``); with local and global layers it keeps one block table per layer group
(runtime/engine/kv_cache_groups.py, at every tensor-parallel degree).
"""

from __future__ import annotations

from kvserve.runtime.capacity.shape import ModelShape


def kv_tokens_held(shape: ModelShape, context_len: int, *, block_size: int, max_step_tokens: int,
                   kv_cache_groups: bool = True) -> int:
    """The most K/V slots (whole blocks) one sequence of `context_len` tokens holds at once when
    each step computes at most `max_step_tokens` of its tokens: all of its blocks, or, with a
    window on every layer, the window before a step plus the step at the worst block alignment
    (the same bound as BlockManager.max_blocks_held). With local and global layers and
    `kv_cache_groups` (the runtime's hybrid KV cache manager, on at every tensor-parallel degree), the
    local layers hold that window bound and the global ones every block: the average per layer,
    rounded up, is returned (so that times ``kv_bytes_per_token`` it is the bytes held)."""
    if context_len < 1 or block_size < 1 or max_step_tokens < 1:
        raise ValueError("context_len, block_size and max_step_tokens must be >= 1")
    return -(-layer_slots_held(shape, context_len, block_size, max_step_tokens, kv_cache_groups)
             // shape.num_layers)


def has_kv_cache_groups(shape: ModelShape) -> bool:
    """Local and global layers: the runtime keeps one block table per layer group."""
    return shape.sliding_window is not None and 0 < shape.num_sliding_layers < shape.num_layers


def layer_slots_held(shape: ModelShape, context_len: int, block_size: int, max_step_tokens: int,
                      kv_cache_groups: bool) -> int:
    """K/V slots one sequence holds summed over the layers (see kv_tokens_held)."""
    whole = -(-context_len // block_size)

    def window_bound(window: int) -> int:
        span = window - 1 + min(max_step_tokens, context_len)
        return min(whole, -(-span // block_size) + 1)

    if shape.kv_release_window is not None:
        return window_bound(shape.kv_release_window) * block_size * shape.num_layers
    if kv_cache_groups and has_kv_cache_groups(shape):
        local = shape.num_sliding_layers
        return ((shape.num_layers - local) * whole + local * window_bound(shape.sliding_window)) * block_size
    return whole * block_size * shape.num_layers


def kv_bytes_per_context_token(shape: ModelShape, dtype_size: int, context_len: int, tp: int = 1, *,
                               block_size: int = 16, max_step_tokens: int = 2048) -> float:
    """KV bytes per GPU that one token of a `context_len`-token sequence costs on average: the
    sequence's held slots times `kv_bytes_per_token`, over its length. Without a window on every
    layer that is `kv_bytes_per_token` (plus block rounding); with one it falls as 1 / context_len."""
    held = kv_tokens_held(shape, context_len, block_size=block_size, max_step_tokens=max_step_tokens)
    return kv_bytes_per_token(shape, dtype_size, tp) * held / context_len


def kv_bytes_per_token(shape: ModelShape, dtype_size: int, tp: int = 1) -> int:
    """KV bytes one token takes on each GPU of a replica: pools (2: K and V; 1: an MLA latent)
    x layers x heads x values per head."""
    pools, heads, size = shape.kv_cache_layout(tp)
    return pools * shape.num_layers * heads * size * dtype_size


def blocks_for_budget(kv_cache_bytes: int, shape: ModelShape, dtype_size: int, block_size: int,
                      tp: int = 1) -> int:
    """How many whole blocks a per-GPU KV budget holds."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    per_block = kv_bytes_per_token(shape, dtype_size, tp) * block_size
    return max(0, int(kv_cache_bytes) // per_block)
