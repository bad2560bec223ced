"""One rank's adapters: the model's layers wrapped, the host cache, the device slots, and each
step's activation (slots filled, token layout on the device) around the forward pass.

The same class runs on every tensor-parallel rank and pipeline stage: a step's `LoRAStepInput`
names the adapters to put into slots, and each rank loads them (from its host cache, or the
adapter directory) and copies in its own slice of its own layers, so ranks need no other message.
A pipeline stage wraps only its layers, under their global indices. Rank 0 checks an adapter
against every stage's modules (`all_targets`, gathered when the ranks start) before it is
registered, so a bad adapter never reaches another stage; the other stages then read only
their own modules of it.
"""

from __future__ import annotations

import logging

import torch

from kvserve.runtime.lora.layers import LoRABatch, LoRALinear, LoRAState
from kvserve.runtime.lora.peft import MODEL_LEVEL, LoRAWeights, load_adapter
from kvserve.runtime.lora.request import LoRARequest
from kvserve.runtime.lora.slots import LoRAStepInput, LRUCache
from kvserve.runtime.lora.vocab import wrap_vocab

log = logging.getLogger(__name__)


class WorkerLoRA:
    def __init__(self, model, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int, model_dir: str = "",
                 hf_config=None, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.dtype = dtype  # the slots' dtype (lora_dtype); None: the model's
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.model_dir, self.hf_config = model_dir, hf_config
        self.state = LoRAState(max_loras)
        self.cache = LRUCache(max_cpu_loras)  # LoRARequest -> LoRAWeights
        # (layer, PEFT module name) -> (wrapper, part index)
        self.targets: dict[tuple[int, str], tuple[LoRALinear, int]] = {}
        self.wrappers: list[tuple[int, LoRALinear]] = []
        self._wrap()
        # Every pipeline stage's targets (set on rank 0 when the ranks report theirs); None: this
        # rank holds the whole model, or is a later stage that only reads its own modules.
        self.all_targets: dict | None = None
        self.num_layers = getattr(model.config, "num_layers", len(model.layers))
        start = getattr(model, "layer_start", 0)
        self.stage_only = (start, start + len(model.layers)) != (0, self.num_layers)
        model.lora_state = self.state

    def _wrap(self) -> None:
        from kvserve.runtime.lora.mla import wrap_mla
        from kvserve.runtime.lora.moe import wrap_moe
        from kvserve.runtime.models.llama import MLP, Attention
        from kvserve.runtime.models.mla import MLAAttention
        from kvserve.runtime.models.moe import SparseMoeBlock
        from kvserve.runtime.models.mpt import PlainMLP

        kw = dict(max_loras=self.max_loras, max_rank=self.max_lora_rank, dtype=self.dtype)
        for w in wrap_vocab(self.model, self.state, **kw):
            self.wrappers.append((MODEL_LEVEL, w))
            for p, name in enumerate(w.parts):
                self.targets[(MODEL_LEVEL, name)] = (w, p)
        # A pipeline stage's layers keep their global indices (the adapter's names).
        for i, layer in enumerate(self.model.layers, start=getattr(self.model, "layer_start", 0)):
            attn, mlp = layer.self_attn, layer.mlp
            wrapped = []
            if isinstance(attn, Attention):
                attn.qkv_proj = LoRALinear(attn.qkv_proj, self.state, parts=("q_proj", "k_proj", "v_proj"),
                                           row_parallel=False, **kw)
                attn.o_proj = LoRALinear(attn.o_proj, self.state, parts=("o_proj",), row_parallel=True, **kw)
                wrapped += [attn.qkv_proj, attn.o_proj]
            elif isinstance(attn, MLAAttention):
                wrapped += wrap_mla(attn, self.state, rope_interleave=attn.rope_interleave, **kw)
            if isinstance(mlp, MLP):
                mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, self.state, parts=("gate_proj", "up_proj"),
                                              row_parallel=False, **kw)
                mlp.down_proj = LoRALinear(mlp.down_proj, self.state, parts=("down_proj",), row_parallel=True, **kw)
                wrapped += [mlp.gate_up_proj, mlp.down_proj]
            elif isinstance(mlp, PlainMLP):  # MPT, BLOOM, Falcon: ungated (their own names map onto these)
                mlp.up_proj = LoRALinear(mlp.up_proj, self.state, parts=("up_proj",), row_parallel=False, **kw)
                mlp.down_proj = LoRALinear(mlp.down_proj, self.state, parts=("down_proj",), row_parallel=True, **kw)
                wrapped += [mlp.up_proj, mlp.down_proj]
            elif isinstance(mlp, SparseMoeBlock):
                wrapped += wrap_moe(mlp, self.state, **kw)
            for w in wrapped:
                self.wrappers.append((i, w))
                for p, name in enumerate(w.parts):
                    self.targets[(i, name)] = (w, p)

    @property
    def target_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        return {key: w.full_shape(p) for key, (w, p) in self.targets.items()}

    @property
    def slot_bytes(self) -> int:
        """Device memory of the slots (all max_loras of them)."""
        return sum(b.numel() * b.element_size() for _, w in self.wrappers for b in w.buffers(recurse=False))

    # -- host cache ------------------------------------------------------------------------------
    def load(self, request: LoRARequest, protect=()) -> LoRAWeights:
        """The adapter's weights, from the host cache or read and checked now (ValueError)."""
        weights = self.cache.get(request)
        if weights is None:
            weights = load_adapter(request, targets=self.all_targets or self.target_shapes,
                                   max_lora_rank=self.max_lora_rank, num_layers=self.num_layers,
                                   model_dir=self.model_dir, hf_config=self.hf_config,
                                   only_targets=self.all_targets is None and self.stage_only,
                                   model_config=getattr(self.model, "config", None))
            # The host cache keeps this rank's slot images (sliced, padded, in the model dtype)
            # rather than the PEFT matrices: a slot is then filled with two copies per layer.
            weights.images = [w.slot_image(weights.rank, [weights.modules.get((i, name)) for name in w.parts])
                              for i, w in self.wrappers]
            weights.modules = {}
            for evicted in self.cache.put(request, weights, protect=protect):
                log.info("LoRA adapter %s left the host cache (max_cpu_loras %d)", evicted.lora_name,
                         self.cache.capacity)
        return weights

    def remove(self, request: LoRARequest) -> None:
        self.cache.pop(request)

    def pin(self, request: LoRARequest) -> None:
        self.cache.pinned.add(request)

    # -- every step ------------------------------------------------------------------------------
    def _fill_slot(self, slot: int, weights: LoRAWeights) -> None:
        for (_, w), image in zip(self.wrappers, weights.images):
            w.set_slot(slot, image)
        self.state.slot_ranks[slot] = weights.rank

    def begin_step(self, step: LoRAStepInput, device: torch.device) -> None:
        step_requests = [r for _, r in step.loads]
        for slot, request in step.loads:
            self._fill_slot(slot, self.load(request, protect=step_requests))
        layout = step.layout
        if not layout.segments:
            self.state.batch = None
            return
        self.state.batch = LoRABatch(layout, device, self.max_loras)
        self.model.lora_active = True

    def set_logits_rows(self, rows) -> None:
        """The step's rows the LM head computes logits for (their adapters' head LoRA)."""
        batch = self.state.batch
        self.state.logits_slots = None if batch is None else [batch.token_slots[r] for r in rows]

    def end_step(self) -> None:
        self.state.batch = None
        self.state.logits_slots = None
        self.model.lora_active = False
