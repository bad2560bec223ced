"""The batched LoRA kernel (kernels/lora.py, Punica's segmented shrink/expand) against its torch
twin (reference.lora_sgmv_ref), under Triton's interpreter on CPU (compiled on a GPU when there is
one): contiguous adapter segments and gathered ones, base-model tokens left untouched, slots of
smaller ranks (zero-padded columns), a segment longer than one tile, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import ops, reference
from kvserve.kernels.lora import lora_sgmv
from kvserve.runtime.lora.slots import segment_starts, step_layout

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _slots(num_slots, k, c, n, ranks, dtype, g):
    a_t = torch.zeros(num_slots, k, c)
    b_t = torch.zeros(num_slots, c, n)
    for s, r in enumerate(ranks):
        a_t[s, :, :r] = 0.2 * torch.randn(k, r, generator=g)
        b_t[s, :r] = 0.2 * torch.randn(r, n, generator=g)
    return a_t.to(dtype), b_t.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_slots,seq_tokens", [
    ([0, 1, -1], [5, 3, 4]),                 # contiguous segments, one base sequence
    ([1, -1, 0, 1, 2, 0], [1, 1, 1, 1, 1, 1]),  # a decode step: adapters interleaved (gathered)
    ([2, 2, -1, 0], [20, 3, 2, 1]),          # one segment longer than a 16-row tile
    ([-1, -1], [3, 2]),                      # no adapter at all
])
def test_sgmv_matches_the_twin(device, dtype, seq_slots, seq_tokens):
    g = torch.Generator().manual_seed(sum(seq_tokens))
    k, c, n = 72, 24, 100  # three parts of rank 8; widths off the tile sizes
    ranks = [24, 8, 16]
    a_t, b_t = _slots(3, k, c, n, ranks, dtype, g)
    layout = step_layout(seq_slots, seq_tokens)
    t = len(layout.token_slots)
    x = torch.randn(t, k, generator=g).to(dtype)
    out = torch.randn(t, n, generator=g).to(dtype)
    want = reference.lora_sgmv_ref(x.float(), out.float().clone(), a_t.float(), b_t.float(), layout.segments,
                                   None if layout.perm is None else torch.tensor(layout.perm), ranks)
    order = layout.perm if layout.perm is not None else [i for _, s, e in layout.segments for i in range(s, e)]
    dev = torch.device(device)

    def ints(v):
        return torch.tensor(v, dtype=torch.int32, device=dev)

    got = out.to(dev).clone()
    lora_sgmv(x.to(dev), got, a_t.to(dev), b_t.to(dev), ints(order), ints([s for s, _, _ in layout.segments]),
              ints(segment_starts(layout.segments)), ints([e - s for _, s, e in layout.segments]),
              max((e - s for _, s, e in layout.segments), default=0))
    torch.testing.assert_close(got.float().cpu(), want, **TOL[dtype])
    base_rows = [i for i, s in enumerate(layout.token_slots) if s < 0]
    assert torch.equal(got.cpu()[base_rows], out[base_rows])  # base tokens untouched


def test_twin_equals_per_token_loop():
    """The twin itself against the definition, token by token, both layouts."""
    g = torch.Generator().manual_seed(3)
    a_t, b_t = _slots(4, 16, 8, 12, [8, 4, 8, 2], torch.float32, g)
    for seq_slots, num_slots in (([0, 0, 1, -1], None), ([0, 1, 0, -1], None), ([0, 1, 2, 3, 2, -1], 4),
                                 ([3, 1, 0, -1, 1, 3], 4)):
        layout = step_layout(seq_slots, [2, 1, 2, 1, 1, 1][:len(seq_slots)], num_slots)
        assert (layout.padded is not None) == (num_slots is not None)
        t = len(layout.token_slots)
        x = torch.randn(t, 16, generator=g)
        out = torch.zeros(t, 12)
        padded = None if layout.padded is None else (torch.tensor(layout.padded[0]).view(4, -1),
                                                     torch.tensor(layout.padded[1]))
        reference.lora_sgmv_ref(x, out, a_t, b_t, layout.segments,
                                None if layout.perm is None else torch.tensor(layout.perm), [8, 4, 8, 2], padded)
        want = torch.stack([x[i] @ a_t[s] @ b_t[s] if s >= 0 else torch.zeros(12)
                            for i, s in enumerate(layout.token_slots)])
        torch.testing.assert_close(out, want)
    assert ops.lora_sgmv is not None


def test_per_part_expand_equals_the_block_diagonal_one():
    """Long direct segments of a fused layer (out_parts) expand each part on its diagonal block of
    B: the same sums as the one matmul over the whole block-diagonal B (short ones take that)."""
    g = torch.Generator().manual_seed(5)
    parts, rank, k = [(0, 12), (12, 16), (16, 20)], 4, 16  # q|k|v-like widths, slot ranks 4 and 2
    a_t = torch.zeros(2, k, 3 * rank)
    b_t = torch.zeros(2, 3 * rank, 20)
    for s, r in enumerate((4, 2)):
        for p, (lo, hi) in enumerate(parts):
            a_t[s, :, p * r:(p + 1) * r] = torch.randn(k, r, generator=g)
            b_t[s, p * r:(p + 1) * r, lo:hi] = torch.randn(r, hi - lo, generator=g)
    layout = step_layout([0, -1, 1], [reference.LORA_PARTS_MIN_ROWS, 2, 3])
    assert layout.perm is None
    x = torch.randn(len(layout.token_slots), k, generator=g)
    whole = reference.lora_sgmv_ref(x, torch.zeros(x.shape[0], 20), a_t, b_t, layout.segments, None, [12, 6])
    by_part = reference.lora_sgmv_ref(x, torch.zeros(x.shape[0], 20), a_t, b_t, layout.segments, None, [12, 6],
                                      out_parts=parts)
    torch.testing.assert_close(by_part, whole)
