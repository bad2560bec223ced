"""Decode split counts as a CUDA graph replays them: the launch is sized for max_model_len (the
split count fixed per capture bucket), the contexts are short, and the kernels derive the tokens
per split from each sequence's real length. Checked against the torch twins under the
interpreter, with every partial buffer NaN-poisoned (conftest), so a merge that read a split
the decode kernel skipped would show up as NaN."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_attention import Batch, _assert_close  # noqa: E402

from kvserve.kernels import reference  # noqa: E402
from kvserve.kernels.attention import (  # noqa: E402
    MAX_DECODE_SPLITS,
    decode_num_splits,
    paged_decode_attention,
)
from kvserve.kernels.mla import mla_decode_attention  # noqa: E402


@pytest.mark.parametrize("sms,num_seqs,heads,max_span,min_split,want", [
    (0, 1, 8, 131072, 128, 1),           # no GPU: one split
    (132, 1, 8, 131072, 128, 32),        # batch 1 at 128k: capped at 32 (132 would be wanted)
    (132, 1, 1, 163840, 128, 32),        # MLA at 163,840: 32 splits, not 1,024
    (132, 64, 8, 131072, 128, 3),        # a large batch fills the GPU by itself
    (132, 512, 8, 131072, 128, 1),
    (132, 1, 8, 200, 128, 2),            # an eager step of a 200-token context: two splits
    (132, 4, 2, 1, 128, 1),
])
def test_split_count_depends_on_the_launch_shape_only(sms, num_seqs, heads, max_span, min_split, want):
    got = decode_num_splits(sms, num_seqs, heads, max_span, min_split)
    assert got == want and 1 <= got <= MAX_DECODE_SPLITS


def test_bad_split_options_raise_value_errors():
    b = Batch([(3, 1)], dtype=torch.float32, head_dim=16, block_size=16, heads=2, kv_heads=1, seed=0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(*b.args(), num_splits=MAX_DECODE_SPLITS + 1)
    with pytest.raises(ValueError, match="min_split_tokens"):
        paged_decode_attention(*b.args(), num_splits=2, min_split_tokens=0)


@pytest.mark.parametrize("window", [None, 40])
def test_short_contexts_in_a_launch_sized_for_128k(window, device):
    # Contexts of 1 to 300 tokens: one, two or three live splits of the 32 launched (tiles of
    # 32 tokens, smallest split 64); the others return without writing a partial.
    specs = [(n - 1, 1) for n in (1, 17, 64, 65, 200, 300)] + [(30, 0)]
    b = Batch(specs, dtype=torch.float32, head_dim=32, block_size=16, heads=4, kv_heads=2, seed=7, device=device)
    expected = (b.expected() if window is None else
                reference.paged_attention_ref(*b.args(), sliding_window=window))
    out = paged_decode_attention(*b.args(), max_seq_len=131072, num_splits=MAX_DECODE_SPLITS,
                                 min_split_tokens=64, sliding_window=window, out=b.poisoned_out())
    _assert_close(out, expected, torch.float32)
    # A split count that does not divide the contexts evenly, and one split per sequence.
    for splits in (3, 1):
        out = paged_decode_attention(*b.args(), max_seq_len=131072, num_splits=splits, min_split_tokens=16,
                                     sliding_window=window, out=b.poisoned_out())
        _assert_close(out, expected, torch.float32)


def test_mla_short_contexts_in_a_launch_sized_for_163840(device):
    from test_kernels_moe_mla import _paged_latents

    seq_lens, heads, lora, rope, block_size = [1, 40, 130, 7], 16, 32, 8, 8
    g = torch.Generator().manual_seed(11)
    cache, tables = _paged_latents(seq_lens, block_size, lora + rope, torch.float32, g)
    n = len(seq_lens)
    q = torch.randn(n, heads, lora + rope, generator=g)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (lora + rope) ** -0.5
    q, cache, qsl, lens, tables = (t.to(device) for t in (q, cache, qsl, lens, tables))
    want = reference.mla_decode_ref(q, cache, qsl, lens, tables, scale, lora)
    got = mla_decode_attention(q, cache, qsl, lens, tables, scale, lora, max_seq_len=163840,
                               num_splits=MAX_DECODE_SPLITS, min_split_tokens=32)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
