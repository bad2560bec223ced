"""LoRA wrappers around the decoder's linear layers, and the per-step batch they read.

With LoRA enabled, each adaptable layer (fused q|k|v and gate|up, o_proj, down_proj) is replaced
by a wrapper that runs the base layer unchanged and then adds the step's adapter products through
`ops.lora_sgmv`. Without LoRA nothing is wrapped: the decoder runs exactly the code it ran before.

Slots: every wrapper holds `a_t [max_loras, in_local, C]` and `b_t [max_loras, C, out_local]`
(C = parts x max_lora_rank). A fused layer's parts each have their own A, so their A rows are
stacked and their B is block-diagonal: one shrink and one expand per adapter for q, k and v
together. Slot s uses its first `parts x rank_s` columns; the rest stay zero.

Tensor parallelism follows the base layer: a column-parallel layer keeps A whole and takes its
rows of B (this rank's output slice of each part); a row-parallel layer takes its columns of A
(its input slice) and keeps B whole, and adds its partial product before the layer's one
all-reduce, since (sum of partial shrinks) @ B = sum of (partial shrink @ B).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.runtime.lora.slots import segment_starts
from kvserve.runtime.models.layers import all_reduce


class LoRABatch:
    """One step's token layout on this rank's device (from slots.StepLayout). The index tensors
    are built when a layer first reads them: a decode step the CPU's native stack runs reads only
    `token_slots`, so it builds none."""

    def __init__(self, layout, device: torch.device, num_slots: int) -> None:
        self.layout, self.device, self.num_slots = layout, device, num_slots
        self.segments: list[tuple[int, int, int]] = layout.segments
        self.token_slots: list[int] = layout.token_slots  # per token: its slot, -1 for the base model
        self.max_seg_len = max(e - s for _, s, e in layout.segments)
        self.cols: list[int] = []  # per slot: columns in use (parts x rank) -- per layer, set by the wrapper
        self.out_parts: list[tuple[int, int]] | None = None  # per fused part: output columns -- likewise

    def _ints(self, values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    @cached_property
    def perm(self) -> torch.Tensor | None:
        """Gathered token order, or None when segments index tokens directly."""
        return None if self.layout.perm is None else self._ints(self.layout.perm, torch.long)

    @cached_property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gather [max_loras, M], scatter [max_loras * M]): the batched form (reference.lora_sgmv_ref)."""
        p = self.layout.padded
        return None if p is None else (self._ints(p[0], torch.long).view(self.num_slots, -1),
                                       self._ints(p[1], torch.long))

    @cached_property
    def token_idx(self) -> torch.Tensor:
        """[num_tokens] int32: token rows, segment after segment (Triton)."""
        layout = self.layout
        return self._ints(layout.perm if layout.perm is not None
                          else [t for _, s, e in layout.segments for t in range(s, e)])

    @cached_property
    def seg_slot(self) -> torch.Tensor:
        return self._ints([s for s, _, _ in self.segments])

    @cached_property
    def seg_start(self) -> torch.Tensor:
        return self._ints(segment_starts(self.segments))

    @cached_property
    def seg_len(self) -> torch.Tensor:
        return self._ints([e - s for _, s, e in self.segments])


class LoRAState:
    """Shared by every wrapper of a model: the batch of the step now running (None: base only),
    each slot's rank, and the slot of each row the LM head computes logits for (runtime/lora/
    vocab.py; set by the worker for those rows, None outside a step with adapters)."""

    def __init__(self, num_slots: int) -> None:
        self.batch: LoRABatch | None = None
        self.slot_ranks = [0] * num_slots
        self.logits_slots: list[int] | None = None


class WrapsBaseLayer(nn.Module):
    """An adapter wrapper that answers for its `base_layer`: what it does not define itself
    (loading, shapes, quantization attributes) is the base layer's, for code that inspects layers."""

    def checkpoint_params(self, *args, **kw):
        return self.base_layer.checkpoint_params(*args, **kw)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules") or {}
            if "base_layer" not in modules:
                raise
            return getattr(modules["base_layer"], name)


