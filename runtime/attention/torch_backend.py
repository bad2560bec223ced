"""Paged attention in plain torch: runs anywhere, and is the reference the Triton backend must match.

Decode rows (one new token per sequence) are batched: sorted by length into a few groups (so short
sequences are not padded to the longest), each group's K/V gathered token by token into a reused
workspace and attended with one scaled_dot_product_attention call. Prefill and chunked-prefill
sequences go one by one through scaled_dot_product_attention with a causal mask offset by the
tokens already cached. The gather plan is built once per step (per AttentionMetadata) and reused by
every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kvserve.runtime.attention.backend import AttentionMetadata

# Decode batches at least this large are split into length-sorted groups.
_GROUP_MIN_SEQS = 16
_MAX_GROUPS = 4


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # int64 [S]: the group's query rows in the packed batch
    slots: torch.Tensor  # int64 [S * T]: cache slot of each (sequence, position); past the end, the last one
    visible: torch.Tensor  # bool [S, 1, 1, T]: position < seq_len
    num_seqs: int
    max_len: int


@dataclass
class _Plan:
    meta: AttentionMetadata
    block_size: int
    decode: list[_DecodeGroup]
    prefill: list[tuple[int, int, int, int]]  # (sequence, first row, end row, seq_len)


class TorchAttentionBackend:
    """Pure-torch paged attention. One instance serves every layer of one model: it caches the
    gather plan for the AttentionMetadata object it last saw, so build a fresh metadata object per
    step (never mutate one in place), and keep one instance per engine thread. Its decode
    workspaces grow to the largest decode group's K/V (outside the KV cache budget)."""

    name = "torch"

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._workspace: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
        v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
        valid = slot_mapping >= 0
        if bool(valid.all()):
            k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
            v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
        else:
            slots = slot_mapping[valid]
            k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
            v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._get_plan(meta, k_cache.shape[1], query.device)
        out = torch.empty_like(query)
        for group in plan.decode:
            out[group.rows] = self._decode(query[group.rows], k_cache, v_cache, group, scale)
        block_size = plan.block_size
        for i, q0, q1, seq_len in plan.prefill:
            q_len = q1 - q0
            if seq_len == q_len:  # nothing cached before this step: the new K/V are the whole context
                k, v = key[q0:q1], value[q0:q1]
            else:
                blocks = meta.block_tables[i, : (seq_len + block_size - 1) // block_size].long()
                k = k_cache[blocks].flatten(0, 1)[:seq_len]
                v = v_cache[blocks].flatten(0, 1)[:seq_len]
            out[q0:q1] = self._prefill(query[q0:q1], k, v, seq_len - q_len, scale)
        return out

    def _get_plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
        # Every layer of one forward pass sees the same metadata object; the plan holds a strong
        # reference to it, so an identity match cannot be a recycled id.
        plan = self._plan
        if plan is not None and plan.meta is meta and plan.block_size == block_size:
            return plan
        q_starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        decode_seqs, prefill = [], []
        for i, seq_len in enumerate(seq_lens):
            q0, q1 = q_starts[i], q_starts[i + 1]
            if q1 - q0 == 1:
                decode_seqs.append(i)
            elif q1 > q0:
                prefill.append((i, q0, q1, seq_len))
        groups = []
        if decode_seqs:
            decode_seqs.sort(key=lambda i: seq_lens[i])
            n = len(decode_seqs)
            count = 1 if n < _GROUP_MIN_SEQS else min(_MAX_GROUPS, n // (_GROUP_MIN_SEQS // 2))
            size = -(-n // count)
            for g in range(0, n, size):
                members = decode_seqs[g:g + size]
                groups.append(self._decode_group(meta, members, [q_starts[i] for i in members],
                                                 [seq_lens[i] for i in members], block_size, device))
        self._plan = _Plan(meta, block_size, groups, prefill)
        return self._plan

    @staticmethod
    def _decode_group(meta: AttentionMetadata, members: list[int], rows: list[int], lens: list[int],
                      block_size: int, device: torch.device) -> _DecodeGroup:
        max_len = max(lens)
        idx = torch.tensor(members, dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)[:, None]
        pos = torch.arange(max_len, device=device)[None, :]
        # Positions past a sequence's end read its last token again: always written, so finite,
        # and masked out (0 * NaN from an unwritten slot would poison the output).
        clamped = torch.minimum(pos, lens_t - 1)
        blocks = meta.block_tables.index_select(0, idx).long().gather(1, clamped // block_size)
        slots = (blocks * block_size + clamped % block_size).flatten()
        return _DecodeGroup(torch.tensor(rows, dtype=torch.long, device=device), slots,
                            (pos < lens_t)[:, None, None, :], len(members), max_len)

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
        """K and V rows for `slots`, copied into workspaces reused across layers and steps: fresh
        large allocations cost more in page faults than the copy itself on CPU."""
        row = k_cache.shape[2] * k_cache.shape[3]
        n = slots.shape[0]
        key = (k_cache.dtype, k_cache.device, row)
        bufs = self._workspace.get(key)
        if bufs is None or bufs[0].shape[0] < n:
            cap = max(n, int(1.25 * bufs[0].shape[0]) if bufs is not None else n)
            bufs = (torch.empty(cap, row, dtype=k_cache.dtype, device=k_cache.device),
                    torch.empty(cap, row, dtype=v_cache.dtype, device=v_cache.device))
            self._workspace[key] = bufs
        k_out, v_out = bufs[0][:n], bufs[1][:n]
        torch.index_select(k_cache.view(-1, row), 0, slots, out=k_out)
        torch.index_select(v_cache.view(-1, row), 0, slots, out=v_out)
        return k_out, v_out

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, scale: float) -> torch.Tensor:
        """q [Q, H, D] at positions context..context+Q-1 over k/v [context+Q, Hkv, D]."""
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        q_len, kv_len = q.shape[0], k.shape[0]
        qh = q.transpose(0, 1).to(compute)
        kh = k.transpose(0, 1).to(compute)
        vh = v.transpose(0, 1).to(compute)
        gqa = qh.shape[0] != kh.shape[0]
        if context == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + context
            mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return o.transpose(0, 1).to(dtype)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup,
                scale: float) -> torch.Tensor:
        """One query row per sequence: q [S, H, D] over each sequence's cached context."""
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        s, h, d = q.shape
        kv_heads = k_cache.shape[2]
        groups, t = h // kv_heads, group.max_len
        k, v = self._gather(k_cache, v_cache, group.slots)
        k = k.view(s, t, kv_heads, d).to(compute)
        v = v.view(s, t, kv_heads, d).to(compute)
        # The query heads sharing a KV head play the role of SDPA's query rows: [S, Hkv, G, D]
        # against [S, Hkv, T, D] (strided views of the workspace, read in place) needs neither a
        # repeat of K/V nor a causal mask, only the per-sequence length mask.
        out = F.scaled_dot_product_attention(q.to(compute).view(s, kv_heads, groups, d), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=group.visible, scale=scale)
        return out.reshape(s, h, d).to(dtype)
