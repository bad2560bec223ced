"""How much KV cache one replica holds: the one capacity model that the runtime and operator share.

Pure arithmetic over a model's shape, with no torch and no I/O, so the operator can import it
without a GPU stack. The runtime sizes its KV pool with `plan_capacity` / `blocks_for_budget`
and exports the result as a metric; the operator's autoscaler asks the same functions what each
tensor-parallel degree would give before it changes one.

Tensor parallelism splits attention heads across ranks. When a model has fewer KV heads than
ranks, each rank keeps one KV head (replicated), so per-token KV bytes per GPU stop shrinking
there. Every rank stores its slice of every token, so a replica's capacity in tokens equals one
GPU's.

Two model families change the arithmetic. Multi-head latent attention (MLA, DeepSeek V2/V3)
caches one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer instead of
per-head K and V; every rank needs the whole latent, so its KV bytes do not shrink with TP.
Mixture-of-experts models keep every expert resident: weights grow with the expert count while
the compute per token follows only the experts it is routed to. Experts are sharded like dense
MLPs (each expert's intermediate dimension split across ranks), so TP must divide it.

Where each part lives: `shape` (ModelShape from config.json), `tp` (which degrees shard it),
`kv` (KV bytes per token, slots a sequence holds), `weights` (weight bytes per GPU), `plan`
(plan_capacity), `dtypes`; the weight formats' bytes per weight are `kvserve.runtime.weight_formats`'.

Sliding window: when every layer attends within a window (Mistral), the runtime gives back the
blocks behind each sequence's window, so a sequence holds at most about window + one step of
tokens, whatever its context length (``kv_tokens_held``); a long context then costs fewer bytes
per context token (``kv_bytes_per_context_token``), and a pool serves more such sequences
(``plan_capacity(context_len=...)``). When only some layers are local (Gemma's alternating
local/global layers, Qwen2's max_window_layers), the runtime keeps one block table and pool per
layer group (runtime/engine/kv_cache_groups.py, at every tensor-parallel degree): the local layers hold the
window bound and the global ones the whole context, and ``kv_tokens_held`` averages the two per
layer, and ``plan_capacity(context_len=L)`` counts the L-token sequences the split pools hold.
``kv_tokens`` stays the single-table count (the ratio between TP degrees the operator uses);
the runtime's ``kvserve:kv_cache_capacity_tokens`` of a grouped model is its full-attention
group's slots, more than that.
"""

from kvserve.runtime.capacity.dtypes import KV_CACHE_DTYPES, GiB, dtype_bytes, kv_cache_dtype_bytes
from kvserve.runtime.capacity.kv import (
    blocks_for_budget,
    has_kv_cache_groups,
    kv_bytes_per_context_token,
    kv_bytes_per_token,
    kv_tokens_held,
)
from kvserve.runtime.capacity.plan import ReplicaCapacity, plan_capacity
from kvserve.runtime.capacity.shape import (
    MLAShape,
    ModelShape,
    MoEShape,
    mla_shape_from_hf_config,
    moe_shape_from_hf_config,
)
from kvserve.runtime.capacity.weights import active_parameters, weight_bytes_per_gpu
from kvserve.runtime.weight_formats import (
    CHECKPOINT_FORMATS,
    LOAD_TIME_FORMATS,
    WEIGHT_FORMATS,
    WeightFormat,
    weight_format,
)

__all__ = [
    "CHECKPOINT_FORMATS", "GiB", "KV_CACHE_DTYPES", "LOAD_TIME_FORMATS", "MLAShape", "ModelShape", "MoEShape",
    "ReplicaCapacity", "WEIGHT_FORMATS", "WeightFormat", "active_parameters", "blocks_for_budget", "dtype_bytes",
    "has_kv_cache_groups", "kv_bytes_per_context_token", "kv_bytes_per_token", "kv_cache_dtype_bytes",
    "kv_tokens_held", "mla_shape_from_hf_config", "moe_shape_from_hf_config", "plan_capacity",
    "weight_bytes_per_gpu", "weight_format",
]