class LoRALinear(WrapsBaseLayer):
    """A MergedColumnParallelLinear or RowParallelLinear with LoRA slots beside it."""

    def __init__(self, base: nn.Module, state: LoRAState, *, parts: Sequence[str], row_parallel: bool,
                 max_loras: int, max_rank: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.base_layer = base
        self.state = state
        self.parts = list(parts)  # PEFT module names, one per fused part
        self.row_parallel = row_parallel
        spec = base.spec
        self.tp_rank, self.tp_size = spec.tp_rank, spec.tp_size
        if row_parallel:
            self.in_start, self.in_local = spec.input_slice
            self.out_local = spec.out_features
            # (full out size, this rank's start, size) per part
            self.out_slices = [(spec.output_sizes[0], 0, spec.output_sizes[0])]
        else:
            self.in_start, self.in_local = 0, spec.input_size
            self.out_slices = [(full, start, size) for full, (start, size) in zip(spec.output_sizes, spec.output_slices)]
            self.out_local = sum(size for _, _, size in self.out_slices)
        # Each part's output columns in this rank's slice (B's diagonal blocks).
        bounds = [0]
        for _, _, size in self.out_slices:
            bounds.append(bounds[-1] + size)
        self.out_parts = list(zip(bounds, bounds[1:]))
        self.full_in = spec.input_size
        c = len(self.parts) * max_rank
        dtype, device = dtype or spec.params_dtype, spec.device
        self.register_buffer("a_t", torch.zeros(max_loras, self.in_local, c, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b_t", torch.zeros(max_loras, c, self.out_local, dtype=dtype, device=device),
                             persistent=False)

    # -- slots -----------------------------------------------------------------------------------
    def full_shape(self, part: int) -> tuple[int, int]:
        """(in_features, out_features) of one part as PEFT sees it (unsharded)."""
        return self.full_in, self.out_slices[part][0]

    @torch.inference_mode()
    def slot_image(self, rank: int, weights: Sequence[tuple[torch.Tensor, torch.Tensor] | None]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One adapter's slot contents on the host, built once when it is loaded: its (A [r, in],
        scaled B [out, r]) per part (None: the part is not adapted), this rank's slice of them,
        padded to `rank` per part. Filling a slot is then two copies."""
        a_t = torch.zeros(self.a_t.shape[1:], dtype=self.a_t.dtype)
        b_t = torch.zeros(self.b_t.shape[1:], dtype=self.b_t.dtype)
        offset = 0
        for p, ab in enumerate(weights):
            _, start, size = self.out_slices[p]
            if ab is not None:
                a, b = ab
                r = a.shape[0]
                cols = slice(p * rank, p * rank + r)
                a_t[:, cols] = a[:, self.in_start:self.in_start + self.in_local].t().to(a_t.dtype)
                b_t[cols, offset:offset + size] = b[start:start + size].t().to(b_t.dtype)
            offset += size
        return a_t, b_t

    @torch.inference_mode()
    def set_slot(self, slot: int, image: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.a_t[slot].copy_(image[0], non_blocking=True)
        self.b_t[slot].copy_(image[1], non_blocking=True)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        batch = self.state.batch
        if not self.row_parallel:
            out = base(x)
            if batch is not None:
                self._add(x, out, batch)
            return out
        out = base.quant_method.apply(base, x)
        if batch is not None:
            self._add(x, out, batch)
        if not base.reduce_results:
            return out
        out = all_reduce(out, base.tp_size)
        return out + base.bias if base.bias is not None else out

    def _add(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        n = len(self.parts)
        batch.cols = [n * r for r in self.state.slot_ranks]
        batch.out_parts = self.out_parts
        ops.lora_sgmv(x, out, self.a_t, self.b_t, batch)

