"""What one forward pass needs on every tensor-parallel rank, built once on rank 0.

Rank 0's ModelRunner packs the scheduled batch into a ForwardInput on the CPU; the executor hands
the same object to every rank's Worker (pickled once for the worker processes), and each Worker
moves it to its own device. So no rank ever copies a prepared device tensor back to the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.runtime.attention.backend import AttentionMetadata


@dataclass(eq=False)
class ForwardInput:
    input_ids: torch.Tensor  # [num_tokens] packed, no padding
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the hidden states whose logits the step needs (empty: the step only fills the cache).
    logits_rows: list[int]
    # Copy-on-write block copies to apply before the forward pass: (src, dst) pairs, or
    # (group, src, dst) triples with KV cache groups.
    block_copies: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    # Offload-tier operations (runtime/kv_offload/offloader.py) rank 0 has already applied, for
    # the other ranks to apply to their own pools before this forward pass.
    kv_ops: list[tuple] = dataclasses.field(default_factory=list)
    # LoRA (runtime/lora/slots.py's LoRAStepInput): adapters to load into slots and the token
    # layout; None when no token of the step uses an adapter.
    lora: Any = None
    # Pipeline parallelism: every sampling row is plain greedy, so the last stage returns each
    # logits row's argmax (int64 token ids) instead of the rows x vocabulary float32 logits: the
    # same tokens rank 0's Sampler would pick from the same logits, at 8 bytes a row on the wire.
    greedy_ids: bool = False
    # Pipeline parallelism, any other sampling step: the rows' sampling on the last stage
    # (runtime/executor/stage_sampling.py's StageRows), which returns the sampled tokens instead
    # of the logits. None: the logits go to rank 0 (speculative verification).
    stage_rows: Any = None
    # (source slot, destination slot) copies in every layer's pools that rank 0 made after the
    # previous step (a Medusa tree's accepted path), for the other ranks to make before this one.
    kv_slot_moves: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def to(self, device: torch.device) -> ForwardInput:
        if device.type == "cpu":
            return self
        return dataclasses.replace(self, input_ids=_to(self.input_ids, device), positions=_to(self.positions, device),
                                   meta=_meta_to(self.meta, device))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def _meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    groups = meta.kv_groups
    return dataclasses.replace(
        meta, query_start_loc=_to(meta.query_start_loc, device), seq_lens=_to(meta.seq_lens, device),
        tree_masks=None if meta.tree_masks is None else _to(meta.tree_masks, device),
        block_tables=_to(meta.block_tables, device), slot_mapping=_to(meta.slot_mapping, device),
        kv_groups=None if groups is None else {w: _meta_to(m, device) for w, m in groups.items()})
