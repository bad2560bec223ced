"""KV cache groups (runtime/engine/kv_cache_groups.py) at pipeline_parallel_size > 1.

The groups are the whole model's (rank 0's block managers keep one table per group for every
sequence, and a block id means the same slot on every stage), but each stage holds only its own
layers: a stage may hold layers of every group, or of the full-attention group alone, or only
sliding-window layers. Each stage sizes the groups it holds from its own budget (by what a
max-length sequence takes in each, as one stage does), says "no limit" for the groups it holds no
layer of, and rank 0 takes each group's smallest count over the stages. Pure: table-tested.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.runtime.engine.kv_cache_groups import KVCacheGroup

# A group a stage holds no layer of puts no bound on that group's block count.
UNBOUNDED = 2**62


def local_groups(groups: Sequence[KVCacheGroup], start: int, end: int) -> tuple[KVCacheGroup, ...]:
    """Every group, in order, with only the layers in [start, end), renumbered from `start`."""
    return tuple(KVCacheGroup(g.window, tuple(i - start for i in g.layers if start <= i < end)) for g in groups)


def stage_group_blocks(config, stage_shape, dtype, device, groups: Sequence[KVCacheGroup], start: int, end: int,
                       *, max_model_len: int, max_step_tokens: int, budget_bytes: int | None) -> list[int]:
    """Blocks per group of the whole model that this stage's budget holds for its layers."""
    from kvserve.runtime.kv_cache import determine_group_blocks

    local = local_groups(groups, start, end)
    held = [i for i, g in enumerate(local) if g.layers]
    counts = determine_group_blocks(config, stage_shape, dtype, device, [local[i] for i in held],
                                    max_model_len=max_model_len, max_step_tokens=max_step_tokens,
                                    budget_bytes=budget_bytes)
    out = [UNBOUNDED] * len(groups)
    for i, n in zip(held, counts):
        out[i] = n
    return out


def stage_block_bytes(groups: Sequence[KVCacheGroup] | None, ranges: Sequence[tuple[int, int]],
                      layer_bytes: int) -> list[int]:
    """Per group (one group without KV cache groups), the largest share of a block any stage's
    rank holds: its layers of the group times one layer's bytes (every layer's pool has the
    same shape, and every stage the same tensor-parallel degree)."""
    if groups is None:
        return [max(end - start for start, end in ranges) * layer_bytes]
    return [max(len(g.layers) for g in (local_groups([group], s, e)[0] for s, e in ranges)) * layer_bytes
            for group in groups]
