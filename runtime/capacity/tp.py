"""Which tensor-parallel degrees a model shards at: heads, KV heads and expert widths must split."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.runtime.capacity.shape import ModelShape


def tp_error(shape: ModelShape, tp: int) -> str | None:
    """Why `shape` cannot run at tensor-parallel degree `tp`, or None if it can."""
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if shape.num_attention_heads % tp:
        return (f"tensor_parallel_size {tp} does not divide the model's "
                f"{shape.num_attention_heads} attention heads")
    if shape.moe is not None:
        for what, size in (("expert intermediate size", shape.moe.expert_intermediate_size),
                           ("shared-expert intermediate size", shape.moe.shared_intermediate_size)):
            if size % tp:
                return f"tensor_parallel_size {tp} does not divide the model's {what} {size}"
        if len(shape.moe.moe_layers) < shape.num_layers and shape.intermediate_size % tp:
            return (f"tensor_parallel_size {tp} does not divide the model's dense intermediate size "
                    f"{shape.intermediate_size}")
    if shape.mla is not None:  # one latent "KV head" that every rank keeps whole
        return None
    if shape.num_kv_heads % tp and tp % shape.num_kv_heads:
        return (f"tensor_parallel_size {tp} and the model's {shape.num_kv_heads} KV heads: one "
                f"must divide the other")
    return None


def check_tp(shape: ModelShape, tp: int) -> None:
    error = tp_error(shape, tp)
    if error:
        raise ValueError(error)


def valid_tp_degrees(shape: ModelShape, max_tp: int) -> list[int]:
    """Powers of two up to `max_tp` at which the model can be sharded."""
    degrees = []
    tp = 1
    while tp <= max_tp:
        if tp_error(shape, tp) is None:
            degrees.append(tp)
        tp *= 2
    return degrees
