"""Triton paged attention and KV cache writes against their torch twins, under the interpreter.

Every cache slot that no sequence owns, the padding block of the block tables and every output
buffer start as NaN, so a kernel that reads a slot it must not (or leaves a row unwritten) fails.
Block tables are random permutations (never contiguous), lengths straddle block and split
boundaries, and batches mix empty, one-token and multi-block sequences.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import reference  # noqa: E402
from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kvserve.kernels.cache import write_kv_cache  # noqa: E402
from kvserve.runtime.attention.backend import AttentionMetadata  # noqa: E402
from kvserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402

# The interpreter makes bfloat16 casts truncate instead of rounding, hence its wider band.
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}
NAN_BLOCK = 0  # padding entries of the block tables point here; it is never written


class Batch:
    """A packed batch: per sequence (cached tokens, new tokens), its KV already in a NaN cache."""

    def __init__(self, specs, *, dtype, head_dim, block_size, heads, kv_heads, seed, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.specs = specs
        self.seq_lens_list = [ctx + q for ctx, q in specs]
        blocks_per_seq = [math.ceil(n / block_size) for n in self.seq_lens_list]
        num_blocks = 1 + sum(blocks_per_seq) + 3  # + the NaN block + a few never-used blocks
        ids = list(range(1, num_blocks))
        rnd.shuffle(ids)
        width = max(1, max(blocks_per_seq)) + 1  # always some padding at the end of each row
        self.block_tables = torch.full((len(specs), width), NAN_BLOCK, dtype=torch.int32)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        slots = []
        for i, n in enumerate(blocks_per_seq):
            table = ids[:n]
            ids = ids[n:]
            self.block_tables[i, :n] = torch.tensor(table, dtype=torch.int32)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(self.seq_lens_list[i])]
        total = len(slots)
        self.all_slots = torch.tensor(slots, dtype=torch.int64)
        self.keys = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        self.values = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        reference.write_kv_ref(self.keys, self.values, self.k_cache, self.v_cache, self.all_slots)
        q_lens = [q for _, q in specs]
        self.query_start_loc = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32)
        self.query = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
        self.scale = head_dim ** -0.5
        # Built on the CPU (seeded), then moved: the same numbers on every device.
        for name in ("block_tables", "k_cache", "v_cache", "all_slots", "keys", "values", "query_start_loc",
                     "seq_lens", "query"):
            setattr(self, name, getattr(self, name).to(device))

    def args(self):
        return (self.query, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
                self.block_tables, self.scale)

    def expected(self):
        return reference.paged_attention_ref(*self.args())

    def poisoned_out(self):
        return torch.full_like(self.query, float("nan"))


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _assert_close(actual, expected, dtype):
    assert not actual.isnan().any(), "NaN in kernel output: an unwritten row or a poisoned slot was read"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


# (dtype, head_dim, block_size, heads, kv_heads, context lengths of the decoding sequences)
DECODE_CASES = [
    (torch.float32, 64, 16, 8, 2, [1, 16, 17, 50, 95]),  # GQA 4, lengths at block edges
    (torch.float16, 80, 32, 4, 4, [33, 64, 65, 2]),  # MHA, non-power-of-2 head
    (torch.bfloat16, 96, 16, 6, 1, [31, 32, 7]),  # MQA with a group of 6
    (torch.float16, 128, 16, 4, 2, [40, 1]),
    (torch.bfloat16, 256, 32, 2, 1, [70, 3]),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-bs{c[2]}-h{c[3]}/{c[4]}")
def test_decode_matches_reference_across_splits(case, device):
    dtype, dim, bs, heads, kv_heads, lens = case
    # Two extra sequences without a new token this step (one with cached context, one empty):
    # they own no query row and must be skipped.
    specs = [(n - 1, 1) for n in lens] + [(20, 0), (0, 0)]
    random.Random(dim).shuffle(specs)
    b = Batch(specs, dtype=dtype, head_dim=dim, block_size=bs, heads=heads, kv_heads=kv_heads, seed=dim + bs,
              device=device)
    expected = b.expected()
    # One split (direct write), and splits of 16 tokens: half-block and cross-block boundaries,
    # empty trailing splits for the shorter sequences, and the log-sum-exp merge.
    for splits in ({}, dict(num_splits=32, min_split_tokens=16)):
        out = paged_decode_attention(*b.args(), **splits, out=b.poisoned_out())
        _assert_close(out, expected, dtype)


# (dtype, head_dim, block_size, heads, kv_heads, [(cached tokens, new tokens)])
PREFILL_CASES = [
    (torch.float32, 64, 16, 4, 2, [(0, 1), (0, 17), (15, 3), (32, 0), (5, 40)]),
    (torch.float16, 80, 16, 6, 2, [(0, 33), (16, 16), (1, 1)]),  # decodes mixed into a prefill
    (torch.bfloat16, 96, 32, 4, 4, [(31, 2), (0, 5)]),
    (torch.float16, 128, 32, 8, 1, [(40, 9), (0, 0), (0, 3)]),  # MQA, an empty sequence
    (torch.float32, 256, 16, 2, 1, [(10, 7)]),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"{str(c[0])[6:]}-d{c[1]}-bs{c[2]}-h{c[3]}/{c[4]}")
def test_prefill_matches_reference_with_cached_prefixes(case, device):
    dtype, dim, bs, heads, kv_heads, specs = case
    b = Batch(specs, dtype=dtype, head_dim=dim, block_size=bs, heads=heads, kv_heads=kv_heads, seed=dim * 7 + bs,
              device=device)
    out = paged_prefill_attention(*b.args(), out=b.poisoned_out())
    _assert_close(out, b.expected(), dtype)


def test_prefill_of_one_token_queries_equals_decode(device):
    b = Batch([(9, 1), (30, 1), (0, 1)], dtype=torch.float32, head_dim=64, block_size=16, heads=4,
              kv_heads=2, seed=3, device=device)
    prefill = paged_prefill_attention(*b.args(), out=b.poisoned_out())
    decode = paged_decode_attention(*b.args(), num_splits=32, min_split_tokens=16, out=b.poisoned_out())
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,dim,bs", [(torch.float32, 64, 16), (torch.float16, 80, 32), (torch.bfloat16, 256, 16)])
def test_write_kv_scatters_rows_and_skips_minus_one(dtype, dim, bs, device):
    gen = torch.Generator().manual_seed(dim)
    kv_heads, tokens, num_blocks = 2, 9, 5
    shape = (num_blocks, bs, kv_heads, dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[[1, 4]] = -1
    # key/value as the model produces them: strided views into one fused qkv projection
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * dim, generator=gen).to(dtype)
    key = qkv[:, 4 * dim:(4 + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (4 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    write_kv_cache(key.to(device), value.to(device), k_dev, v_dev, slots.to(device))
    k_cache, v_cache = k_dev.cpu(), v_dev.cpu()
    reference.write_kv_ref(key, value, k_ref, v_ref, slots)
    # A plain copy: bit-exact, and untouched slots are still NaN.
    assert torch.equal(k_cache.nan_to_num(123.0), k_ref.nan_to_num(123.0))
    assert torch.equal(v_cache.nan_to_num(123.0), v_ref.nan_to_num(123.0))
    assert int(k_cache.isnan().any(-1).any(-1).logical_not().sum()) == tokens - 2


def test_backend_write_then_attend_matches_reference_and_torch_backend(device):
    """A mixed step: a chunk of a prompt with a cached prefix, a fresh prompt and two decodes."""
    from kvserve.runtime.attention.torch_backend import TorchAttentionBackend

    dtype, dim, bs, heads, kv_heads = torch.float32, 64, 16, 4, 2
    specs = [(20, 12), (0, 7), (33, 1), (15, 1)]
    b = Batch(specs, dtype=dtype, head_dim=dim, block_size=bs, heads=heads, kv_heads=kv_heads, seed=11, device=device)
    # Keep only the cached prefixes in the cache; the backend writes the new tokens itself.
    new_slots, new_rows = [], []
    row = 0
    for ctx, q in specs:
        for p in range(ctx, ctx + q):
            new_rows.append(row + p)
            new_slots.append(int(b.all_slots[row + p]))
        row += ctx + q
    new_slots = torch.tensor(new_slots, dtype=torch.int64, device=device)
    k_cache = b.k_cache.clone()
    v_cache = b.v_cache.clone()
    k_cache.view(-1, kv_heads, dim)[new_slots] = float("nan")
    v_cache.view(-1, kv_heads, dim)[new_slots] = float("nan")
    key, value = b.keys[new_rows], b.values[new_rows]
    meta = AttentionMetadata(
        query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_tables=b.block_tables,
        slot_mapping=new_slots, max_query_len=max(q for _, q in specs), max_seq_len=max(b.seq_lens_list),
    )
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache.nan_to_num(0.5), b.k_cache.nan_to_num(0.5))
    out = backend.attend(b.query, key, value, k_cache, v_cache, meta, b.scale)
    _assert_close(out, b.expected(), dtype)
    torch_out = TorchAttentionBackend().attend(b.query, key, value, k_cache, v_cache, meta, b.scale)
    torch.testing.assert_close(out, torch_out, **TOL[dtype])

    # The decode-only path of the backend on the two decoding sequences.
    d = Batch([(33, 1), (15, 1)], dtype=dtype, head_dim=dim, block_size=bs, heads=heads, kv_heads=kv_heads, seed=5,
              device=device)
    meta = AttentionMetadata(
        query_start_loc=d.query_start_loc, seq_lens=d.seq_lens, block_tables=d.block_tables,
        slot_mapping=torch.full((2,), -1, dtype=torch.int64, device=device), max_query_len=1, max_seq_len=34,
        is_decode_only=True,
    )
    out = backend.attend(d.query, d.query, d.query, d.k_cache, d.v_cache, meta, d.scale)
    _assert_close(out, d.expected(), dtype)


def test_bad_shapes_raise_value_errors_naming_the_field():
    b = Batch([(3, 2)], dtype=torch.float32, head_dim=64, block_size=16, heads=3, kv_heads=2, seed=1)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        paged_prefill_attention(*b.args())
    b = Batch([(3, 2)], dtype=torch.float32, head_dim=64, block_size=16, heads=4, kv_heads=2, seed=1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_decode_attention(b.query, b.k_cache, b.v_cache, b.query_start_loc[:1], b.seq_lens,
                               b.block_tables, b.scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(b.query[:, :2], b.query[:, :2], b.k_cache, b.v_cache, torch.zeros(7, dtype=torch.int64))


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_prefill_and_decode(seed, device):
    """Seeded random configurations beyond the hand-picked cases above."""
    rnd = random.Random(1000 + seed)
    dtype = rnd.choice(list(TOL))
    dim, bs = rnd.choice([64, 80, 96, 128, 256]), rnd.choice([16, 32])
    kv_heads, group = rnd.choice([1, 2]), rnd.choice([1, 2, 3, 4, 8])
    specs = [(rnd.choice([0, rnd.randrange(1, 80)]), rnd.choice([0, 1, rnd.randrange(1, 40)]))
             for _ in range(rnd.randrange(1, 5))]
    specs.append((rnd.randrange(0, 50), rnd.randrange(1, 20)))  # at least one query token
    b = Batch(specs, dtype=dtype, head_dim=dim, block_size=bs, heads=kv_heads * group,
              kv_heads=kv_heads, seed=seed, device=device)
    _assert_close(paged_prefill_attention(*b.args(), out=b.poisoned_out()), b.expected(), dtype)
    decode_specs = [(ctx + q - 1, 1) if q else (ctx, 0) for ctx, q in specs]
    d = Batch(decode_specs, dtype=dtype, head_dim=dim, block_size=bs, heads=kv_heads * group,
              kv_heads=kv_heads, seed=seed, device=device)
    out = paged_decode_attention(*d.args(), num_splits=rnd.choice([2, 3, 32]), min_split_tokens=rnd.choice([16, 24, 48]),
                                 out=d.poisoned_out())
    _assert_close(out, d.expected(), dtype)
