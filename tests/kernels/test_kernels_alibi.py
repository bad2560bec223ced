"""ALiBi in paged attention: the Triton prefill and decode kernels (interpreter), the torch twin
and the torch backend against the definition written here, with windows and across decode
splits; and whole MPT and BLOOM models on the Triton backend against transformers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_sliding_window import DECODE_SPECS, PREFILL_SPECS, WindowBatch, _close  # noqa: E402

from kvserve.kernels import reference  # noqa: E402
from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from kvserve.runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kvserve.runtime.models.mpt import alibi_slopes  # noqa: E402


def dense_alibi(b: WindowBatch, slopes: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scale + slope_h * (j - i)) over i - w < j <= i, on the full K/V."""
    out, row = [], 0
    g = b.heads // b.kv_heads
    for (ctx, q), k, v in zip(b.specs, b.keys, b.values):
        qs = b.query[row:row + q].double()
        row += q
        k = k.double().repeat_interleave(g, dim=1)
        v = v.double().repeat_interleave(g, dim=1)
        pos = torch.arange(ctx, ctx + q)[:, None]
        keys = torch.arange(ctx + q)[None, :]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * b.scale + slopes.double()[:, None, None] * (keys - pos)
        visible = keys <= pos
        if b.window is not None:
            visible &= keys > pos - b.window
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v))
    return torch.cat(out).to(b.dtype)


@pytest.mark.parametrize("window", [None, 13])
def test_prefill_kernel_alibi(window, device):
    b = WindowBatch(PREFILL_SPECS, window, heads=6, kv_heads=2, seed=5)
    slopes = alibi_slopes(6, 8.0)
    expected = dense_alibi(b, slopes)
    opts = dict(sliding_window=window, alibi_slopes=slopes)
    _close(paged_prefill_attention(*b.args(device), **{**opts, "alibi_slopes": slopes.to(device)}), expected, b.dtype)
    _close(reference.paged_attention_ref(*b.args(), **opts), expected, b.dtype)
    key, value = b.new_kv()
    _close(TorchAttentionBackend().attend(b.query, key, value, b.k_cache, b.v_cache, b.meta(), b.scale, **opts),
           expected, b.dtype)


def test_decode_kernel_alibi_across_splits(device):
    b = WindowBatch(DECODE_SPECS, None, head_dim=64, block_size=8, heads=4, kv_heads=2, seed=7)
    slopes = alibi_slopes(4, 8.0)
    expected = dense_alibi(b, slopes)
    for splits in ({}, dict(num_splits=32, min_split_tokens=4)):
        _close(paged_decode_attention(*b.args(device), alibi_slopes=slopes.to(device), **splits), expected, b.dtype)
    key, value = b.new_kv()
    _close(TorchAttentionBackend().attend(b.query, key, value, b.k_cache, b.v_cache, b.meta(), b.scale,
                                          alibi_slopes=slopes), expected, b.dtype)


@pytest.mark.parametrize("family", ["mpt", "bloom"])
def test_alibi_model_on_the_triton_backend_matches_transformers(tiny_model_factory, family):
    from transformers import AutoModelForCausalLM

    from kvserve.runtime.attention.backend import AttentionMetadata
    from kvserve.runtime.attention.triton_backend import TritonAttentionBackend
    from kvserve.runtime.models import load_model

    path = tiny_model_factory(family, num_attention_heads=6, hidden_size=96)
    model = load_model(path, dtype=torch.float32, device="cpu", attention_backend=TritonAttentionBackend())
    prompt = [1, 5, 77, 300, 12, 9, 400, 33, 250, 7]
    n = len(prompt)
    kv = [tuple(torch.zeros(model.kv_cache_shape(2, 8)) for _ in range(2)) for _ in model.layers]
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(2, dtype=torch.int32)[None], slot_mapping=torch.arange(n),
                             max_query_len=n, max_seq_len=n)
    got = model.compute_logits(model(torch.tensor(prompt), torch.arange(n), kv, meta))
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
