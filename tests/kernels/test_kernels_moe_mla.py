"""The fused MoE and MLA decode kernels against their torch twins, under Triton's interpreter.

The twins are themselves checked against transformers through the model tests; here the kernels
must match the twins on the cases the runtime produces: decode-sized and prefill-sized batches,
experts with no tokens, one expert taking every token, float32 / bfloat16, and (MLA) scattered
block tables, context lengths off block boundaries, sequences with no query this step and split
contexts merged across programs.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference
from kvserve.kernels.mla import mla_decode_attention
from kvserve.kernels.moe import align_by_expert, fused_moe

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _experts(e, h, i, dtype, g):
    w13 = (0.1 * torch.randn(e, 2 * i, h, generator=g)).to(dtype)
    w2 = (0.1 * torch.randn(e, h, i, generator=g)).to(dtype)
    return w13, w2


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,block_m", [
    (1, 8, 2, 64, 32, None),      # one decode token
    (5, 4, 2, 48, 40, 16),        # hidden and intermediate not multiples of the tiles
    (37, 8, 3, 64, 64, 16),       # several tiles per expert
    (64, 16, 4, 32, 16, 64),      # many experts idle at block_m 64
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_twin(tokens, experts, top_k, hidden, inter, block_m, dtype, device):
    g = torch.Generator().manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13, w2 = _experts(experts, hidden, inter, dtype, g)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    x, w13, w2, weights, ids = (t.to(device) for t in (x, w13, w2, weights, ids))
    want = reference.fused_moe_ref(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids, block_m=block_m)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_fused_moe_one_expert_takes_every_token_and_weights_in_model_dtype(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 32, generator=g)
    w13, w2 = _experts(4, 32, 16, torch.float32, g)
    ids = torch.stack([torch.full((20,), 3), torch.arange(20) % 2], dim=1)
    weights = torch.rand(20, 2, generator=g)
    x, w13, w2, weights, ids = (t.to(device) for t in (x, w13, w2, weights, ids))
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, block_m=16),
                               reference.fused_moe_ref(x, w13, w2, weights, ids), **TOL[torch.float32])


def test_align_by_expert_pads_each_expert_to_whole_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    sorted_ids, expert_ids = align_by_expert(ids, num_experts=5, block_m=2)
    sentinel = ids.numel()
    tiles = sorted_ids.view(-1, 2).tolist()
    used = [(e, t) for e, t in zip(expert_ids.tolist(), tiles) if e >= 0]
    # expert 0: pairs 1, 4; expert 1: pair 3 (+pad); expert 2: pairs 0, 2, 5, 6 in order; expert 3: 7.
    assert used == [(0, [1, 4]), (1, [3, sentinel]), (2, [0, 2]), (2, [5, 6]), (3, [7, sentinel])]
    assert all(e == -1 for e in expert_ids.tolist()[len(used):])


def test_ops_fused_moe_dispatches_to_the_kernel_in_triton_mode(device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, generator=g)
    w13, w2 = _experts(4, 32, 16, torch.float32, g)
    weights, ids = torch.topk(torch.randn(3, 4, generator=g).softmax(-1), 2)
    x, w13, w2, weights, ids = (t.to(device) for t in (x, w13, w2, weights, ids))
    with ops.kernel_mode("triton"):
        got = ops.fused_moe(x, w13, w2, weights, ids)
    with ops.kernel_mode("torch"):
        want = ops.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def _paged_latents(seq_lens, block_size, dim, dtype, g, num_blocks=64):
    cache = torch.randn(num_blocks, block_size, 1, dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append([perm.pop() for _ in range(need)] + [0] * (width - need))
    return cache, torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize("seq_lens,heads,lora,rope,block_size,split", [
    ([1, 7, 33], 4, 32, 8, 4, None),           # tiny, off block boundaries
    ([70, 5, 129], 16, 64, 16, 16, 32),        # split contexts merged
    ([200], 20, 32, 8, 8, 64),                 # heads not a multiple of the 16-head tile
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_matches_twin(seq_lens, heads, lora, rope, block_size, split, dtype, device):
    g = torch.Generator().manual_seed(sum(seq_lens) + heads)
    cache, tables = _paged_latents(seq_lens, block_size, lora + rope, dtype, g)
    n = len(seq_lens)
    q = torch.randn(n, heads, lora + rope, generator=g).to(dtype)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (lora + rope) ** -0.5
    q, cache, qsl, lens, tables = (t.to(device) for t in (q, cache, qsl, lens, tables))
    want = reference.mla_decode_ref(q, cache, qsl, lens, tables, scale, lora)
    got = mla_decode_attention(q, cache, qsl, lens, tables, scale, lora, num_splits=None if split is None else 32,
                               min_split_tokens=split)
    assert got.shape == (n, heads, lora) and not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_mla_decode_skips_sequences_without_a_query(device):
    g = torch.Generator().manual_seed(5)
    cache, tables = _paged_latents([9, 12, 4], 4, 40, torch.float32, g)
    q = torch.randn(2, 4, 40, generator=g)
    qsl = torch.tensor([0, 1, 1, 2], dtype=torch.int32)  # the middle sequence has no token
    lens = torch.tensor([9, 12, 4], dtype=torch.int32)
    cache, tables, q, qsl, lens = (t.to(device) for t in (cache, tables, q, qsl, lens))
    got = mla_decode_attention(q, cache, qsl, lens, tables, 0.2, 32)
    torch.testing.assert_close(got, reference.mla_decode_ref(q, cache, qsl, lens, tables, 0.2, 32),
                               **TOL[torch.float32])


def test_torch_mla_decode_path_matches_twin():
    """The runtime's CPU path (batched SDPA over length-sorted groups) against the same twin."""
    from kvserve.runtime.attention.backend import AttentionMetadata
    from kvserve.runtime.attention.mla import TorchMLAAttention, build_plan

    g = torch.Generator().manual_seed(6)
    seq_lens = [3, 17, 9, 40]
    cache, tables = _paged_latents(seq_lens, 4, 40, torch.float32, g)
    q = torch.randn(4, 6, 40, generator=g)
    meta = AttentionMetadata(query_start_loc=torch.arange(5, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             slot_mapping=torch.zeros(4, dtype=torch.long), max_query_len=1, max_seq_len=40,
                             is_decode_only=True)
    got = TorchMLAAttention().decode(q, cache, build_plan(meta), 32, 0.15)
    want = reference.mla_decode_ref(q, cache, meta.query_start_loc, meta.seq_lens, tables, 0.15, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
