"""Medusa tree verification on the native CPU decode stack: each tree node runs as a decode row
whose mask (kv_paged_decode_f32's `tree_masks`) drops its siblings' slots.

A node's attention must equal the tree kernel's twin, and be bit-identical to the plain decode row
of its path laid out in order: that is what makes greedy output with a tree equal greedy output
without speculation on this path (tests/test_medusa_tree_engine.py checks the engine end to end).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import native
from kvserve.kernels.tree_attention import tree_attention_ref
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.models.native_decode import tree_rows
from kvserve.runtime.spec_decode.medusa_tree import tree_layout

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels unavailable")

TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0)]
BS = 4


def _cache(g, heads_kv=2, d=24, blocks=48):
    return (torch.randn(blocks, BS, heads_kv, d, generator=g), torch.randn(blocks, BS, heads_kv, d, generator=g))


def _path(masks, j):
    return [i for i in range(64) if (masks[j] & (1 << 64) - 1) >> i & 1]


def test_native_tree_rows_equal_the_twin_and_the_plain_decode_of_each_path():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = _cache(g)
    layout = tree_layout(TREE)
    t = layout.num_nodes
    # Sequence 0: a tree after 13 cached tokens; sequence 1: a causal chain of 3 rows after 0;
    # sequence 2: a tree with nothing cached before it.
    q_lens, ctxs = [t, 3, t], [13, 0, 0]
    tables = torch.stack([torch.randperm(48, generator=g)[:8] for _ in range(3)]).int()
    starts = torch.tensor([0, t, t + 3, 2 * t + 3], dtype=torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(ctxs, q_lens)], dtype=torch.int32)
    masks = torch.tensor(list(layout.masks) + [0, 0, 0] + list(layout.masks), dtype=torch.int64)
    q = torch.randn(2 * t + 3, 6, 24, generator=g)
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=seq_lens, block_tables=tables,
                             slot_mapping=torch.zeros(2 * t + 3, dtype=torch.long), max_query_len=t,
                             max_seq_len=int(seq_lens.max()), is_decode_only=False, tree_masks=masks)
    row_tables, row_lens, row_masks = tree_rows(meta)
    assert row_lens.tolist() == [13 + j + 1 for j in range(t)] + [1, 2, 3] + [j + 1 for j in range(t)]
    out = native.paged_decode_attention(q, k_cache, v_cache, row_tables, row_lens, 0.2, tree_masks=row_masks)
    # The twin reads every row as a tree node: the causal chain as its chain tree.
    chain = torch.tensor(list(layout.masks) + [1, 3, 7] + list(layout.masks), dtype=torch.int64)
    want = tree_attention_ref(q, k_cache, v_cache, starts, seq_lens, tables, chain, 0.2)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    # Node j of sequence 0, against a plain decode row over a cache holding its path in order.
    for j in range(t):
        path = _path(layout.masks, j)
        k2, v2 = k_cache.clone(), v_cache.clone()
        for n, node in enumerate(path):
            src, dst = 13 + node, 13 + n
            for c, c2 in ((k_cache, k2), (v_cache, v2)):
                c2[tables[0, dst // BS], dst % BS] = c[tables[0, src // BS], src % BS]
        plain = native.paged_decode_attention(q[j:j + 1], k2, v2, tables[:1], torch.tensor([13 + len(path)],
                                              dtype=torch.int32), 0.2)
        assert torch.equal(plain[0], out[j])


def test_a_full_64_node_tree_and_bad_masks():
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = _cache(g, blocks=40)
    chain = [(0,) * n for n in range(1, 64)]  # 64 nodes: node 63's mask has bit 63 set (negative)
    layout = tree_layout(chain)
    assert layout.masks[63] < 0
    tables = torch.randperm(40, generator=g)[:20].int()[None]
    q = torch.randn(64, 6, 24, generator=g)
    lens = torch.arange(6, 70, dtype=torch.int32)
    out = native.paged_decode_attention(q, k_cache, v_cache, tables.expand(64, -1), lens, 0.3,
                                        tree_masks=torch.tensor(layout.masks))
    causal = native.paged_decode_attention(q, k_cache, v_cache, tables.expand(64, -1), lens, 0.3)
    assert torch.equal(out, causal)  # a chain's tree is causal attention
    with pytest.raises(ValueError, match="tree_masks: expected int64"):
        native.paged_decode_attention(q, k_cache, v_cache, tables.expand(64, -1), lens, 0.3,
                                      tree_masks=torch.ones(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="not with a sliding window"):
        native.paged_decode_attention(q, k_cache, v_cache, tables.expand(64, -1), lens, 0.3, window=8,
                                      tree_masks=torch.tensor(layout.masks))


def test_prefill_length_queries_and_wide_steps_keep_the_per_op_path():
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 65], dtype=torch.int32),
                             seq_lens=torch.tensor([65], dtype=torch.int32),
                             block_tables=torch.zeros(1, 20, dtype=torch.int32),
                             slot_mapping=torch.zeros(65, dtype=torch.long), max_query_len=65, max_seq_len=65,
                             is_decode_only=False, tree_masks=torch.zeros(65, dtype=torch.int64))
    assert tree_rows(meta) is None
    wide = AttentionMetadata(query_start_loc=torch.arange(0, 57, 8, dtype=torch.int32),  # 7 trees, 56 rows
                             seq_lens=torch.full((7,), 20, dtype=torch.int32),
                             block_tables=torch.zeros(7, 20, dtype=torch.int32),
                             slot_mapping=torch.zeros(56, dtype=torch.long), max_query_len=8, max_seq_len=20,
                             is_decode_only=False, tree_masks=torch.ones(56, dtype=torch.int64))
    assert tree_rows(wide) is None
