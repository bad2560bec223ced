"""The native CPU kernels (kernels/cpu) against torch and the reference twins.

Every output buffer starts as NaN (the conftest poisons torch.empty), so an element a kernel
forgets to write shows up. The kernels are built with the system compiler on first use; on a
machine without gcc or AVX2 they are unavailable and these tests skip (the runtime then keeps its
torch path, which the rest of the suite covers).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels import ops, reference
from kvserve.kernels.cpu import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native CPU kernels: {native.status()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 14), n=st.integers(1, 70), k=st.integers(1, 80), bias=st.booleans(), seed=st.integers(0, 99))
def test_linear_matches_f_linear(m, n, k, bias, seed):
    g = _gen(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = native.pack_weight(w)
    assert packed.shape == (math.ceil(n / native.TILE), k, native.TILE)
    torch.testing.assert_close(native.linear(x, packed, n, b), F.linear(x, w, b), atol=2e-5 * math.sqrt(k), rtol=1e-5)


def test_linear_takes_leading_dims_and_row_strided_inputs():
    w = torch.randn(40, 24)
    packed = native.pack_weight(w)
    x = torch.randn(2, 3, 48)[..., :24]  # a row-strided view
    torch.testing.assert_close(native.linear(x, packed, 40), F.linear(x, w), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="in_features"):
        native.linear(torch.randn(2, 25), packed, 40)
    with pytest.raises(ValueError, match="float32"):
        native.linear(torch.randn(2, 24).double(), packed, 40)


def test_linear_rows_do_not_depend_on_the_rest_of_the_batch():
    """Each output is summed over k in one order whatever the batch size: a sequence's logits are
    bit-identical alone or batched (greedy outputs cannot change with batch composition)."""
    w = torch.randn(100, 576)
    packed = native.pack_weight(w)
    x = torch.randn(13, 576)
    batched = native.linear(x, packed, 100)
    for i in (0, 5, 6, 12):
        assert torch.equal(native.linear(x[i:i + 1], packed, 100)[0], batched[i])
    assert torch.equal(native.linear(x[3:10], packed, 100), batched[3:10])


def test_packed_rows_read_back_as_the_original_rows():
    w = torch.randn(37, 20)
    ids = torch.tensor([0, 36, 15, 16, 15])
    assert torch.equal(native.unpack_rows(native.pack_weight(w), ids), w[ids])


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k, block", [(40, 128, 64), (16, 256, 32)])
def test_codebook_4bit_matmul_and_rows(m, n, k, block):
    """bitsandbytes' NF4 layout (codes high nibble first, absmax per block) repacked into panels:
    rows read back as codebook[code] * absmax bit for bit; the matmul (the one-row path and the
    panel path, a ragged last tile) equals that weight's float64 product."""
    gen = torch.Generator().manual_seed(m + n)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    absmax = torch.rand(n, k // block, generator=gen) + 0.05
    codebook = torch.randn(16, generator=gen).sort().values  # any 16 values (NF4's, FP4's)
    q = torch.stack(((codes >> 4), codes & 0xF), dim=-1).reshape(n, k).long()
    want = (codebook[q].view(n, k // block, block) * absmax[..., None]).view(n, k)
    panels = native.CodebookPanels(codes, absmax, codebook, block)
    assert torch.equal(panels.rows(torch.arange(n)), want)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ want.double().T
    assert (panels.matmul(x).double() - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 64), (300, 250)])
def test_norms_match_the_twins(rows, hidden):
    x, r, w = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), reference.rms_norm_ref(x, w, 1e-5), atol=2e-6, rtol=2e-6)
    out, summed = native.fused_add_rms_norm(x, r, w, 1e-5)
    want_out, want_sum = reference.fused_add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(summed, want_sum)
    torch.testing.assert_close(out, want_out, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 13), (200, 400)])
