"""Which KV heads a stored block holds, and how a block for one head range is built from others.

The file tier keys its directories by KV-head range, not by tensor-parallel rank: a rank at TP
degree t holds heads [h0, h1) of every layer, and a block file of that namespace holds exactly
those heads. A restart at another degree reads its own range from the old layout's files: it
slices one file (TP 1 -> 2) or joins several (TP 2 -> 1). Pure functions; the store reads the
files (store.py).

A block's payload is its group's layer pools one after another, each ``[block_size, heads,
values]`` (runtime/kv_cache.py), so a head range is a strided slice of every segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Tensor-parallel degrees a restart might come from (a pod larger than this is not a layout).
MAX_TP = 64

HeadRange = tuple[int, int]


def kv_head_count(shape) -> int:
    """KV heads the tier splits: one latent "head" for MLA (every rank holds all of it)."""
    return 1 if shape.mla is not None else shape.num_kv_heads


def head_range(num_kv_heads: int, tp: int, rank: int) -> HeadRange:
    """The KV heads rank `rank` holds at degree `tp` (as the attention layer shards them: with
    fewer heads than ranks, each rank keeps a copy of one head)."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return rank * per, (rank + 1) * per
    h = rank * num_kv_heads // tp
    return h, h + 1


def head_copy(num_kv_heads: int, tp: int, rank: int) -> int:
    """Which copy of its head a rank holds when there are more ranks than KV heads (0 otherwise).
    Each copy has its own directory: two ranks' writers and deletes of one block, each in its own
    step order, never race in one directory (a late delete of one could remove the other's write)."""
    return 0 if num_kv_heads >= tp else rank % (tp // num_kv_heads)


def layouts(num_kv_heads: int, max_tp: int = MAX_TP) -> list[tuple[HeadRange, ...]]:
    """Every distinct split of the heads over a valid TP degree, coarsest first."""
    seen, out = set(), []
    for tp in range(1, max_tp + 1):
        if num_kv_heads % tp and tp % num_kv_heads:
            continue
        ranges = tuple(sorted({head_range(num_kv_heads, tp, r) for r in range(tp)}))
        if ranges not in seen:
            seen.add(ranges)
            out.append(ranges)
    return out


def covers(want: HeadRange, num_kv_heads: int, max_tp: int = MAX_TP) -> list[tuple[HeadRange, ...]]:
    """For each other layout, the ranges of it that together hold `want` (in head order); the
    layout whose range is `want` itself is the store's own directory and is left out."""
    out = []
    for ranges in layouts(num_kv_heads, max_tp):
        pieces = tuple(r for r in ranges if r[0] < want[1] and want[0] < r[1])
        if pieces != (want,):
            out.append(pieces)
    return out


def all_ranges(num_kv_heads: int, max_tp: int = MAX_TP) -> set[tuple[HeadRange, int]]:
    """Every (head range, copy) some TP degree up to `max_tp` writes."""
    out = set()
    for tp in range(1, max_tp + 1):
        if num_kv_heads % tp == 0 or tp % num_kv_heads == 0:
            out |= {(head_range(num_kv_heads, tp, r), head_copy(num_kv_heads, tp, r)) for r in range(tp)}
    return out


@dataclass(frozen=True)
class HeadGeometry:
    """How a block's payload is laid out: per KV cache group, how many layer pools (segments) it
    has; each segment is ``[block_size, heads, value_bytes]``."""

    num_kv_heads: int
    segments: tuple[int, ...]
    block_size: int
    value_bytes: int

    def block_bytes(self, group: int, heads: HeadRange) -> int:
        return self.segments[group] * self.block_size * (heads[1] - heads[0]) * self.value_bytes


def assemble(pieces: Sequence[tuple[HeadRange, torch.Tensor]], want: HeadRange, geometry: HeadGeometry,
             group: int) -> torch.Tensor | None:
    """The payload of heads `want` built from payloads of the ranges in `pieces` (which must cover
    `want` in head order); None if a piece's size does not match its range."""
    parts = []
    for (h0, h1), data in pieces:
        if data.numel() != geometry.block_bytes(group, (h0, h1)):
            return None
        lo, hi = max(want[0], h0) - h0, min(want[1], h1) - h0
        if lo >= hi:
            continue
        view = data.view(geometry.segments[group], geometry.block_size, h1 - h0, geometry.value_bytes)
        parts.append(view[:, :, lo:hi, :])
    out = torch.cat(parts, dim=2)
    if out.shape[2] != want[1] - want[0]:
        return None
    return out.reshape(-1)
