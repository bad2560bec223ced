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


def padded_rows(query_lens, seq_lens, q: int, max_model_len: int) -> np.ndarray | None:
    """Where each real row lands in the padded step (sequence i's rows start at i x q), or None
    when a query is longer than q or a sequence's padded context would pass max_model_len."""
    lens = np.asarray(query_lens, dtype=np.int64)
    if lens.size == 0 or lens.max() > q or lens.min() < 1:
        return None
    if (np.asarray(seq_lens, dtype=np.int64) + q - lens > max_model_len).any():
        return None
    # Row r of the packed step belongs to sequence i = r's query and sits at offset r - start_i.
    starts = np.cumsum(lens) - lens
    seq = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    return seq * q + np.arange(int(lens.sum()), dtype=np.int64) - starts[seq]


# Every array here is on the host and small (a step's rows): numpy, whose calls cost about a
# microsecond, where a torch CPU op costs several; the step runs before every padded replay.


def _scatter(values: torch.Tensor, rows: np.ndarray, size: int, fill: int) -> torch.Tensor:
    out = np.full(size, fill, dtype=values.numpy().dtype)
    out[rows] = values.numpy()
    return torch.from_numpy(out)


def _padded_meta(meta: AttentionMetadata, rows: np.ndarray, pads: np.ndarray, q: int) -> AttentionMetadata:
    s = meta.num_seqs
    seq_lens = meta.seq_lens.numpy() + pads.astype(meta.seq_lens.numpy().dtype)
    groups = None if meta.kv_groups is None else {w: _padded_meta(m, rows, pads, q) for w, m in meta.kv_groups.items()}
    return dataclasses.replace(
        meta, query_start_loc=torch.from_numpy(np.arange(s + 1, dtype=meta.query_start_loc.numpy().dtype) * q),
        seq_lens=torch.from_numpy(seq_lens), slot_mapping=_scatter(meta.slot_mapping, rows, s * q, -1),
        max_query_len=q, max_seq_len=int(seq_lens.max()), is_decode_only=False,
        tree_masks=None if meta.tree_masks is None else _scatter(meta.tree_masks, rows, s * q, 0), kv_groups=groups)


def pad_step(step: ForwardInput, q: int, max_model_len: int) -> tuple[ForwardInput, torch.Tensor] | None:
    """(the step with every query padded to q rows, the real rows' indices in it), or None when
    it cannot be padded (a query longer than q, no room before max_model_len, tensors not on the
    host). The padded step's logits_rows are still the original step's: index the hidden states
    with the indices first."""
    meta = step.meta
    if meta.query_start_loc.device.type != "cpu" or meta.is_decode_only or step.lora is not None:
        return None
    query_lens = np.diff(meta.query_start_loc.numpy()).astype(np.int64)
    seq_lens = meta.seq_lens.numpy().astype(np.int64)
    rows = padded_rows(query_lens, seq_lens, q, max_model_len)
    if rows is None:
        return None
    s = query_lens.size
    input_ids = _scatter(step.input_ids, rows, s * q, 0)
    # A dummy row sits past its sequence's real rows: at context length + t (< max_model_len);
    # real rows keep theirs (a tree's rows sit at context + depth, not at their row's offset).
    seq, j = np.divmod(np.arange(s * q, dtype=np.int64), q)
    positions = (seq_lens - query_lens)[seq] + j
    positions[rows] = step.positions.numpy()
    padded = dataclasses.replace(step, input_ids=input_ids,
                                 positions=torch.from_numpy(positions.astype(step.positions.numpy().dtype)),
                                 meta=_padded_meta(meta, rows, q - query_lens, q))
    return padded, torch.from_numpy(rows)
