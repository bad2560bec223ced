"""The Triton implementation of the runtime's AttentionBackend contract.

``write_kv`` scatters the new tokens into the paged cache; ``attend`` reads everything (cached
prefix and the new tokens) back from the cache. A batch whose queries are all at most one token
long takes the flash-decoding kernel; any other batch (prefill, chunked prefill, cached prefixes,
or a mix with decodes) takes the varlen prefill kernel, which handles any query length >= 1 and
so also the decode rows mixed into it. A batch of uniform short queries without tree masks
(speculative verification's 1 + k rows per sequence) runs as per-row decode queries through the
decode kernel's split-K path (kernels/short_query_attention.py).

The kernels are called through kernels/custom_ops.py, so that torch.compile sees each launch as
one opaque op and never specialises on the launchers' host-side arithmetic (the decode split
count). On CPU tensors the kernels only run under TRITON_INTERPRET=1 (tests); see ``triton_utils``.
"""

from __future__ import annotations

import torch

from kvserve.kernels.custom_ops import decode_attention, prefill_attention, write_kv
from kvserve.kernels.short_query_attention import expand_short_queries, uniform_short_query_len
from kvserve.runtime.attention.backend import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.is_decode_only or meta.max_query_len <= 1:
            return decode_attention(
                query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                scale, max_seq_len=meta.max_seq_len, sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
            )
        q = None if meta.tree_masks is not None else uniform_short_query_len(query.shape[0], meta.num_seqs,
                                                                               meta.max_query_len)
        if q is not None:
            # Verification's uniform short queries: split-K decode rows, not serial prefill tiles
            # (kernels/short_query_attention.py says why).
            qsl, row_lens, row_tables = expand_short_queries(meta.seq_lens, meta.block_tables, q)
            return decode_attention(
                query, k_cache, v_cache, qsl, row_lens, row_tables, scale, max_seq_len=meta.max_seq_len,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                alibi_slopes=alibi_slopes,
            )
        if meta.all_trees and meta.tree_masks is not None:
            from kvserve.kernels.tree_attention import paged_tree_attention

            return paged_tree_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                        meta.block_tables, meta.tree_masks, scale, max_query_len=meta.max_query_len,
                                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                        k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes)
        out = prefill_attention(
            query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            scale, max_query_len=meta.max_query_len, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes,
        )
        if meta.tree_masks is not None:
            _tree_rows(out, query, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                       logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes)
        return out


def _tree_rows(out, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, **options) -> None:
    """Overwrites the rows of the sequences verified as candidate trees (the prefill kernel
    attended them causally) with the tree kernel's, run over just those sequences."""
    from kvserve.kernels.tree_attention import paged_tree_attention

    starts = meta.query_start_loc.tolist()
    masks = meta.tree_masks
    seqs = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > 1 and bool(masks[starts[i]] != 0)]
    if not seqs:
        return
    rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=query.device) for i in seqs])
    idx = torch.tensor(seqs, device=query.device)
    lens = torch.tensor([starts[i + 1] - starts[i] for i in seqs], device=query.device)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32, device=query.device)
    qsl[1:] = lens.cumsum(0)
    out[rows] = paged_tree_attention(query[rows], k_cache, v_cache, qsl, meta.seq_lens[idx],
                                     meta.block_tables[idx], masks[rows], scale, **options)
