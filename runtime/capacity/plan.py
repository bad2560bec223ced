"""What one replica holds at one tensor-parallel degree: `plan_capacity`'s `ReplicaCapacity`."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.runtime.capacity.kv import (
    blocks_for_budget,
    has_kv_cache_groups,
    kv_bytes_per_token,
    kv_tokens_held,
    layer_slots_held,
)
from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.capacity.weights import weight_bytes_per_gpu
from kvserve.runtime.weight_formats import WeightFormat


@dataclass(frozen=True)
class ReplicaCapacity:
    """What one replica at one tensor-parallel degree holds."""

    tensor_parallel_size: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_cache_bytes_per_gpu: int
    block_size: int
    kv_blocks: int
    kv_tokens: int
    # With plan_capacity(context_len=L): how many L-token sequences the pool holds at once
    # (window-bounded when every layer is local), and the context tokens they add up to.
    context_len: int | None = None
    max_sequences_at_context_len: int | None = None
    context_tokens: int | None = None

    @property
    def fits(self) -> bool:
        """True when at least one block of KV fits beside the weights."""
        return self.kv_blocks > 0


def plan_capacity(
    shape: ModelShape,
    *,
    dtype_size: int,
    block_size: int,
    tp: int,
    gpu_memory_bytes: int,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int | None = None,
    weight_format: WeightFormat | None = None,
    kv_dtype_size: int | None = None,
    context_len: int | None = None,
    max_step_tokens: int = 2048,
    pp: int = 1,
) -> ReplicaCapacity:
    """KV capacity of one replica at degree `tp` on GPUs of `gpu_memory_bytes` each.

    The KV budget per GPU is ``gpu_memory_bytes * gpu_memory_utilization`` minus the weight shard
    minus a reserve for activations and the CUDA context (default: 5% of the GPU, at least 512 MiB).
    `weight_format` sizes quantized weights (an AWQ model's shard is about a quarter of bf16's);
    `kv_dtype_size` is the bytes per stored K/V element (``kv_cache_dtype_bytes``; default
    `dtype_size`): an fp8 KV cache holds twice the tokens of a bf16 one in the same budget.
    ``kv_tokens`` counts the pool's slots (what ``kvserve:kv_cache_capacity_tokens`` reports);
    with `context_len`, the plan also says how many sequences of that length fit at once when
    each step computes at most `max_step_tokens` (max_num_batched_tokens) of a sequence.
    """
    kv_size = dtype_size if kv_dtype_size is None else kv_dtype_size
    shape.check_tp(tp)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes is None:
        activation_reserve_bytes = max(512 * 1024**2, int(0.05 * gpu_memory_bytes))
    if pp > 1:
        return _plan_pipeline(shape, pp, dtype_size=dtype_size, kv_size=kv_size, block_size=block_size, tp=tp,
                              usable=int(gpu_memory_bytes * gpu_memory_utilization) - activation_reserve_bytes,
                              weight_format=weight_format, context_len=context_len, max_step_tokens=max_step_tokens)
    weights = weight_bytes_per_gpu(shape, dtype_size, tp, weight_format)
    kv_budget = max(0, int(gpu_memory_bytes * gpu_memory_utilization) - weights - activation_reserve_bytes)
    blocks = blocks_for_budget(kv_budget, shape, kv_size, block_size, tp)
    at_context: dict[str, int] = {}
    if context_len is not None:
        if has_kv_cache_groups(shape):
            # Each group's pool is sized for this length (kvserve.runtime.engine.kv_cache_groups), so the
            # budget divides by the bytes one such sequence holds across the layers.
            layer_bytes = kv_bytes_per_token(shape, kv_size, tp) // shape.num_layers
            held_bytes = layer_slots_held(shape, context_len, block_size, max_step_tokens, True) * layer_bytes
            sequences = kv_budget // held_bytes
        else:
            held = kv_tokens_held(shape, context_len, block_size=block_size, max_step_tokens=max_step_tokens)
            sequences = blocks * block_size // held
        at_context = dict(context_len=context_len, max_sequences_at_context_len=sequences,
                          context_tokens=sequences * context_len)
    return ReplicaCapacity(
        tensor_parallel_size=tp,
        weight_bytes_per_gpu=weights,
        kv_bytes_per_token_per_gpu=kv_bytes_per_token(shape, kv_size, tp),
        kv_cache_bytes_per_gpu=kv_budget,
        block_size=block_size,
        kv_blocks=blocks,
        kv_tokens=blocks * block_size,
        **at_context,
    )


def _plan_pipeline(shape: ModelShape, pp: int, *, dtype_size: int, kv_size: int, block_size: int, tp: int,
                   usable: int, weight_format: WeightFormat | None, context_len: int | None = None,
                   max_step_tokens: int = 2048) -> ReplicaCapacity:
    """`pp` stages (runtime/capacity/pipeline.py's split): each GPU of stage s holds its layers'
    weights and KV for its layers only, from the same per-GPU budget; block ids mean the same slots
    on every stage, so the replica holds the smallest stage's block count. Reported per GPU: the
    heaviest stage's weights, the KV bytes per token of the stage with the most layers. With
    `context_len`, the sequences of that length the replica holds: the fewest any stage holds,
    each stage counting what its own layers keep of a sequence (with KV cache groups a stage of
    local layers keeps only their window: runtime/executor/pipeline_kv_groups.py)."""
    from kvserve.runtime.capacity.pipeline import layer_shape, split_layers, stage_weight_bytes

    ranges = split_layers(shape, pp, dtype_size=dtype_size, tp=tp, fmt=weight_format)
    weights = stage_weight_bytes(shape, ranges, dtype_size=dtype_size, tp=tp, fmt=weight_format)
    blocks, budgets, per_token = [], [], []
    for (start, end), w in zip(ranges, weights):
        stage = layer_shape(shape, start, end)
        budget = max(0, usable - w)
        budgets.append(budget)
        blocks.append(blocks_for_budget(budget, stage, kv_size, block_size, tp))
        per_token.append(kv_bytes_per_token(stage, kv_size, tp))
    at_context: dict[str, int] = {}
    if context_len is not None:
        groups = has_kv_cache_groups(shape)
        sequences = []
        for (start, end), budget in zip(ranges, budgets):
            stage = layer_shape(shape, start, end)
            layer_bytes = kv_bytes_per_token(stage, kv_size, tp) // stage.num_layers
            held = layer_slots_held(stage, context_len, block_size, max_step_tokens, groups) * layer_bytes
            sequences.append(budget // held)
        at_context = dict(context_len=context_len, max_sequences_at_context_len=min(sequences),
                          context_tokens=min(sequences) * context_len)
    return ReplicaCapacity(tensor_parallel_size=tp, weight_bytes_per_gpu=max(weights),
                           kv_bytes_per_token_per_gpu=max(per_token), kv_cache_bytes_per_gpu=min(budgets),
                           block_size=block_size, kv_blocks=min(blocks), kv_tokens=min(blocks) * block_size,
                           **at_context)