def test_silu_and_mul_matches_the_twin(rows, inter):
    x = torch.randn(rows, 2 * inter) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -90.0])  # exp's saturation ends
    torch.testing.assert_close(native.silu_and_mul(x), reference.silu_and_mul_ref(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_is_bit_identical_to_the_twin(rotary_dim):
    qkv = torch.randn(6, 9 * 64 + 2 * 3 * 64)
    q = qkv[:, :576].view(6, 9, 64)  # the strided views the attention layer passes
    k = qkv[:, 576:768].view(6, 3, 64)
    cache = torch.randn(100, rotary_dim)
    pos = torch.tensor([0, 99, 5, 5, 17, 63])
    got = native.rotary_embedding(pos, q, k, cache)
    want = reference.rotary_embedding_ref(pos, q, k, cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_write_kv_matches_the_reference_and_skips_minus_one():
    qkv = torch.randn(5, 4 * 8 + 2 * 2 * 8)
    k = qkv[:, 32:48].view(5, 2, 8)  # strided views, as the attention layer passes them
    v = qkv[:, 48:].view(5, 2, 8)
    slots = torch.tensor([3, -1, 0, 9, 6])
    got = [torch.full((3, 4, 2, 8), 7.0), torch.full((3, 4, 2, 8), 7.0)]
    want = [c.clone() for c in got]
    assert native.write_kv_supported(k, v, got[0])
    native.write_kv(k, v, got[0], got[1], slots)
    reference.write_kv_ref(k, v, want[0], want[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _manual_decode(q, k_cache, v_cache, table, seq_len, scale, window=0, softcap=0.0):
    k = reference.gather_kv(k_cache, table, seq_len)
    v = reference.gather_kv(v_cache, table, seq_len)
    first = max(0, seq_len - window) if window else 0
    k, v = k[first:], v[first:]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("ht,thd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 24), (8, 1, 32), (71, 1, 64)])
def test_paged_decode_matches_the_reference(heads, kv_heads, head_dim):
    g = _gen(0)
    num_blocks, block_size = 40, 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    seq_lens = torch.tensor([1, 7, 33, 60], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:16] for _ in range(4)]).int()
    q = torch.randn(4, heads, head_dim, generator=g)
    out = native.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    want = reference.paged_attention_ref(q, k_cache, v_cache, torch.arange(5, dtype=torch.int32), seq_lens, tables,
                                         0.125)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    for window, softcap in ((5, 0.0), (0, 2.0), (8, 3.0)):
        out = native.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, window=window, softcap=softcap)
        for i, n in enumerate(seq_lens.tolist()):
            want = _manual_decode(q[i], k_cache, v_cache, tables[i], n, 0.3, window, softcap)
            torch.testing.assert_close(out[i], want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (6, 2, 20), (4, 2, 72), (2, 1, 128)])
def test_paged_decode_of_a_batch_is_each_sequence_decoded_alone(heads, kv_heads, head_dim):
    """Enough sequences for a task per sequence (not per KV head), lengths around the eight-position
    steps and the blocks, head sizes with 8-float tails and past 64: each sequence's output is the
    reference's, and bit-identical to decoding it alone (a batch never changes a sequence's numbers)."""
    g = _gen(1)
    num_blocks, block_size, seqs = 64, 16, 12
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    seq_lens = torch.tensor([1, 7, 8, 9, 15, 16, 17, 40, 63, 64, 65, 97], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:8] for _ in range(seqs)]).int()
    q = torch.randn(seqs, heads, head_dim, generator=g)
    for window, softcap in ((0, 0.0), (13, 0.0), (0, 5.0)):
        out = native.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, window=window, softcap=softcap)
        for i, n in enumerate(seq_lens.tolist()):
            want = _manual_decode(q[i], k_cache, v_cache, tables[i], n, 0.2, window, softcap)
            torch.testing.assert_close(out[i], want, atol=2e-6, rtol=1e-5)
            alone = native.paged_decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], seq_lens[i:i + 1],
                                                  0.2, window=window, softcap=softcap)
            assert torch.equal(alone[0], out[i])


def test_native_mode_says_why_when_the_kernels_cannot_build(monkeypatch, clean_state):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native._load()
    assert not native.available() and "no C compiler" in native.status()
    x = torch.randn(2, 8)
    assert not ops.use_native(x)
    with ops.kernel_mode("native"), pytest.raises(RuntimeError, match="no C compiler"):
        ops.silu_and_mul(x)
    monkeypatch.setenv(native.ENV_VAR, "0")
    native._load()
    assert "KVSERVE_CPU_KERNELS=0" in native.status()


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path, clean_state):
    monkeypatch.setenv(native.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", ("-this-flag-does-not-exist",))
    native._load()
    assert not native.available() and native.status().startswith("build or load failed")


@pytest.fixture
def clean_state(monkeypatch):
    """Lets a test rerun the loader and restores the loaded library afterwards."""
    assert native.available()
    saved = (native._state.lib, native._state.reason)
    native._state.lib, native._state.reason = None, "reset by test"
    yield
    native._state.lib, native._state.reason = saved
