"""Medusa's candidate tree: layout and acceptance (tables, and the chain against greedy_verify),
and tree attention over the paged cache: the torch twin against causal paged attention over each
node's own path, the Triton kernel (interpreted) against the twin."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.kernels.reference import paged_attention_ref
from kvserve.kernels.tree_attention import paged_tree_attention, tree_attention_ref
from kvserve.runtime.spec_decode.medusa_tree import (
    accept,
    candidate_tokens,
    chain_choices,
    parse_choices,
    positions,
    tree_layout,
)
from kvserve.runtime.spec_decode.rejection import greedy_verify

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]]


def test_layout():
    t = tree_layout(TREE)
    # Sorted by depth then path: root, (0,), (1,), (2,), (0,0), (0,1), (1,0), (0,0,0)
    assert t.choices == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert t.depths == (0, 1, 1, 1, 2, 2, 2, 3)
    assert t.masks[7] == 0b10010011 and t.masks[6] == 0b1000101
    assert t.children[0] == (1, 2, 3) and t.children[1] == (4, 5)
    assert (t.depth, t.top_k(0), t.top_k(1), t.top_k(2)) == (3, 3, 2, 1)
    assert positions(t, 10) == [10, 11, 11, 11, 12, 12, 12, 13]
    top = [[50, 51, 52], [60, 61], [70]]
    assert candidate_tokens(t, 9, top) == [9, 50, 51, 52, 60, 61, 60, 70]
    # 63 choices fill all 64 bits; the last mask is stored as a negative int64.
    big = tree_layout([[i] for i in range(63)])
    assert big.masks[63] == 1 - (1 << 63) and torch.tensor(big.masks).dtype == torch.int64


@pytest.mark.parametrize("bad, message", [
    ([], "non-empty list"),
    ([[0], []], "non-empty list of ranks"),
    ([[0], [-1]], "ranks >= 0"),
    ([[0], [0]], "appears twice"),
    ([[0, 1]], r"needs its parent path \[0\]"),
    ([[i] for i in range(64)], "at most 63"),
])
def test_bad_choices_name_the_key(bad, message):
    with pytest.raises(ValueError, match=f"speculative_config.speculative_token_tree: .*{message}"):
        parse_choices(bad)
    with pytest.raises(ValueError, match="needs that many heads; the Medusa directory has 2"):
        parse_choices([[0], [0, 0], [0, 0, 0]], num_heads=2)


@pytest.mark.parametrize("target, want_path, want_out", [
    ([50, 60, 0, 0, 70, 0, 0, 99], [0, 1, 4, 7], [50, 60, 70, 99]),  # the whole top-1 chain
    ([51, 0, 60, 0, 0, 0, 5, 0], [0, 2, 6], [51, 60, 5]),  # head 0's second guess, then its child
    ([50, 61, 0, 0, 0, 0, 0, 0], [0, 1, 5], [50, 61, 0]),  # head 1's second guess after the best
    ([7, 0, 0, 0, 0, 0, 0, 0], [0], [7]),  # nothing matches: the target's own token only
])
def test_accept_follows_the_targets_tokens(target, want_path, want_out):
    t = tree_layout(TREE)
    tokens = candidate_tokens(t, 9, [[50, 51, 52], [60, 61], [70]])
    assert accept(t, tokens, target) == (want_path, want_out)


def test_a_chain_tree_accepts_what_greedy_verify_does():
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 4)
        t = tree_layout(chain_choices(k))
        drafts = [rng.randint(0, 3) for _ in range(k)]
        target = [rng.randint(0, 3) for _ in range(k + 1)]
        assert accept(t, [9] + drafts, target)[1] == greedy_verify(target, drafts)


def _cache_with(rows_k, rows_v, block_size, num_blocks, gen):
    """A paged cache holding the given rows (in order) in shuffled blocks, and its block table."""
    kv_heads, dim = rows_k.shape[1:]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    need = -(-rows_k.shape[0] // block_size)
    table = torch.randperm(num_blocks, generator=gen)[:need].to(torch.int32)
    for p in range(rows_k.shape[0]):
        k_cache[table[p // block_size], p % block_size] = rows_k[p]
        v_cache[table[p // block_size], p % block_size] = rows_v[p]
    return k_cache, v_cache, table


def _tree_batch(gen, ctx_lens=(13, 0, 40), heads=4, kv_heads=2, dim=16, block_size=8):
    """Sequences of contexts + the TREE's nodes in the paged cache, with their queries and masks."""
    t = tree_layout(TREE)
    q_len = t.num_nodes
    ks, vs, qs = [], [], []
    for ctx in ctx_lens:
        ks.append(torch.randn(ctx + q_len, kv_heads, dim, generator=gen))
        vs.append(torch.randn(ctx + q_len, kv_heads, dim, generator=gen))
        qs.append(torch.randn(q_len, heads, dim, generator=gen))
    num_blocks = sum(-(-k.shape[0] // block_size) for k in ks) + 8
    k_all = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_all = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    tables = []
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    for k, v in zip(ks, vs):
        need = -(-k.shape[0] // block_size)
        blocks = [free.pop() for _ in range(need)]
        for p in range(k.shape[0]):
            k_all[blocks[p // block_size], p % block_size] = k[p]
            v_all[blocks[p // block_size], p % block_size] = v[p]
        tables.append(blocks)
    width = max(len(b) for b in tables)
    bt = torch.tensor([b + [0] * (width - len(b)) for b in tables], dtype=torch.int32)
    qsl = torch.tensor([i * q_len for i in range(len(ctx_lens) + 1)], dtype=torch.int32)
    seq_lens = torch.tensor([c + q_len for c in ctx_lens], dtype=torch.int32)
    masks = torch.tensor(list(t.masks) * len(ctx_lens), dtype=torch.int64)
    return t, torch.cat(qs), k_all, v_all, qsl, seq_lens, bt, masks, ks, vs


def test_tree_attention_twin_equals_causal_attention_over_each_nodes_own_path():
    gen = torch.Generator().manual_seed(0)
    t, q, k_cache, v_cache, qsl, seq_lens, bt, masks, ks, vs = _tree_batch(gen)
    got = tree_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, masks, 0.25)
    q_len = t.num_nodes
    for s, (k, v) in enumerate(zip(ks, vs)):
        ctx = k.shape[0] - q_len
        for node in range(q_len):
            path = [n for n in range(q_len) if (t.masks[node] >> n) & 1]  # ancestors, in node order = path order
            rows = list(range(ctx)) + [ctx + n for n in path]
            kc, vc, table = _cache_with(k[rows], v[rows], 8, 16, gen)
            want = paged_attention_ref(q[s * q_len + node][None], kc, vc, torch.tensor([0, 1], dtype=torch.int32),
                                       torch.tensor([len(rows)], dtype=torch.int32), table[None], 0.25)
            torch.testing.assert_close(got[s * q_len + node], want[0], rtol=1e-5, atol=1e-5)


def test_chain_masks_are_causal_prefill():
    gen = torch.Generator().manual_seed(1)
    t, q, k_cache, v_cache, qsl, seq_lens, bt, _, _, _ = _tree_batch(gen)
    chain = tree_layout(chain_choices(t.num_nodes - 1))
    masks = torch.tensor(list(chain.masks) * 3, dtype=torch.int64)
    torch.testing.assert_close(tree_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, masks, 0.3),
                               paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, 0.3), rtol=1e-5, atol=1e-5)


def test_triton_kernel_matches_the_twin(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(2)
    _, q, k_cache, v_cache, qsl, seq_lens, bt, masks, _, _ = _tree_batch(gen, ctx_lens=(13, 0, 40), heads=4,
                                                                          kv_heads=2, dim=16)
    want = tree_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, masks, 0.25)
    got = paged_tree_attention(q, k_cache, v_cache, qsl, seq_lens, bt, masks, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # A full 64-node tree (bit 63 set: a negative int64 mask) still masks right.
    big = tree_layout([[i] for i in range(63)])
    kc, vc, table = _cache_with(torch.randn(70, 2, 16, generator=gen), torch.randn(70, 2, 16, generator=gen), 8, 12, gen)
    args = (torch.randn(64, 4, 16, generator=gen), kc, vc, torch.tensor([0, 64], dtype=torch.int32),
            torch.tensor([70], dtype=torch.int32), table[None], torch.tensor(big.masks, dtype=torch.int64), 0.25)
    torch.testing.assert_close(paged_tree_attention(*args), tree_attention_ref(*args), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backends_attend_trees_and_causal_rows_in_one_step(backend, monkeypatch):
    """AttentionMetadata.tree_masks: rows of tree sequences get tree attention, the others (mask
    0) causal attention, in one attend call of either backend."""
    from kvserve.runtime.attention.backend import AttentionMetadata
    from kvserve.runtime.attention.selector import get_attention_backend

    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(3)
    t, q, k_cache, v_cache, qsl, seq_lens, bt, masks, _, _ = _tree_batch(gen)
    n = t.num_nodes
    masks[n:2 * n] = 0  # the second sequence is a plain causal chunk
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt,
                             slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.long), max_query_len=n,
                             max_seq_len=int(seq_lens.max()), tree_masks=masks)
    got = get_attention_backend(backend, "cpu").attend(q, None, None, k_cache, v_cache, meta, 0.25)
    tree = tree_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, torch.tensor(list(t.masks) * 3), 0.25)
    causal = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, 0.25)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:n], tree[:n], **tol)
    torch.testing.assert_close(got[n:2 * n], causal[n:2 * n], **tol)
    torch.testing.assert_close(got[2 * n:], tree[2 * n:], **tol)


