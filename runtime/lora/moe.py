"""LoRA on mixture-of-experts layers (runtime/models/moe.py): the routed experts and the shared
experts.

Routed experts. PEFT adapts transformers' fused expert parameters through `target_parameters`
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]): one lora_A
[E x r, in] and lora_B [out, r x E] per parameter, read per expert as A_e = A.view(E, r, in)[e]
and B_e = B.view(out, r, E)[..., e], so expert e's weight is W_e + scaling B_e A_e (what PEFT's
ParamWrapper adds to the parameter). Both parameters sit on one `experts` module, so their
tensors are named `experts.lora_A` and `experts.base_layer.lora_A` in wrapping order; the
loader tells them apart by shape (gate_up reads H and writes 2I, down reads I and writes H).

The adapter changes the input of the expert's activation, so it cannot be added after the fused
kernel: a step with adapters runs the experts one at a time (torch, any device), adding each
token's adapter to the gate|up and the down products of the experts it was routed to. Steps
without adapters keep the fused kernel. Tensor parallelism splits like the base: gate|up's B
takes this rank's rows of the intermediate dimension (gate's and up's), down's A its columns;
the partial down products are summed by the block's one all-reduce.

Shared experts are dense MLPs: their gate|up and down take the usual slot wrappers under PEFT's
names (`shared_expert.gate_proj` for Qwen2-MoE, `shared_experts.gate_proj` for DeepSeek).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.runtime.lora.layers import LoRALinear, LoRAState
from kvserve.runtime.models.moe import FusedExperts, route_by_expert

EXPERT_PARTS = ("experts.gate_up_proj", "experts.down_proj")


class ExpertsLoRA(nn.Module):
    """FusedExperts or QuantizedExperts with per-expert LoRA slots beside them:
    gate|up A^T [max_loras, E, H, R], B^T [max_loras, E, R, 2 x I_rank] (gate's rows, then up's);
    down A^T [max_loras, E, I_rank, R], B^T [max_loras, E, R, H]."""

    parts = EXPERT_PARTS

    def __init__(self, base: nn.Module, state: LoRAState, *, max_loras: int, max_rank: int,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.base_layer = base
        self.state = state
        self.num_experts = e = base.num_experts
        if isinstance(base, FusedExperts):
            self.hidden, self.shard = base.w13.shape[2], base.shard
            self.inter, self.start = base.intermediate_size, base.start
            params = base.w13
        else:  # QuantizedExperts: the same split, read from its first expert's layers
            spec = base.gate_up[0].spec
            self.hidden, self.inter = spec.input_size, spec.output_sizes[0]
            self.start, self.shard = spec.output_slices[0]
            dtype = dtype or spec.params_dtype
            params = next(base.parameters())
        dtype = dtype or params.dtype
        device, r, h, i = params.device, max_rank, self.hidden, self.shard
        for name, shape in (("gu_a", (e, h, r)), ("gu_b", (e, r, 2 * i)), ("dn_a", (e, i, r)), ("dn_b", (e, r, h))):
            self.register_buffer(name, torch.zeros(max_loras, *shape, dtype=dtype, device=device), persistent=False)

    def full_shape(self, part: int) -> tuple[int, int, int]:
        """(in_features, out_features, num_experts) of one expert parameter as PEFT sees it."""
        h, i = self.hidden, self.inter
        return (h, 2 * i, self.num_experts) if part == 0 else (i, h, self.num_experts)

    @torch.inference_mode()
    def slot_image(self, rank: int, weights) -> tuple[torch.Tensor, ...]:
        """Host slot contents from (A [E, r, in], scaled B [E, out, r]) per part (None: not adapted)."""
        gu_a, gu_b, dn_a, dn_b = (torch.zeros(b.shape[1:], dtype=b.dtype) for b in (self.gu_a, self.gu_b,
                                                                                      self.dn_a, self.dn_b))
        s, n, inter = self.start, self.shard, self.inter
        if weights[0] is not None:
            a, b = weights[0]
            r = a.shape[1]
            gu_a[:, :, :r] = a.transpose(1, 2)
            rows = torch.cat((b[:, s:s + n], b[:, inter + s:inter + s + n]), dim=1)  # this rank's gate, up
            gu_b[:, :r] = rows.transpose(1, 2)
        if weights[1] is not None:
            a, b = weights[1]
            r = a.shape[1]
            dn_a[:, :, :r] = a[:, :, s:s + n].transpose(1, 2)
            dn_b[:, :r] = b.transpose(1, 2)
        return gu_a, gu_b, dn_a, dn_b

    @torch.inference_mode()
    def set_slot(self, slot: int, image) -> None:
        for buf, value in zip((self.gu_a, self.gu_b, self.dn_a, self.dn_b), image):
            buf[slot].copy_(value, non_blocking=True)

    def _gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if isinstance(base, FusedExperts):
            return x @ base.w13[expert].t()
        return base.gate_up[expert](x)

    def _down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if isinstance(base, FusedExperts):
            return x @ base.w2[expert].t()
        return base.down[expert](x)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        if batch is None:
            return self.base_layer(x, topk_weights, topk_ids)
        token_slots = batch.token_slots
        ranks = self.state.slot_ranks
        out = torch.zeros_like(x)
        weights = topk_weights.reshape(-1)
        for expert, pairs, tokens in route_by_expert(topk_ids, self.num_experts):
            xt = x[tokens]
            # This expert's tokens, grouped by adapter slot (positions among `tokens`).
            groups: dict[int, list[int]] = {}
            for pos, t in enumerate(tokens.tolist()):
                if token_slots[t] >= 0:
                    groups.setdefault(token_slots[t], []).append(pos)
            groups_t = [(s, ranks[s], torch.tensor(p, device=x.device)) for s, p in groups.items()]
            h = self._gate_up(expert, xt)
            for s, r, idx in groups_t:
                a, b = self.gu_a[s, expert, :, :r].to(x.dtype), self.gu_b[s, expert, :r].to(x.dtype)
                h[idx] += (xt[idx] @ a) @ b
            act = ops.silu_and_mul(h)
            y = self._down(expert, act)
            for s, r, idx in groups_t:
                a, b = self.dn_a[s, expert, :, :r].to(x.dtype), self.dn_b[s, expert, :r].to(x.dtype)
                y[idx] += (act[idx] @ a) @ b
            out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
        return out


def wrap_moe(block, state: LoRAState, **kw) -> list[nn.Module]:
    """Wraps a SparseMoeBlock's routed experts and shared experts in place; returns the wrappers."""
    block.experts = ExpertsLoRA(block.experts, state, **kw)
    wrapped: list[nn.Module] = [block.experts]
    shared = block.shared
    if shared is not None:
        pre = "shared_experts." if block.deepseek else "shared_expert."
        shared.gate_up_proj = LoRALinear(shared.gate_up_proj, state, parts=(pre + "gate_proj", pre + "up_proj"),
                                         row_parallel=False, **kw)
        shared.down_proj = LoRALinear(shared.down_proj, state, parts=(pre + "down_proj",), row_parallel=True, **kw)
        wrapped += [shared.gate_up_proj, shared.down_proj]
    return wrapped


