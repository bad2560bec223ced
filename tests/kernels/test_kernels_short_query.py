"""Uniform short queries (speculative verification's 1 + k rows per sequence) as per-row decode
queries through the decode kernel's split-K path (kernels/short_query_attention.py): the same
attention as the prefill kernel computes, for every option the backend passes on."""

from __future__ import annotations

import pytest
import torch
from test_kernels_attention import TOL, Batch, _assert_close

from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention
from kvserve.kernels.short_query_attention import SHORT_QUERY_MAX_ROWS, expand_short_queries, uniform_short_query_len
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.attention.triton_backend import TritonAttentionBackend


@pytest.mark.parametrize("tokens,seqs,max_q,want", [
    (15, 3, 5, 5),  # uniform verification
    (14, 3, 5, None),  # one query shorter: not uniform (the prefill kernel takes it)
    (3, 3, 1, None),  # decode
    (2 * 17, 2, 17, None),  # past SHORT_QUERY_MAX_ROWS: a prefill
    (2 * SHORT_QUERY_MAX_ROWS, 2, SHORT_QUERY_MAX_ROWS, SHORT_QUERY_MAX_ROWS),
    (0, 0, 5, None),
])
def test_uniform_short_query_len(tokens, seqs, max_q, want):
    assert uniform_short_query_len(tokens, seqs, max_q) == want


def test_expand_short_queries_gives_each_row_its_own_prefix():
    seq_lens = torch.tensor([7, 12], dtype=torch.int32)
    tables = torch.tensor([[3, 4, 0], [5, 6, 7]], dtype=torch.int32)
    qsl, lens, rows = expand_short_queries(seq_lens, tables, 3)
    assert qsl.tolist() == list(range(7))
    assert lens.tolist() == [5, 6, 7, 10, 11, 12]
    assert rows.tolist() == [[3, 4, 0]] * 3 + [[5, 6, 7]] * 3


def _meta(b, q, max_seq_len):
    n = b.query.shape[0]
    return AttentionMetadata(query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_tables=b.block_tables,
                             slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=b.query.device),
                             max_query_len=q, max_seq_len=max_seq_len)


# (dtype, head_dim, heads, kv_heads, q, contexts before the query, options)
CASES = [
    (torch.float32, 64, 8, 2, 5, [0, 11, 40], {}),  # the spec_decode bench's shape: GQA 4, k = 4
    (torch.float32, 64, 8, 2, 5, [3, 60], dict(sliding_window=8, logits_soft_cap=30.0)),  # Gemma 2's options
    (torch.bfloat16, 128, 4, 4, 3, [17, 30], {}),
    (torch.float16, 80, 6, 1, 8, [9, 33], dict(alibi=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-q{c[4]}-{'-'.join(c[6]) or 'plain'}")
def test_backend_short_queries_equal_the_prefill_kernel(case, device):
    dtype, dim, heads, kv_heads, q, contexts, opts = case
    b = Batch([(c, q) for c in contexts], dtype=dtype, head_dim=dim, block_size=16, heads=heads, kv_heads=kv_heads,
              seed=q * 13 + dim, device=device)
    options = {k: v for k, v in opts.items() if k != "alibi"}
    if opts.get("alibi"):
        options["alibi_slopes"] = torch.linspace(0.05, 0.5, heads, device=device)
    # As a CUDA graph launches it: max_seq_len is max_model_len, not the batch's longest.
    meta = _meta(b, q, max_seq_len=1024)
    out = TritonAttentionBackend().attend(b.query, b.query, b.query, b.k_cache, b.v_cache, meta, b.scale, **options)
    prefill = paged_prefill_attention(*b.args(), max_query_len=q, out=b.poisoned_out(), **options)
    _assert_close(out, prefill, dtype)
    if not options:
        _assert_close(out, b.expected(), dtype)


@pytest.mark.parametrize("splits", [2, 5])
def test_short_queries_across_splits_equal_the_reference(splits, device):
    """The split-K path and its merge (on a GPU the launch picks the splits; the interpreter's
    launch runs one, so they are forced here), rows of one sequence ending in different splits."""
    q = 5
    b = Batch([(0, q), (45, q), (70, q)], dtype=torch.float32, head_dim=64, block_size=16, heads=8, kv_heads=2,
              seed=splits, device=device)
    qsl, lens, tables = expand_short_queries(b.seq_lens, b.block_tables, q)
    out = paged_decode_attention(b.query, b.k_cache, b.v_cache, qsl, lens, tables, b.scale, max_seq_len=1024,
                                 num_splits=splits, min_split_tokens=16, out=b.poisoned_out())
    torch.testing.assert_close(out, b.expected(), **TOL[torch.float32])


def test_a_ragged_step_keeps_the_prefill_kernel(device):
    """Queries of different lengths (a step that was not padded) go to the prefill kernel."""
    b = Batch([(10, 5), (20, 3)], dtype=torch.float32, head_dim=64, block_size=16, heads=4, kv_heads=2, seed=1,
              device=device)
    out = TritonAttentionBackend().attend(b.query, b.query, b.query, b.k_cache, b.v_cache, _meta(b, 5, 30), b.scale)
    _assert_close(out, b.expected(), torch.float32)
