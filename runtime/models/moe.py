"""Mixture-of-experts layers: the router, the routed experts, and the block around them.

One `SparseMoeBlock` serves Mixtral, Qwen2-MoE (with its sigmoid-gated shared expert),
Qwen3-MoE and DeepSeek V2/V3 (ungated shared experts, group-limited routing, V3's sigmoid
scores with a correction bias); `RoutingConfig` (model_config) says which routing applies.

Tensor parallelism splits every expert's intermediate dimension across ranks, exactly like a
dense MLP: each rank holds a slice of every expert, routes every token itself (the router is
replicated), computes partial outputs for its slice, and one all-reduce per block sums them.
That keeps each rank's work balanced whatever the routing does (expert parallelism would idle
ranks whose experts no token picked) and needs no token all-to-all; the cost is that TP must
divide the expert intermediate size (checked by the capacity model's `tp_error`).

Quantized models (`quantization=`, or a quantized checkpoint) keep each expert as two linear
layers of the quantization interface (gate|up column-parallel, down row-parallel), so every
weight format the interface has (int8/int4 weight-only, AWQ, GPTQ, ...) applies to experts with
the checkpoint's per-expert tensor names; they run one expert at a time through the format's
matmul instead of the fused kernel. The router and Qwen2-MoE's shared-expert gate (one row) stay
in full precision, as in vLLM.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvserve.kernels import ops
from kvserve.runtime.model_config import ModelConfig, RoutingConfig
from kvserve.runtime.models.layers import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    _copy,
    _param,
    all_reduce,
)
from kvserve.runtime.models.quantization import QuantizationConfig

# Checkpoint names of an expert's three projections: Mixtral's w1/w3/w2, everyone else's.
_PART_NAMES = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}


def select_experts(router_logits: torch.Tensor, top_k: int, routing: RoutingConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) for router logits [T, E],
    following transformers' router of each architecture step for step."""
    if routing.scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if routing.topk_method == "greedy":
        weights, ids = torch.topk(scores, top_k, dim=-1)
    elif routing.topk_method == "group_limited_greedy":  # DeepSeek V2
        t, e = scores.shape
        group_scores = scores.view(t, routing.n_group, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        keep = keep.unsqueeze(-1).expand(t, routing.n_group, e // routing.n_group).reshape(t, e)
        weights, ids = torch.topk(scores.masked_fill(~keep, 0.0), top_k, dim=-1, sorted=False)
    elif routing.topk_method == "noaux_tc":  # DeepSeek V3
        t, e = scores.shape
        choice = scores + correction_bias if correction_bias is not None else scores
        group_scores = choice.view(t, routing.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        keep = keep.unsqueeze(-1).expand(t, routing.n_group, e // routing.n_group).reshape(t, e)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:  # ModelConfig refuses anything else
        raise ValueError(f"topk_method {routing.topk_method!r} is not supported")
    if routing.norm_topk_prob:
        if routing.topk_method == "noaux_tc":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


class FusedExperts(nn.Module):
    """Every routed expert of one layer as two stacked weights: w13 [E, 2 * I_rank, H] (each
    expert's gate rows, then its up rows) and w2 [E, H, I_rank], I_rank being this rank's slice
    of the expert intermediate size. The layout the fused MoE kernel and its twin read."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, tp_rank: int,
                 tp_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp_size}")
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.shard = intermediate_size // tp_size
        self.start = tp_rank * self.shard
        self.w13 = _param((num_experts, 2 * self.shard, hidden_size), dtype, device, self._load)
        self.w2 = _param((num_experts, hidden_size, self.shard), dtype, device, self._load)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, part = shard_id
        if part == "down":
            if loaded.shape[1] != self.intermediate_size:
                raise ValueError(f"weight expert {expert} down: checkpoint has {loaded.shape[1]} input columns, "
                                 f"the config implies {self.intermediate_size}")
            _copy(self.w2[expert], loaded.narrow(1, self.start, self.shard), f"expert {expert} down")
            return
        if loaded.shape[0] != self.intermediate_size:
            raise ValueError(f"weight expert {expert} {part}: checkpoint has {loaded.shape[0]} rows, "
                             f"the config implies {self.intermediate_size}")
        rows = self.w13[expert].narrow(0, 0 if part == "gate" else self.shard, self.shard)
        _copy(rows, loaded.narrow(0, self.start, self.shard), f"expert {expert} {part}")

    def checkpoint_params(self, prefix: str, mixtral_names: bool) -> dict[str, tuple[torch.Tensor, object]]:
        out: dict[str, tuple[torch.Tensor, object]] = {}
        for e in range(self.num_experts):
            for part, names in _PART_NAMES.items():
                name = names[0] if mixtral_names else names[1]
                out[f"{prefix}{e}.{name}.weight"] = (self.w2 if part == "down" else self.w13, (e, part))
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over each token's experts (not yet all-reduced)."""
        return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)


def route_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Yields (expert, pair ids, token ids) for every expert that has tokens, in ascending expert
    order (the order transformers accumulates in). Pair p is token p // top_k's choice p % top_k."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    start = 0
    for expert, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            pairs = order[start:start + n]
            start += n
            yield expert, pairs, pairs // k


class QuantizedExperts(nn.Module):
    """The routed experts as per-expert linear layers of the quantization interface, for formats
    the fused kernel does not read. Same TP split as FusedExperts (intermediate dimension)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, prefix: str,
                 names: dict[str, str], quant_config: QuantizationConfig, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp_size}")
        shard = intermediate_size // tp_size
        self.num_experts = num_experts
        self.names = names
        self.prefix = prefix
        dd = dict(dtype=dtype, device=device)
        self.gate_up = nn.ModuleList(
            MergedColumnParallelLinear(
                hidden_size, output_sizes=[intermediate_size] * 2, shard_sizes=[shard] * 2,
                shard_starts=[tp_rank * shard] * 2, bias=False, part_names=["gate", "up"],
                prefixes=[f"{prefix}.{e}.{names['gate']}", f"{prefix}.{e}.{names['up']}"],
                quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size, **dd)
            for e in range(num_experts))
        self.down = nn.ModuleList(
            RowParallelLinear(intermediate_size, hidden_size, bias=False, tp_rank=tp_rank, tp_size=tp_size,
                              reduce_results=False, prefix=f"{prefix}.{e}.{names['down']}",
                              quant_config=quant_config, **dd)
            for e in range(num_experts))

    def checkpoint_params(self, prefix: str, mixtral_names: bool) -> dict[str, tuple[torch.Tensor, object]]:
        out: dict[str, tuple[torch.Tensor, object]] = {}
        for e in range(self.num_experts):
            out.update(self.gate_up[e].checkpoint_params([f"{prefix}{e}.{self.names['gate']}",
                                                          f"{prefix}{e}.{self.names['up']}"]))
            out.update(self.down[e].checkpoint_params([f"{prefix}{e}.{self.names['down']}"]))
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if _no_host_reads(x):
            return self.forward_dense(x, topk_weights, topk_ids)
        out = torch.zeros_like(x)
        weights = topk_weights.reshape(-1)
        for expert, pairs, tokens in route_by_expert(topk_ids, self.num_experts):
            y = self.down[expert](ops.silu_and_mul(self.gate_up[expert](x[tokens])))
            out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
        return out


    def forward_dense(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by the token's routing weight for it (0 where it
        did not choose the expert). No routing count is read back to the host, so a CUDA graph can
        capture it and torch.compile traces it whole; it costs num_experts / top_k times the routed
        path's expert work, which is what a captured decode step of a few tokens can afford."""
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            weight = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True)  # [tokens, 1]
            y = self.down[expert](ops.silu_and_mul(self.gate_up[expert](x)))
            out += (y * weight).to(out.dtype)
        return out


def _no_host_reads(x: torch.Tensor) -> bool:
    """Whether this forward is being captured into a CUDA graph or traced by torch.compile, where
    the routed path's per-expert counts (a host read) would break the capture or the graph."""
    if torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class ReplicatedLinear(nn.Module):
    """A small projection every rank holds whole (the router, Qwen2-MoE's shared-expert gate)."""

    def __init__(self, input_size: int, output_size: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = _param((output_size, input_size), dtype, device, self._load)

    @staticmethod
    def _load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy(param, loaded, "replicated linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts): the MLP of an MoE layer."""

    def __init__(self, cfg: ModelConfig, *, tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device,
                 prefix: str = "mlp", quant_config: QuantizationConfig | None = None):
        super().__init__()
        from kvserve.runtime.models.llama import MLP

        moe, routing = cfg.shape.moe, cfg.routing
        assert moe is not None and routing is not None
        h = cfg.hidden_size
        self.routing = routing
        self.top_k = moe.experts_per_token
        self.tp_size = tp_size
        self.mixtral_names = cfg.architecture == "MixtralForCausalLM"
        self.deepseek = cfg.shape.mla is not None or cfg.model_type.startswith("deepseek")
        self.gate = ReplicatedLinear(h, moe.num_experts, dtype=dtype, device=device)
        # V3's bias only steers the choice of experts; transformers keeps it in float32.
        self.e_score_correction_bias = (
            _param((moe.num_experts,), torch.float32, device, ReplicatedLinear._load)
            if routing.topk_method == "noaux_tc" else None)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.load_dtype = torch.float32  # type: ignore[attr-defined]
        if quant_config is None:
            self.experts = FusedExperts(moe.num_experts, h, moe.expert_intermediate_size, tp_rank=tp_rank,
                                        tp_size=tp_size, dtype=dtype, device=device)
        else:
            names = {part: n[0] if self.mixtral_names else n[1] for part, n in _PART_NAMES.items()}
            self.experts = QuantizedExperts(moe.num_experts, h, moe.expert_intermediate_size,
                                            prefix=f"{prefix}.experts", names=names, quant_config=quant_config,
                                            tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
        shared_name = "shared_experts" if self.deepseek else "shared_expert"
        self.shared = (MLP(cfg, intermediate_size=moe.shared_intermediate_size, reduce_results=False,
                           prefix=f"{prefix}.{shared_name}", quant_config=quant_config, **kw)
                       if moe.shared_intermediate_size else None)
        self.shared_gate = ReplicatedLinear(h, 1, dtype=dtype, device=device) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.routing.float32_logits:
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        weights, ids = select_experts(logits, self.top_k, self.routing, self.e_score_correction_bias)
        if not self.routing.float32_weights:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return all_reduce(out, self.tp_size)

    def checkpoint_params(self, prefix: str) -> dict[str, tuple[torch.Tensor, object]]:
        out: dict[str, tuple[torch.Tensor, object]] = {f"{prefix}gate.weight": (self.gate.weight, None)}
        if self.e_score_correction_bias is not None:
            out[f"{prefix}gate.e_score_correction_bias"] = (self.e_score_correction_bias, None)
        out.update(self.experts.checkpoint_params(f"{prefix}experts.", self.mixtral_names))
        if self.shared is not None:
            name = "shared_experts." if self.deepseek else "shared_expert."
            out.update(self.shared.checkpoint_params(prefix + name))
        if self.shared_gate is not None:
            out[f"{prefix}shared_expert_gate.weight"] = (self.shared_gate.weight, None)
        return out