FP8 = torch.float8_e4m3fn
OPTIONS = {
    "window": dict(sliding_window=6),
    "window-inside-the-tree": dict(sliding_window=2),
    "soft-cap": dict(logits_soft_cap=1.5),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "fp8": dict(k_scale=torch.tensor(0.5), v_scale=torch.tensor(2.0)),
    "all": dict(sliding_window=5, logits_soft_cap=2.0, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05])),
}


def _options_batch(seed: int, options: dict):
    gen = torch.Generator().manual_seed(seed)
    t, q, k_cache, v_cache, qsl, seq_lens, bt, masks, ks, vs = _tree_batch(gen)
    if "k_scale" in options:  # float8 pools; the rows as stored, for the path reference
        k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
        ks, vs = [k.to(FP8).float() for k in ks], [v.to(FP8).float() for v in vs]
    return gen, t, q, k_cache, v_cache, qsl, seq_lens, bt, masks, ks, vs


@pytest.mark.parametrize("name", list(OPTIONS))
def test_tree_twin_with_windows_soft_caps_alibi_and_fp8_is_causal_attention_over_each_path(name):
    """A node at depth d sees what the last row of its own path (context, then its ancestors at
    positions ctx .. ctx + d) sees in causal attention, window, soft-cap, ALiBi and fp8 included."""
    options = OPTIONS[name]
    gen, t, q, k_cache, v_cache, qsl, seq_lens, bt, masks, ks, vs = _options_batch(4, options)
    got = tree_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, masks, 0.25, **options)
    q_len = t.num_nodes
    for s, (k, v) in enumerate(zip(ks, vs)):
        ctx = k.shape[0] - q_len
        for node in range(q_len):
            path = [n for n in range(q_len) if (t.masks[node] >> n) & 1]
            rows = list(range(ctx)) + [ctx + n for n in path]
            kc, vc, table = _cache_with(k[rows], v[rows], 8, 16, gen)
            if "k_scale" in options:
                kc, vc = kc.to(FP8), vc.to(FP8)
            want = paged_attention_ref(q[s * q_len + node][None], kc, vc, torch.tensor([0, 1], dtype=torch.int32),
                                       torch.tensor([len(rows)], dtype=torch.int32), table[None], 0.25, **options)
            torch.testing.assert_close(got[s * q_len + node], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_triton_tree_kernel_with_windows_soft_caps_alibi_and_fp8_matches_the_twin(name, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    options = OPTIONS[name]
    _, _, q, k_cache, v_cache, qsl, seq_lens, bt, masks, _, _ = _options_batch(5, options)
    want = tree_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, masks, 0.25, **options)
    got = paged_tree_attention(q, k_cache, v_cache, qsl, seq_lens, bt, masks, 0.25, **options)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["all", "fp8"])
def test_backends_attend_trees_with_options_like_the_twin(backend, name, monkeypatch):
    """Both backends' attend calls (the torch backend's tree group, the Triton backend's prefill
    then tree kernel) give the twin's rows for tree sequences and causal rows for the others."""
    from kvserve.runtime.attention.backend import AttentionMetadata
    from kvserve.runtime.attention.selector import get_attention_backend

    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    options = OPTIONS[name]
    _, t, q, k_cache, v_cache, qsl, seq_lens, bt, masks, _, _ = _options_batch(6, options)
    n = t.num_nodes
    masks[n:2 * n] = 0
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt,
                             slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.long), max_query_len=n,
                             max_seq_len=int(seq_lens.max()), tree_masks=masks)
    got = get_attention_backend(backend, "cpu").attend(q, None, None, k_cache, v_cache, meta, 0.25, **options)
    tree = tree_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, torch.tensor(list(t.masks) * 3), 0.25,
                              **options)
    causal = paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, bt, 0.25, **options)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:n], tree[:n], **tol)
    torch.testing.assert_close(got[n:2 * n], causal[n:2 * n], **tol)
    torch.testing.assert_close(got[2 * n:], tree[2 * n:], **tol)
