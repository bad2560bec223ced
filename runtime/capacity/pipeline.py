"""Pipeline parallelism: which layers each stage holds, and what a stage's GPUs then carry.

Pure arithmetic (no torch), shared by the runtime (which layers a rank builds and loads) and the
operator (whether a split fits the nodes). A stage is a contiguous run of decoder layers; the
first stage also holds the embedding, the last the final norm and the LM head (and, with tied
embeddings, its own copy of the embedding table, which is the head there). Stages are balanced
by the bytes each one holds per GPU (weights of its layers plus their share of a KV budget), so a
large vocabulary or the dense layers ahead of a MoE stack move layers off the stage that has them:
memory is what decides whether a model fits a node, and per-layer compute follows the same
weights closely for a decoder.
"""

from __future__ import annotations

import dataclasses
import math

from kvserve.runtime.capacity.shape import ModelShape
from kvserve.runtime.capacity.weights import weight_bytes_per_gpu
from kvserve.runtime.weight_formats import WeightFormat


def pipeline_error(shape: ModelShape, pp: int) -> str | None:
    """Why the model cannot be split into `pp` stages, or None if it can."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        return f"pipeline_parallel_size: must be an integer >= 1, got {pp!r}"
    if pp > shape.num_layers:
        return (f"pipeline_parallel_size: {pp} exceeds the model's {shape.num_layers} layers "
                f"(every stage needs at least one)")
    return None


def layer_shape(shape: ModelShape, start: int, end: int) -> ModelShape:
    """The shape of layers [start, end) alone (their KV and weights; no embedding or head)."""
    moe = shape.moe
    if moe is not None:
        moe = dataclasses.replace(moe, moe_layers=tuple(i - start for i in moe.moe_layers if start <= i < end))
    return dataclasses.replace(shape, num_layers=end - start, layer_types=shape.layer_types[start:end], moe=moe)


def _layer_bytes(shape: ModelShape, dtype_size: int, tp: int, fmt: WeightFormat | None) -> list[int]:
    """Weight bytes per GPU of each decoder layer (without the embedding, head and final norm)."""
    out = []
    for i in range(shape.num_layers):
        one = layer_shape(shape, i, i + 1)
        total = weight_bytes_per_gpu(one, dtype_size, tp, fmt)
        vocab = weight_bytes_per_gpu(dataclasses.replace(one, num_layers=0, moe=None, layer_types=()),
                                     dtype_size, tp, fmt)
        out.append(total - vocab)
    return out


def _vocab_bytes(shape: ModelShape, dtype_size: int, tp: int, fmt: WeightFormat | None) -> int:
    """One vocabulary table (embedding or head) per GPU."""
    table = math.ceil(shape.vocab_size / tp) * shape.hidden_size
    return table * dtype_size if fmt is None else int(math.ceil(table * fmt.vocab_bytes))


def split_layers(shape: ModelShape, pp: int, *, dtype_size: int = 2, tp: int = 1, fmt: WeightFormat | None = None,
                 kv_bytes_per_layer: int = 0) -> list[tuple[int, int]]:
    """Layer ranges [start, end) of the `pp` stages, contiguous and non-empty, chosen so the
    heaviest stage (weights per GPU, plus `kv_bytes_per_layer` for each of its layers) is as
    light as possible; ties go to the split with the earlier stages fuller (stage 0 is where the
    leader also schedules and samples, so it is never left light on purpose, nor heavy)."""
    error = pipeline_error(shape, pp)
    if error:
        raise ValueError(error)
    n = shape.num_layers
    cost = [b + kv_bytes_per_layer for b in _layer_bytes(shape, dtype_size, tp, fmt)]
    vocab = _vocab_bytes(shape, dtype_size, tp, fmt)
    head = vocab if not shape.tie_word_embeddings or pp > 1 else 0

    def stage_cost(s: int, start: int, end: int) -> int:
        extra = (vocab if s == 0 else 0) + (head if s == pp - 1 else 0)
        return sum(cost[start:end]) + extra

    # best[s][e]: the lightest heaviest-stage for layers [0, e) over stages 0..s (small n x pp DP).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for e in range(1, n + 1):
        best[0][e] = stage_cost(0, 0, e)
    for s in range(1, pp):
        for e in range(s + 1, n + 1):
            for b in range(s, e):
                value = max(best[s - 1][b], stage_cost(s, b, e))
                if value < best[s][e] or (value == best[s][e] and b > cut[s][e]):
                    best[s][e], cut[s][e] = value, b
    ranges, end = [], n
    for s in range(pp - 1, -1, -1):
        start = cut[s][end] if s else 0
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def stage_weight_bytes(shape: ModelShape, ranges: list[tuple[int, int]], *, dtype_size: int = 2, tp: int = 1,
                       fmt: WeightFormat | None = None) -> list[int]:
    """Weight bytes per GPU of each stage (its layers, plus the embedding on the first stage and
    the final norm and head on the last)."""
    per_layer = _layer_bytes(shape, dtype_size, tp, fmt)
    vocab = _vocab_bytes(shape, dtype_size, tp, fmt)
    pp = len(ranges)
    head = vocab if not shape.tie_word_embeddings or pp > 1 else 0
    out = []
    for s, (start, end) in enumerate(ranges):
        total = sum(per_layer[start:end]) + (vocab if s == 0 else 0)
        if s == pp - 1:
            total += head + shape.hidden_size * dtype_size
        out.append(total)
    return out
