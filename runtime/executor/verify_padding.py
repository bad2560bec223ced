"""Short verification queries padded up to a captured query length, so that the step replays a graph.

A verification graph replays only *uniform* steps: every sequence has q rows (runtime/executor/
verify_graphs.py). The n-gram lookup often offers a sequence fewer than k drafts, or none, and a
sampled request in a tree step verifies a chain shorter than the tree; such a step would run
eagerly. Padding makes it uniform: a sequence of l < q rows gets q - l trailing dummy rows.

- Dummy rows never write K/V (slot mapping -1); their tokens are 0, their tree masks 0 (the graph
  gives such rows chain masks), their positions continue the sequence's.
- The sequence's context length grows by the padding, so its real rows keep their positions
  (context length - q + j) and, attention being causal, never see a dummy row. The dummy rows read
  cache slots past the sequence's end (stale or block 0 through the graph's zeroed table
  entries), and their outputs are dropped: the hidden states come back in the step's own layout
  (``keep`` selects the real rows), so logits rows, the rejection sampler and EAGLE's hidden states
  never see them.
- A sequence whose padded context would pass max_model_len is not padded (its block table has no
  room for the rows): the step runs eagerly.

On a GPU a replay of b x q rows costs about what a decode step costs (launch-bound), so padding
is nearly free there; on the CPU every row costs, so only a worker with verification graphs pads
(the CPU twin, ``capture=False``, does too: that is how the tests exercise it). Every function here
reads host tensors only, the same on every tensor-parallel rank, so all ranks pad alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.executor.forward_input import ForwardInput


def pad_query_len(max_query_len: int, num_seqs: int, tree_step: bool,
                  families: dict[int, tuple[bool, list[int]]]) -> int | None:
    """The smallest captured query length q >= max_query_len whose graphs hold num_seqs sequences
    (and tree masks, for a tree step), or None. `families`: q -> (tree masks?, batch sizes)."""
    for q in sorted(families):
        tree, sizes = families[q]
        if q >= max_query_len and q > 1 and (tree or not tree_step) and sizes and num_seqs <= max(sizes):
            return q
    return None


def padded_rows(query_lens: list[int], seq_lens: list[int], q: int, max_model_len: int) -> np.ndarray | None:
    """Where each real row lands in the padded step (sequence i's rows start at i x q), or None
    when a query is longer than q or a sequence's padded context would pass max_model_len."""
    lens = np.asarray(query_lens, dtype=np.int64)
    if lens.size == 0 or lens.max() > q or lens.min() < 1:
        return None
    if any(s + q - n > max_model_len for s, n in zip(seq_lens, query_lens)):
        return None
    starts = np.arange(lens.size, dtype=np.int64) * q
    return np.concatenate([np.arange(st, st + n, dtype=np.int64) for st, n in zip(starts, lens)])


def _padded_meta(meta: AttentionMetadata, keep: torch.Tensor, pads: torch.Tensor, q: int) -> AttentionMetadata:
    s = meta.num_seqs
    slots = torch.full((s * q,), -1, dtype=meta.slot_mapping.dtype)
    slots[keep] = meta.slot_mapping
    seq_lens = meta.seq_lens + pads.to(meta.seq_lens.dtype)
    masks = None
    if meta.tree_masks is not None:
        masks = torch.zeros(s * q, dtype=meta.tree_masks.dtype)
        masks[keep] = meta.tree_masks
    groups = None if meta.kv_groups is None else {w: _padded_meta(m, keep, pads, q) for w, m in meta.kv_groups.items()}
    return dataclasses.replace(meta, query_start_loc=torch.arange(s + 1, dtype=meta.query_start_loc.dtype) * q,
                               seq_lens=seq_lens, slot_mapping=slots, max_query_len=q,
                               max_seq_len=int(seq_lens.max()), is_decode_only=False, tree_masks=masks,
                               kv_groups=groups)


def pad_step(step: ForwardInput, q: int, max_model_len: int) -> tuple[ForwardInput, torch.Tensor] | None:
    """(the step with every query padded to q rows, the real rows' indices in it), or None when
    it cannot be padded (a query longer than q, no room before max_model_len, tensors not on the
    host). The padded step's logits_rows are still the original step's: index the hidden states
    with the indices first."""
    meta = step.meta
    if meta.query_start_loc.device.type != "cpu" or meta.is_decode_only or step.lora is not None:
        return None
    qsl = meta.query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    seq_lens = meta.seq_lens.tolist()
    rows = padded_rows(query_lens, seq_lens, q, max_model_len)
    if rows is None:
        return None
    keep = torch.from_numpy(rows)
    s = len(query_lens)
    pads = q - torch.tensor(query_lens, dtype=torch.int64)
    input_ids = torch.zeros(s * q, dtype=step.input_ids.dtype)
    input_ids[keep] = step.input_ids
    # A dummy row sits past its sequence's real rows: at context length + t (< max_model_len).
    row = torch.arange(s * q, dtype=torch.int64)
    seq, j = row // q, row % q
    lens = torch.tensor(query_lens, dtype=torch.int64)
    positions = (torch.tensor(seq_lens, dtype=torch.int64)[seq] + j - lens[seq]).to(step.positions.dtype)
    positions[keep] = step.positions  # tree rows sit at context + depth, not at their row's offset
    padded = dataclasses.replace(step, input_ids=input_ids, positions=positions, meta=_padded_meta(meta, keep, pads, q))
    return padded, keep