_EXPERTS = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts(?:\.base_layer)*$")


def expert_module_layer(module: str) -> int | None:
    """The layer of a PEFT module name that is a layer's routed experts (their parameters'
    wrappers), else None."""
    m = _EXPERTS.match(module)
    return None if m is None else int(m["layer"])


def expert_pair(module: str, layer: int, a: torch.Tensor, b: torch.Tensor, targets, *, max_lora_rank: int,
                scaling: Callable[[str, int], float], only_targets: bool):
    """One expert parameter's LoRA from PEFT's tensors: ((layer, part), (A [E, r, in], scaled
    B [E, out, r]), r), or None for another pipeline stage's layer. ValueError names the problem."""
    shapes = {name: targets.get((layer, name)) for name in EXPERT_PARTS}
    if all(s is None for s in shapes.values()):
        if only_targets:
            return None
        raise ValueError(f"target parameter {module!r}: the model's layer {layer} has no routed experts")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"adapter weights: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                         "which do not form a LoRA pair")
    fits = [(n, s) for n, s in shapes.items() if s is not None and (a.shape[1], b.shape[0]) == tuple(s[:2])]
    if not fits:
        want = ", ".join(f"{n} [{s[1]} x {s[0]}]" for n, s in shapes.items() if s is not None)
        raise ValueError(f"base model mismatch: {module}'s lora_B x lora_A is [{b.shape[0]} x {a.shape[1]}] "
                         f"(out x in), the model's experts are {want}")
    name, (in_f, out_f, experts) = fits[0]
    if a.shape[0] % experts:
        raise ValueError(f"adapter weights: {module} has lora_A of {a.shape[0]} rows, not rank x {experts} experts")
    r = a.shape[0] // experts
    if r > max_lora_rank:
        raise ValueError(f"adapter rank: {module} ({name}) has rank {r}, above max_lora_rank {max_lora_rank}")
    a_e = a.float().reshape(experts, r, in_f)
    b_e = b.float().reshape(out_f, r, experts).permute(2, 0, 1) * scaling(f"model.layers.{layer}.mlp.{name}", r)
    return (layer, name), (a_e.contiguous(), b_e.contiguous()), r
