"""float8 KV pools (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2): the Triton cache write and paged
attention kernels against their torch twins under the interpreter, and both against full
precision. Unowned slots stay NaN (NaN survives the float8 cast), so a stray read still shows."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_attention import Batch  # noqa: E402

from kvserve.kernels import reference  # noqa: E402
from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kvserve.kernels.cache import write_kv_cache  # noqa: E402
from kvserve.runtime.attention.backend import AttentionMetadata  # noqa: E402
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ids = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _scales(k: float, v: float, device="cpu"):
    return (torch.tensor(k, dtype=torch.float32, device=device), torch.tensor(v, dtype=torch.float32, device=device))


@pytest.mark.parametrize("fp8", FP8, ids=ids.get)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_write_is_bit_identical_to_the_twin_and_saturates(fp8, src, device):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim, blocks, bs = 11, 3, 40, 5, 4
    key = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(src)
    value = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(src)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -500.0]).to(src)  # past e4m3's 448 (and scaled, past e5m2's 57344)
    slots = torch.tensor([3, 0, -1, 7, 19, 8, -1, 12, 13, 2, 18])
    k_scale, v_scale = _scales(0.05, 0.5)
    got = [torch.zeros(blocks, bs, heads, dim, dtype=fp8) for _ in range(2)]
    want = [torch.zeros(blocks, bs, heads, dim, dtype=fp8) for _ in range(2)]
    on_device = [t.to(device) for t in got]
    write_kv_cache(key.to(device), value.to(device), *on_device, slots.to(device), k_scale.to(device),
                   v_scale.to(device))
    got = [t.cpu() for t in on_device]
    reference.write_kv_ref(key, value, *want, slots, k_scale, v_scale)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        assert not g.float().isnan().any() and not g.float().isinf().any()
    limit = torch.finfo(fp8).max
    assert got[0].view(-1, heads, dim)[3, 0, 0].float() == limit  # saturated, not NaN/inf
    assert got[0].view(-1, heads, dim)[3, 0, 1].float() == -limit
    # Read back with the scale: the value within float8's relative precision (3 or 2 mantissa bits).
    back = got[1].view(-1, heads, dim)[slots[slots >= 0]].float() * v_scale
    rel = 2.0 ** -(3 if fp8 == torch.float8_e4m3fn else 2)
    torch.testing.assert_close(back, value[slots >= 0].float(), rtol=rel, atol=v_scale.item() * 2 ** -6)


def _fp8_batch(specs, fp8, *, dim=64, bs=16, heads=4, kv_heads=2, seed=0, scales=(0.5, 2.0), device="cpu"):
    b = Batch(specs, dtype=torch.float32, head_dim=dim, block_size=bs, heads=heads, kv_heads=kv_heads, seed=seed,
              device=device)
    k_scale, v_scale = _scales(*scales, device=device)
    full = (b.k_cache.clone(), b.v_cache.clone())
    b.k_cache = reference.quantize_kv_ref(b.k_cache, k_scale, fp8)
    b.v_cache = reference.quantize_kv_ref(b.v_cache, v_scale, fp8)
    return b, k_scale, v_scale, full


@pytest.mark.parametrize("fp8", FP8, ids=ids.get)
@pytest.mark.parametrize("min_split_tokens", [None, 16])
def test_decode_on_fp8_pools_matches_the_twin(fp8, min_split_tokens, device):
    lens = [1, 16, 17, 50, 95]
    specs = [(n - 1, 1) for n in lens] + [(20, 0)]
    random.Random(5).shuffle(specs)
    b, ks, vs, full = _fp8_batch(specs, fp8, seed=5, device=device)
    expected = reference.paged_attention_ref(*b.args(), k_scale=ks, v_scale=vs)
    out = paged_decode_attention(*b.args(), num_splits=None if min_split_tokens is None else 32,
                                 min_split_tokens=min_split_tokens, out=b.poisoned_out(),
                                 k_scale=ks, v_scale=vs)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # ...and close to attention over the unquantized K/V: the scales are applied, not dropped.
    exact = reference.paged_attention_ref(b.query, *full, b.query_start_loc, b.seq_lens, b.block_tables, b.scale)
    err = (out - exact).abs().max().item()
    assert err < (0.15 if fp8 == torch.float8_e4m3fn else 0.3), err


@pytest.mark.parametrize("fp8", FP8, ids=ids.get)
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_on_fp8_pools_matches_the_twin(fp8, window, device):
    specs = [(0, 1), (0, 17), (15, 3), (32, 0), (5, 40)]
    b, ks, vs, _ = _fp8_batch(specs, fp8, seed=9, device=device)
    expected = reference.paged_attention_ref(*b.args(), sliding_window=window, k_scale=ks, v_scale=vs)
    out = paged_prefill_attention(*b.args(), out=b.poisoned_out(), sliding_window=window, k_scale=ks, v_scale=vs)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fp8", FP8, ids=ids.get)
def test_triton_and_torch_backends_agree_on_fp8_pools(fp8, device):
    """The whole write-then-attend contract, decode and prefill steps, in both backends: the same
    float8 bytes in the pools and the same outputs (the torch backend is the CPU path)."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, bs, blocks = 4, 2, 32, 8, 12
    pools = {name: [torch.zeros(blocks, bs, kv_heads, dim, dtype=fp8, device=device) for _ in range(2)]
             for name in ("triton", "torch")}
    backends = {"triton": TritonAttentionBackend(), "torch": TorchAttentionBackend()}
    ks, vs = _scales(0.25, 1.5, device=device)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    # step 1: two prompts (13 and 20 tokens); step 2: one decode token each.
    for q_lens, ctx in (([13, 20], [0, 0]), ([1, 1], [13, 20])):
        seq_lens = [c + q for c, q in zip(ctx, q_lens)]
        slots = [int(tables[i, p // bs]) * bs + p % bs for i in range(2) for p in range(ctx[i], seq_lens[i])]
        n = sum(q_lens)
        meta = AttentionMetadata(query_start_loc=torch.tensor([0, q_lens[0], n], dtype=torch.int32, device=device),
                                 seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                 block_tables=tables.to(device), slot_mapping=torch.tensor(slots, device=device),
                                 max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                                 is_decode_only=max(q_lens) == 1)
        q = torch.randn(n, heads, dim, generator=gen).to(device)
        k = torch.randn(n, kv_heads, dim, generator=gen).to(device)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(device)
        outs = {}
        for name, backend in backends.items():
            kc, vc = pools[name]
            backend.write_kv(k, v, kc, vc, meta.slot_mapping, k_scale=ks, v_scale=vs)
            outs[name] = backend.attend(q, k, v, kc, vc, meta, dim ** -0.5, k_scale=ks, v_scale=vs)
        for a, b in zip(pools["triton"], pools["torch"]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-4, rtol=1e-4)


def test_fp8_pools_without_scales_mean_scale_one(device):
    b, _, _, _ = _fp8_batch([(0, 9), (4, 1)], torch.float8_e4m3fn, seed=2, scales=(1.0, 1.0), device=device)
    ones = _scales(1.0, 1.0, device=device)
    expected = reference.paged_attention_ref(*b.args(), k_scale=ones[0], v_scale=ones[1])
    torch.testing.assert_close(paged_prefill_attention(*b.args()), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(reference.paged_attention_ref(*b.args()), expected, atol=0, rtol=0)
