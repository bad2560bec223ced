"""The contract between the model code and whatever computes paged attention.

A forward pass is *packed*: the new tokens of every scheduled sequence (a whole prompt, a prefill
chunk, one decode token, or k+1 speculative positions) are concatenated along one token axis with
no padding. The KV cache of one layer is a K pool and a V pool, each shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence's tokens live in the blocks its
block table lists, in order.

Each attention layer does, in this order:
  1. ``backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)``
  2. ``out = backend.attend(query, key, value, k_cache, v_cache, meta, scale,
     sliding_window=..., logits_soft_cap=...)``
so by the time ``attend`` runs, the cache already holds the new tokens' K/V as well; a backend may
read them from the cache or from ``key``/``value``, whichever is faster for it.

Per layer, ``sliding_window`` (None: full attention) restricts a query at position i to keys at
positions i - sliding_window < j <= i (transformers' convention), and ``logits_soft_cap`` (None:
off) replaces each scaled score s by cap * tanh(s / cap) before the mask and softmax (Gemma 2).
``alibi_slopes`` (float32 [num_heads], None: off; MPT) adds slope_h * (j - i) to the score of a
query at position i and a key at j (ALiBi), after soft-capping.
A backend never reads a cache slot outside a query's window: the blocks wholly behind every
layer's window may already be freed and reused (their block-table entries are then padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Describes one packed batch. All tensors live on the model's device."""

    # int32 [num_seqs + 1]: sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1].
    query_start_loc: torch.Tensor
    # int32 [num_seqs]: the sequence's context length once this step's tokens are in
    # (tokens already cached + new tokens). Query token j of sequence i sits at absolute position
    # seq_lens[i] - query_len_i + j and attends causally to positions 0..that position.
    seq_lens: torch.Tensor
    # int32 [num_seqs, max_blocks_per_seq]: physical block ids; entries past a sequence's last
    # block are padding (0) and must never be read.
    block_tables: torch.Tensor
    # int64 [num_tokens]: flat cache slot (block_id * block_size + offset) where each new token's
    # K/V is written; -1 means "do not write" (e.g. padding, or positions already cached).
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # True when every sequence has exactly one new token (pure decode): backends may take a
    # faster path.
    is_decode_only: bool = False
    # KV cache groups (runtime/engine/kv_cache_groups.py): per layer window (None: full attention), the
    # metadata whose block_tables / slot_mapping address that group's pools; None when one block
    # table serves every layer. Model code hands each layer ``for_window(its window)``.
    kv_groups: dict[int | None, AttentionMetadata] | None = None
    # Medusa tree verification (runtime/spec_decode/tree_verify.py): int64 [num_tokens], the
    # ancestor bitmask of each query row of a sequence verified as a candidate tree (bit j: the
    # sequence's j-th new row is visible; see kernels/tree_attention.py), 0 on every row of the
    # other sequences, which attend causally. A tree row's position is the context length plus
    # its depth (popcount - 1), not its slot's. None: no tree in the step.
    tree_masks: torch.Tensor | None = None
    # Every sequence of the step is a tree of max_query_len rows (a chain's rows carry chain
    # masks): a backend may run its tree kernel over all rows without reading the device to find
    # the trees (a CUDA graph captures such steps, runtime/executor/cuda_graphs.py).
    all_trees: bool = False

    def for_window(self, window: int | None) -> AttentionMetadata:
        return self if self.kv_groups is None else self.kv_groups[window]

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


class AttentionBackend(Protocol):
    """Implemented by the pure-torch backend (runtime) and the Triton backend (kernels)."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [num_tokens], -1 = skip
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (already written to the cache)
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], same dtype as query
        ...
