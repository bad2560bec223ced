"""Sliding-window and soft-capped paged attention: the Triton kernels (interpreter), the torch
backend and the torch twin against a dense reference written here from the definitions.

Every slot behind a sequence's window is NaN and every block wholly behind it is replaced in the
block table by the NaN padding block, as if the block manager had freed and reused it: reading
anything there shows up as NaN in the output.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference  # noqa: E402
from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kvserve.runtime.attention.backend import AttentionMetadata  # noqa: E402
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
NAN_BLOCK = 0


class WindowBatch:
    """Per sequence (cached tokens, new tokens); positions behind its first query's window are NaN
    and their wholly-stale blocks are unmapped (point at the NaN block)."""

    def __init__(self, specs, window, *, dtype=torch.float32, head_dim=32, block_size=4, heads=4, kv_heads=2,
                 seed=0):
        gen = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.specs, self.window, self.dtype = specs, window, dtype
        lens = [c + q for c, q in specs]
        per_seq = [math.ceil(n / block_size) for n in lens]
        num_blocks = 1 + sum(per_seq) + 2
        ids = list(range(1, num_blocks))
        rnd.shuffle(ids)
        width = max(1, max(per_seq)) + 1
        self.block_tables = torch.full((len(specs), width), NAN_BLOCK, dtype=torch.int32)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.keys, self.values, self.slots = [], [], []
        for i, ((ctx, q), n) in enumerate(zip(specs, per_seq)):
            table = ids[:n]
            ids = ids[n:]
            lo = 0 if window is None else max(0, ctx - window + 1)
            k = torch.randn(ctx + q, kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(ctx + q, kv_heads, head_dim, generator=gen).to(dtype)
            self.keys.append(k)
            self.values.append(v)
            slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx + q)]
            self.slots.append(slots)
            live = torch.tensor(slots[lo:], dtype=torch.int64)
            reference.write_kv_ref(k[lo:], v[lo:], self.k_cache, self.v_cache, live)
            mapped = [b if (j + 1) * block_size > lo else NAN_BLOCK for j, b in enumerate(table)]
            self.block_tables[i, :n] = torch.tensor(mapped, dtype=torch.int32)
        q_lens = [q for _, q in specs]
        self.query_start_loc = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))],
                                            dtype=torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.query = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
        self.scale = head_dim ** -0.5
        self.heads, self.kv_heads = heads, kv_heads

    def args(self, device="cpu"):
        tensors = (self.query, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables)
        return (*(t.to(device) for t in tensors), self.scale)

    def meta(self, device="cpu") -> AttentionMetadata:
        q_lens = [q for _, q in self.specs]
        new_slots = [s for (ctx, _), slots in zip(self.specs, self.slots) for s in slots[ctx:]]
        return AttentionMetadata(
            query_start_loc=self.query_start_loc.to(device), seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=device), max_query_len=max(q_lens),
            max_seq_len=int(self.seq_lens.max()), is_decode_only=all(q == 1 for q in q_lens))

    def new_kv(self):
        return (torch.cat([k[c:] for k, (c, _) in zip(self.keys, self.specs)]),
                torch.cat([v[c:] for v, (c, _) in zip(self.values, self.specs)]))

    def dense(self, soft_cap=None, window=...):
        """The definition, on the full K/V (no cache): softmax over i - w < j <= i."""
        window = self.window if window is ... else window
        out, row = [], 0
        g = self.heads // self.kv_heads
        for (ctx, q), k, v in zip(self.specs, self.keys, self.values):
            qs = self.query[row:row + q].float()
            row += q
            k = k.float().repeat_interleave(g, dim=1)
            v = v.float().repeat_interleave(g, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs, k) * self.scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            pos = torch.arange(ctx, ctx + q)[:, None]
            keys = torch.arange(ctx + q)[None, :]
            visible = keys <= pos
            if window is not None:
                visible &= keys > pos - window
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out.append(torch.einsum("hqk,khd->qhd", probs, v))
        return torch.cat(out).to(self.dtype) if out else self.query.new_empty(0)


def _close(actual, expected, dtype):
    assert not actual.isnan().any(), "NaN: a slot behind the window (or an unwritten row) was read"
    torch.testing.assert_close(actual.float().cpu(), expected.float(), **TOL[dtype])


# (cached, new) per sequence: windows smaller and larger than the context, chunks longer than the
# window, a window of 1 (only the token itself), block-aligned and unaligned window starts.
PREFILL_SPECS = [(0, 23), (9, 14), (30, 3), (17, 1), (0, 2)]
DECODE_SPECS = [(0, 1), (6, 1), (22, 1), (40, 1), (7, 1)]


@pytest.mark.parametrize("window", [1, 13, None])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_prefill_kernel_twin_and_torch_backend_match_the_definition(window, soft_cap, device):
    b = WindowBatch(PREFILL_SPECS, window, seed=window or 0)
    expected = b.dense(soft_cap)
    opts = dict(sliding_window=window, logits_soft_cap=soft_cap)
    _close(paged_prefill_attention(*b.args(device), **opts), expected, b.dtype)
    _close(reference.paged_attention_ref(*b.args(), **opts), expected, b.dtype)
    key, value = b.new_kv()
    _close(TorchAttentionBackend().attend(b.query, key, value, b.k_cache, b.v_cache, b.meta(), b.scale, **opts),
           expected, b.dtype)


@pytest.mark.parametrize("window", [5, None])
@pytest.mark.parametrize("soft_cap", [None, 1.5])
def test_decode_kernel_matches_the_definition_across_splits(window, soft_cap, device):
    b = WindowBatch(DECODE_SPECS, window, head_dim=64, block_size=8, heads=6, kv_heads=2, seed=3)
    expected = b.dense(soft_cap)
    opts = dict(sliding_window=window, logits_soft_cap=soft_cap)
    for splits in ({}, dict(num_splits=32, min_split_tokens=4)):
        _close(paged_decode_attention(*b.args(device), **splits, **opts), expected, b.dtype)
    key, value = b.new_kv()
    _close(TorchAttentionBackend().attend(b.query, key, value, b.k_cache, b.v_cache, b.meta(), b.scale, **opts),
           expected, b.dtype)


def test_many_short_queries_take_the_grouped_torch_path_with_windows():
    """16+ decodes and speculative-length queries: the grouped gather bounded by the window."""
    rnd = random.Random(7)
    specs = [(rnd.randrange(0, 40), 1) for _ in range(20)] + [(rnd.randrange(5, 40), rnd.randrange(2, 6))
                                                              for _ in range(17)]
    for window, cap in ((6, None), (11, 3.0), (None, 3.0)):
        b = WindowBatch(specs, window, seed=11)
        key, value = b.new_kv()
        backend = TorchAttentionBackend()
        meta = b.meta()
        got = backend.attend(b.query, key, value, b.k_cache, b.v_cache, meta, b.scale, sliding_window=window,
                             logits_soft_cap=cap)
        _close(got, b.dense(cap), b.dtype)
    # Windowed and full layers of one step (Gemma: nothing freed) share the metadata; each window
    # gets a plan of its own and neither evicts the other.
    b = WindowBatch(specs, None, seed=12)
    key, value = b.new_kv()
    backend, meta = TorchAttentionBackend(), b.meta()
    outs = {}
    for _ in range(2):
        for window in (5, None, 9):
            out = backend.attend(b.query, key, value, b.k_cache, b.v_cache, meta, b.scale, sliding_window=window)
            if window in outs:
                torch.testing.assert_close(out, outs[window], atol=0, rtol=0)
            outs[window] = out
            _close(out, b.dense(window=window), b.dtype)
    assert set(backend._plans) == {5, None, 9}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_windows(dtype, device):
    b = WindowBatch([(20, 9), (3, 1), (35, 1)], 7, dtype=dtype, head_dim=80, block_size=16, heads=4, kv_heads=1,
                    seed=5)
    _close(paged_prefill_attention(*b.args(device), sliding_window=7), b.dense(), dtype)
    d = WindowBatch([(20, 1), (3, 1), (35, 1)], 7, dtype=dtype, head_dim=80, block_size=16, heads=4, kv_heads=1,
                    seed=6)
    _close(paged_decode_attention(*d.args(device), sliding_window=7, num_splits=2, min_split_tokens=4), d.dense(),
           dtype)


def test_triton_backend_passes_the_layer_options(device):
    b = WindowBatch([(12, 5), (30, 1)], 6, seed=2)
    key, value = b.new_kv()
    query, k_cache, v_cache = (t.to(device) for t in (b.query, b.k_cache, b.v_cache))
    out = TritonAttentionBackend().attend(query, key.to(device), value.to(device), k_cache, v_cache, b.meta(device),
                                          b.scale, sliding_window=6, logits_soft_cap=4.0)
    _close(out.cpu(), b.dense(4.0), b.dtype)


def test_bad_options_are_named():
    b = WindowBatch([(3, 2)], None, seed=1)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_prefill_attention(*b.args(), sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        paged_decode_attention(*b.args(), logits_soft_cap=-1.0)
