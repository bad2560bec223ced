"""LoRA on the vocabulary layers: the token embedding and the LM head (PEFT target modules
``embed_tokens`` and ``lm_head``).

One wrapper stands for one VocabParallelEmbedding and adapts what the model uses it for: its
forward (the embedding), its ``logits`` (the LM head; with tied embeddings the same table is
both, and PEFT adapts the two uses separately, so one wrapper may carry both parts).

Slots, per part:
- embedding: A^T ``[max_loras, vocab, max_rank]`` (PEFT's ``lora_embedding_A`` is ``[r, vocab]``:
  a token's row of A^T is what the one-hot product picks) and scaled B^T ``[max_loras, max_rank,
  hidden]``;
- LM head: A^T ``[max_loras, hidden, max_rank]`` and scaled B^T ``[max_loras, max_rank, vocab]``.

Both are added outside the base layer, after its all-reduce (embedding) or all-gather (logits),
so at tensor parallelism every rank holds the whole A and B and adds the same product: nothing
to shard, at the cost of a copy per rank (vocab x rank per slot, a few MiB).

Which rows: the embedding reads the step's LoRABatch (every token of the step); the head reads
``LoRAState.logits_slots``, each logits row's slot, which the worker sets for the rows it
samples. A slot whose adapter does not adapt a part costs nothing (``active``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvserve.runtime.lora.layers import LoRABatch, LoRAState, WrapsBaseLayer

EMBED, HEAD = "embed_tokens", "lm_head"


def segment_rows(batch: LoRABatch):
    """(slot, token rows) per segment of a step: a slice, or the gathered rows' index."""
    for slot, start, end in batch.segments:
        yield slot, (slice(start, end) if batch.perm is None else batch.perm[start:end])


class LoRAVocab(WrapsBaseLayer):
    """A VocabParallelEmbedding with adapter slots for `parts` (EMBED and/or HEAD)."""

    def __init__(self, base: nn.Module, state: LoRAState, *, parts: Sequence[str], max_loras: int,
                 max_rank: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.base_layer = base
        self.state = state
        self.parts = list(parts)
        spec = base.spec
        dtype, device = dtype or spec.params_dtype, spec.device
        self.slot_dtype = dtype
        self.vocab, self.hidden = base.vocab_size, spec.input_size
        self.active = {p: [False] * max_loras for p in self.parts}
        for p in self.parts:
            rows, cols = (self.vocab, self.hidden) if p == EMBED else (self.hidden, self.vocab)
            self.register_buffer(f"{p}_a_t", torch.zeros(max_loras, rows, max_rank, dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"{p}_b_t", torch.zeros(max_loras, max_rank, cols, dtype=dtype, device=device),
                                 persistent=False)

    # -- slots (the interface runtime/lora/worker.py uses for every wrapper) ---------------------
    def full_shape(self, part: int) -> tuple[int, int]:
        """(in, out) as PEFT's matrices see the part: A [r, in], B [out, r]."""
        return (self.vocab, self.hidden) if self.parts[part] == EMBED else (self.hidden, self.vocab)

    @torch.inference_mode()
    def slot_image(self, rank: int, weights: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> list:
        """Per part: None (not adapted: no host copy) or (A^T, scaled B^T) padded to `rank`."""
        images = []
        for p, ab in zip(self.parts, weights):
            if ab is None:
                images.append(None)
                continue
            a, b = ab
            a_t = torch.zeros(getattr(self, f"{p}_a_t").shape[1:], dtype=self.slot_dtype)
            b_t = torch.zeros(getattr(self, f"{p}_b_t").shape[1:], dtype=self.slot_dtype)
            r = a.shape[0]
            a_t[:, :r] = a.t().to(a_t.dtype)
            b_t[:r] = b.t().to(b_t.dtype)
            images.append((a_t, b_t))
        return images

    @torch.inference_mode()
    def set_slot(self, slot: int, image: list) -> None:
        for p, part in zip(self.parts, image):
            self.active[p][slot] = part is not None
            if part is not None:  # an inactive slot is never read: no need to clear it
                getattr(self, f"{p}_a_t")[slot].copy_(part[0], non_blocking=True)
                getattr(self, f"{p}_b_t")[slot].copy_(part[1], non_blocking=True)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(input_ids)
        batch = self.state.batch
        if batch is None or EMBED not in self.active:
            return out
        active, ranks = self.active[EMBED], self.state.slot_ranks
        for slot, rows in segment_rows(batch):
            if active[slot]:
                r = ranks[slot]
                delta = self.embed_tokens_a_t[slot, :, :r][input_ids[rows]] @ self.embed_tokens_b_t[slot, :r]
                out[rows] += delta.to(out.dtype)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.base_layer.logits(hidden)
        slots = self.state.logits_slots
        if slots is None or HEAD not in self.active:
            return out
        active, ranks = self.active[HEAD], self.state.slot_ranks
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot >= 0 and active[slot]:
                by_slot.setdefault(slot, []).append(row)
        for slot, rows in by_slot.items():
            r = ranks[slot]
            index = torch.tensor(rows, device=hidden.device)
            a, b = self.lm_head_a_t[slot, :, :r], self.lm_head_b_t[slot, :r]
            delta = (hidden[index].to(a.dtype) @ a) @ b
            out[index] += delta.to(out.dtype)
        return out


def wrap_vocab(model, state: LoRAState, *, max_loras: int, max_rank: int,
               dtype: torch.dtype | None = None) -> list[LoRAVocab]:
    """Wraps the model's embedding and LM head (those this stage holds) in place; returns the
    wrappers. Gemma's scaled embedding is left alone: PEFT's embedding product would be added
    before or after the scale depending on the transformers version, so it is refused instead
    (the adapter's target module is then one the model lacks)."""
    from kvserve.runtime.models.layers import VocabParallelEmbedding

    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    first = getattr(model, "layer_start", 0) == 0
    end = getattr(model, "layer_end", None)
    last = end is None or end == model.config.num_layers
    kw = dict(max_loras=max_loras, max_rank=max_rank, dtype=dtype)
    out = []
    if isinstance(embed, VocabParallelEmbedding):
        parts = []
        if first and getattr(model, "embed_scale", None) is None:
            parts.append(EMBED)
        if head is None and last:  # tied: the embedding is the head
            parts.append(HEAD)
        if parts:
            model.embed_tokens = LoRAVocab(embed, state, parts=parts, **kw)
            out.append(model.embed_tokens)
    if isinstance(head, VocabParallelEmbedding):
        model.lm_head = LoRAVocab(head, state, parts=[HEAD], **kw)
        out.append(model.lm_head)
    return out
