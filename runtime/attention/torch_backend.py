"""Paged attention in plain torch: runs anywhere, and is the reference the Triton backend must match.

Short queries are batched: decode rows (one new token per sequence) and queries of up to
_SHORT_QUERY tokens (speculative verification, small prefill chunks) are sorted by context length
into a few groups (so short sequences are not padded to the longest), each group's K/V gathered
token by token into a reused workspace and attended with one scaled_dot_product_attention call;
decodes and multi-token queries are grouped apart, so a decode is never padded to several query
rows. Longer prefill and chunked-prefill sequences go one by one through
scaled_dot_product_attention with a causal mask offset by the tokens already cached. The gather
plan is built once per step (per AttentionMetadata and window) and reused by every layer.

A sliding-window layer gathers only the positions inside its queries' windows (never a slot
behind them: those blocks may be freed), so its cost is bounded by the window, not the context.
Soft-capped scores (Gemma 2) cannot go through SDPA; they take an explicit float32 softmax.
ALiBi (``alibi_slopes``, MPT) goes through SDPA with an additive float mask: slope_h * (j - i)
for a query at position i and a key at j <= i, -inf elsewhere; the native decode kernel adds the
same term to its scores.

Decode rows of float32 steps on the CPU go to the native paged decode kernel instead (kernels/cpu,
when it builds and the kernel mode allows it): it reads K/V straight out of the cache blocks
(within the window, soft-capping included), so a decode step's attention is one call per layer
instead of a gather, a mask and an SDPA call. The decode rows of a mixed step (prefill chunks
with decodes) take it too, so a decoded token's attention is the same whatever shares its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kvserve.kernels.reference import is_fp8, quantize_kv_ref
from kvserve.runtime.attention.backend import AttentionMetadata
from kvserve.runtime.executor.platform import platform_for
from kvserve.runtime.kv_cache import as_storage

# Batches of at least this many short-query sequences are split into length-sorted groups.
_GROUP_MIN_SEQS = 16
_MAX_GROUPS = 4
# Queries up to this long take the batched path: one padded SDPA call per group instead of one per
# sequence, which on CPU costs less than the padding (a verify step of 16 sequences x 5 positions
# spent 5x a decode step's attention time in the per-sequence loop).
_SHORT_QUERY = 16


@dataclass
class _Group:
    """Sequences attended together, each padded to Q query rows and T context positions (the
    positions from the first one visible to any of the sequence's query rows, `lo`, on)."""

    rows: torch.Tensor  # int64 [S * Q]: packed query row of each (sequence, query slot); padding repeats the last
    slots: torch.Tensor  # int64 [S * T]: cache slot of each (sequence, position); past the end, the last one
    # bool: key position visible to the query row; [S, 1, 1, T] when Q == 1 (broadcast over the
    # query heads), else [S, 1, G * Q, T] in the (KV-head group, query slot) row order of _attend_group.
    visible: torch.Tensor
    num_seqs: int
    query_len: int  # Q
    max_len: int  # T
    # Q > 1: indices into the S * Q padded rows that are real, and their packed rows.
    keep: torch.Tensor | None = None
    out_rows: torch.Tensor | None = None
    # Absolute positions (ALiBi's distances): of each gathered key [S, T], of each query slot [S, Q].
    key_pos: torch.Tensor | None = None
    row_pos: torch.Tensor | None = None


@dataclass
class _Plan:
    meta: AttentionMetadata
    block_size: int
    heads_per_kv: int
    window: int | None
    groups: list[_Group]
    prefill: list[tuple[int, int, int, int]]  # (sequence, first row, end row, seq_len)
    # The native decode kernel takes the decode rows of a mixed step (then they are in no group):
    # their packed query rows, block tables and context lengths.
    native_decode: bool = False
    decode_rows: torch.Tensor | None = None
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None


class TorchAttentionBackend:
    """Pure-torch paged attention. One instance serves every layer of one model: it caches the
    gather plan for the AttentionMetadata object it last saw, so build a fresh metadata object per
    step (never mutate one in place), and keep one instance per engine thread. Its gather
    workspaces grow to the largest group's K/V (outside the KV cache budget)."""

    name = "torch"

    def __init__(self) -> None:
        self._plans: dict[int | None, _Plan] = {}  # by window, all for one metadata object
        self._workspace: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        if platform_for(key.device).native_write_kv(key, value, k_cache):
            from kvserve.kernels.cpu import native

            native.write_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        if is_fp8(k_cache):  # stored as x / scale in float8, written through uint8 views
            key = quantize_kv_ref(key, k_scale, k_cache.dtype).view(torch.uint8)
            value = quantize_kv_ref(value, v_scale, v_cache.dtype).view(torch.uint8)
            k_cache, v_cache = as_storage(k_cache), as_storage(v_cache)
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
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
               sliding_window: int | None = None, logits_soft_cap: float | None = None,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        window = sliding_window
        native_decode = platform_for(query.device).native_decode_attention(query, k_cache)
        if meta.is_decode_only and native_decode:
            from kvserve.kernels.cpu import native

            return native.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                                 window=window or 0, softcap=logits_soft_cap or 0.0,
                                                 alibi_slopes=alibi_slopes)
        # float8 pools: K/V are read as stored and upcast; k_scale is folded into the queries and
        # v_scale into the output (q . (k8 * ks) == (q * ks) . k8), so no dequantized copy is made.
        fp8 = is_fp8(k_cache)
        ks, vs = (k_scale, v_scale) if fp8 else (None, None)
        plan = self._get_plan(meta, k_cache.shape[1], query.shape[1] // k_cache.shape[2], window, query.device,
                              native_decode)
        out = torch.empty_like(query)
        if plan.decode_rows is not None:
            # A mixed step's decode rows read the cache as a pure decode step's do, so a token's
            # numbers do not depend on whether a prefill shared its step.
            from kvserve.kernels.cpu import native

            out[plan.decode_rows] = native.paged_decode_attention(
                query[plan.decode_rows], k_cache, v_cache, plan.decode_tables, plan.decode_lens, scale,
                window=window or 0, softcap=logits_soft_cap or 0.0, alibi_slopes=alibi_slopes)
        for group in plan.groups:
            o = self._attend_group(query[group.rows], k_cache, v_cache, group, scale, logits_soft_cap, ks, vs,
                                   alibi_slopes)
            if group.keep is None:
                out[group.rows] = o
            else:
                out[group.out_rows] = o[group.keep]
        block_size = plan.block_size
        for i, q0, q1, seq_len in plan.prefill:
            q_len = q1 - q0
            context = seq_len - q_len
            # The first position any query row of this sequence can see.
            lo = 0 if window is None else max(0, context - window + 1)
            if context == 0:  # nothing cached before this step: the new K/V are the whole context
                k, v = key[q0:q1], value[q0:q1]
                if fp8:  # what the cache holds, so a cached prefix later gives the same numbers
                    k, v = quantize_kv_ref(k, k_scale, k_cache.dtype), quantize_kv_ref(v, v_scale, v_cache.dtype)
            else:
                first = lo // block_size
                blocks = meta.block_tables[i, first: (seq_len + block_size - 1) // block_size].long()
                k = as_storage(k_cache)[blocks].view(k_cache.dtype).flatten(0, 1)
                v = as_storage(v_cache)[blocks].view(v_cache.dtype).flatten(0, 1)
                k = k[lo - first * block_size: seq_len - first * block_size]
                v = v[lo - first * block_size: seq_len - first * block_size]
            out[q0:q1] = self._prefill(query[q0:q1], k, v, context, lo, scale, window, logits_soft_cap, ks, vs,
                                       alibi_slopes)
        return out

    def _get_plan(self, meta: AttentionMetadata, block_size: int, heads_per_kv: int, window: int | None,
                  device: torch.device, native_decode: bool = False) -> _Plan:
        # Every layer of one forward pass with the same window sees the same metadata object; the
        # plan holds a strong reference to it, so an identity match cannot be a recycled id.
        # Layers with and without a window (Gemma) each get a plan of their own for the step, and
        # with KV cache groups each window's layers see their group's metadata object, so a stale
        # plan is replaced per window (never all at once, which would rebuild per layer).
        plan = self._plans.get(window)
        if (plan is not None and plan.meta is meta and plan.block_size == block_size
                and plan.heads_per_kv == heads_per_kv and plan.native_decode == native_decode):
            return plan
        q_starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        tree = None if meta.tree_masks is None else meta.tree_masks.tolist()
        decode_seqs, short_seqs, prefill, tree_seqs = [], [], [], []
        for i, seq_len in enumerate(seq_lens):
            q0, q1 = q_starts[i], q_starts[i + 1]
            if tree is not None and q1 - q0 > 1 and tree[q0]:
                tree_seqs.append(i)
            elif q1 - q0 == 1:
                decode_seqs.append(i)
            elif 1 < q1 - q0 <= _SHORT_QUERY:
                short_seqs.append(i)
            elif q1 > q0:
                prefill.append((i, q0, q1, seq_len))
        groups = []
        decode_rows = decode_tables = decode_lens = None
        if native_decode and decode_seqs:
            decode_rows = torch.tensor([q_starts[i] for i in decode_seqs], dtype=torch.long, device=device)
            idx = torch.tensor(decode_seqs, dtype=torch.long, device=device)
            decode_tables = meta.block_tables.index_select(0, idx).to(torch.int32).contiguous()
            decode_lens = meta.seq_lens.index_select(0, idx).to(torch.int32).contiguous()
            decode_seqs = []
        for members in (decode_seqs, short_seqs):
            if not members:
                continue
            members.sort(key=lambda i: seq_lens[i])
            n = len(members)
            count = 1 if n < _GROUP_MIN_SEQS else min(_MAX_GROUPS, n // (_GROUP_MIN_SEQS // 2))
            size = -(-n // count)
            for g in range(0, n, size):
                part = members[g:g + size]
                q_lens = [q_starts[i + 1] - q_starts[i] for i in part]
                lens = [seq_lens[i] for i in part]
                # Sorted by context length, but a window bounds what each one reads.
                groups.append(self._group(meta, part, [q_starts[i] for i in part], q_lens, lens,
                                          block_size, heads_per_kv, window, device))
        if tree_seqs:
            groups.append(_tree_group(meta, tree_seqs, q_starts, seq_lens, tree, block_size, heads_per_kv, window,
                                      device))
        plan = _Plan(meta, block_size, heads_per_kv, window, groups, prefill, native_decode, decode_rows,
                     decode_tables, decode_lens)
        self._plans[window] = plan
        return plan

    @staticmethod
    def _group(meta: AttentionMetadata, members: list[int], q_starts: list[int], q_lens: list[int],
               lens: list[int], block_size: int, heads_per_kv: int, window: int | None,
               device: torch.device) -> _Group:
        # Sequence i reads positions lo_i .. len_i - 1: from the first one its first query row sees.
        los = [0 if window is None else max(0, n - q - window + 1) for n, q in zip(lens, q_lens)]
        max_len, q_max = max(n - lo for n, lo in zip(lens, los)), max(q_lens)
        idx = torch.tensor(members, dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)[:, None]
        lo_t = torch.tensor(los, dtype=torch.long, device=device)[:, None]
        pos = torch.arange(max_len, device=device)[None, :]
        # Positions past a sequence's end read its last token again: always written, so finite,
        # and masked out (0 * NaN from an unwritten slot would poison the output).
        clamped = torch.minimum(pos + lo_t, lens_t - 1)
        blocks = meta.block_tables.index_select(0, idx).long().gather(1, clamped // block_size)
        slots = (blocks * block_size + clamped % block_size).flatten()
        s = len(members)
        if q_max == 1:
            # One query row at len - 1: it sees lo .. len - 1, exactly the positions gathered.
            return _Group(torch.tensor(q_starts, dtype=torch.long, device=device), slots,
                          (pos + lo_t < lens_t)[:, None, None, :], s, 1, max_len,
                          key_pos=pos + lo_t, row_pos=lens_t - 1)
        # Query slot j of a sequence with q new tokens is its row min(j, q - 1) (padding repeats the
        # last row) at absolute position len - q + min(j, q - 1); it sees positions up to there
        # (and, with a window, after there - window).
        q_lens_t = torch.tensor(q_lens, dtype=torch.long, device=device)[:, None]
        j = torch.minimum(torch.arange(q_max, device=device)[None, :], q_lens_t - 1)
        rows = (torch.tensor(q_starts, dtype=torch.long, device=device)[:, None] + j).flatten()
        key_pos = (pos + lo_t)[:, None, :]  # [S, 1, T]
        row_pos = (lens_t - q_lens_t + j)[:, :, None]  # [S, Q, 1]
        visible = key_pos <= row_pos  # [S, Q, T]
        if window is not None:
            visible &= key_pos > row_pos - window
        visible = visible[:, None, None].expand(s, 1, heads_per_kv, q_max, max_len)
        real = (torch.arange(q_max, device=device)[None, :] < q_lens_t).flatten()
        keep = real.nonzero().flatten()
        return _Group(rows, slots, visible.reshape(s, 1, heads_per_kv * q_max, max_len), s, q_max, max_len,
                      keep, rows[keep], key_pos=key_pos[:, 0], row_pos=row_pos[:, :, 0])

    def _gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
        """K and V rows for `slots`, copied into workspaces reused across layers and steps: fresh
        large allocations cost more in page faults than the copy itself on CPU. float8 pools are
        copied as their bytes (index_select has no float8 kernel everywhere)."""
        row = k_cache.shape[2] * k_cache.shape[3]
        n = slots.shape[0]
        k_src, v_src = as_storage(k_cache), as_storage(v_cache)
        key = (k_cache.dtype, k_cache.device, row)
        bufs = self._workspace.get(key)
        if bufs is None or bufs[0].shape[0] < n:
            cap = max(n, int(1.25 * bufs[0].shape[0]) if bufs is not None else n)
            bufs = (torch.empty(cap, row, dtype=k_src.dtype, device=k_cache.device),
                    torch.empty(cap, row, dtype=v_src.dtype, device=v_cache.device))
            self._workspace[key] = bufs
        k_out, v_out = bufs[0][:n], bufs[1][:n]
        torch.index_select(k_src.view(-1, row), 0, slots, out=k_out)
        torch.index_select(v_src.view(-1, row), 0, slots, out=v_out)
        return k_out.view(k_cache.dtype), v_out.view(v_cache.dtype)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, lo: int, scale: float,
                 window: int | None, soft_cap: float | None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """q [Q, H, D] at positions context..context+Q-1 over k/v [context+Q-lo, Hkv, D], the
        positions lo..context+Q-1 (float8 k/v with their scales, or in the model dtype)."""
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        q_len, kv_len = q.shape[0], k.shape[0]
        # A leading batch axis of 1: on CPU, SDPA takes its flash kernel only for 4-D inputs; 3-D
        # ones go to the math path, which materializes the [H, Q, K] scores (3-4x slower at 300-512
        # tokens, one thread). transformers' own SDPA attention is 4-D too.
        qh = q.transpose(0, 1).to(compute)[None]
        if k_scale is not None:
            qh = qh * k_scale
        kh = k.transpose(0, 1).to(compute)[None]
        vh = v.transpose(0, 1).to(compute)[None]
        gqa = qh.shape[1] != kh.shape[1]
        windowed = window is not None and context + q_len > window
        if context == 0 and not windowed and soft_cap is None and alibi_slopes is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + context
            keys = torch.arange(kv_len, device=q.device)[None, :] + lo
            mask = keys <= rows
            if windowed:
                mask &= keys > rows - window
            if alibi_slopes is not None:
                bias = _alibi_bias(alibi_slopes.view(-1, 1, 1), (keys - rows)[None], mask[None], compute)
                mask = bias[None]  # [1, H, Q, K], additive
            if soft_cap is None:
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
            else:
                o = _soft_capped_attention(qh, kh, vh, mask, scale, soft_cap)
        if v_scale is not None:
            o = o * v_scale
        return o[0].transpose(0, 1).to(dtype)

    def _attend_group(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _Group,
                      scale: float, soft_cap: float | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """q [S * Q, H, D], Q query rows per sequence, over each sequence's cached context."""
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        h, d = q.shape[1], q.shape[2]
        s, nq, t = group.num_seqs, group.query_len, group.max_len
        kv_heads = k_cache.shape[2]
        groups = h // kv_heads
        k, v = self._gather(k_cache, v_cache, group.slots)
        k = k.view(s, t, kv_heads, d).to(compute)
        v = v.view(s, t, kv_heads, d).to(compute)
        # The query heads sharing a KV head, times the query slots, play the role of SDPA's query
        # rows: [S, Hkv, G * Q, D] against [S, Hkv, T, D] (strided views of the workspace, read in
        # place) needs no repeat of K/V, only the per-row visibility mask.
        q = q.to(compute).view(s, nq, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(s, kv_heads, groups * nq, d)
        if k_scale is not None:
            q = q * k_scale
        mask = group.visible
        if alibi_slopes is not None:
            # Rows are (query head within its KV group, query slot): head kv * G + g at slot j.
            distance = group.key_pos[:, None, None, None, :] - group.row_pos[:, None, None, :, None]  # [S,1,1,Q,T]
            slopes = alibi_slopes.view(1, kv_heads, groups, 1, 1)
            visible = mask.view(s, 1, -1, nq if mask.shape[2] != 1 else 1, t)
            mask = _alibi_bias(slopes, distance, visible, compute).reshape(s, kv_heads, groups * nq, t)
        if soft_cap is None:
            out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                                 scale=scale)
        else:
            out = _soft_capped_attention(q, k.transpose(1, 2), v.transpose(1, 2), mask, scale, soft_cap)
        if v_scale is not None:
            out = out * v_scale
        return out.view(s, kv_heads, groups, nq, d).permute(0, 3, 1, 2, 4).reshape(s * nq, h, d).to(dtype)


def _tree_group(meta: AttentionMetadata, members: list[int], q_starts: list[int], seq_lens: list[int],
                tree: list[int], block_size: int, heads_per_kv: int, window: int | None,
                device: torch.device) -> _Group:
    """Candidate trees (AttentionMetadata.tree_masks) as one padded group: row j of a sequence
    sees its context and the tree slots whose bit is set in its mask. Positions (for the window
    and ALiBi) are the context length plus each node's depth, slots being in node order."""
    q_lens = [q_starts[i + 1] - q_starts[i] for i in members]
    ctxs = [seq_lens[i] - q for i, q in zip(members, q_lens)]
    los = [0 if window is None else max(0, c - window + 1) for c in ctxs]
    max_len = max(seq_lens[i] - lo for i, lo in zip(members, los))
    q_max = max(q_lens)
    s = len(members)
    masks, depths = [], []
    for i, q in zip(members, q_lens):
        row = tree[q_starts[i]:q_starts[i] + q]
        row = row + [row[-1]] * (q_max - q)  # padding repeats the last row (dropped by `keep`)
        masks.append(row)
        depths.append([bin(m & (2**64 - 1)).count("1") - 1 for m in row])
    masks_t = torch.tensor(masks, dtype=torch.long, device=device)  # [S, Q]
    depth_t = torch.tensor(depths, dtype=torch.long, device=device)
    idx = torch.tensor(members, dtype=torch.long, device=device)
    lens_t = torch.tensor([seq_lens[i] for i in members], dtype=torch.long, device=device)[:, None]
    ctx_t = torch.tensor(ctxs, dtype=torch.long, device=device)[:, None]
    key = torch.arange(max_len, device=device)[None, :] + torch.tensor(los, dtype=torch.long, device=device)[:, None]
    clamped = torch.minimum(key, lens_t - 1)  # past the end: the last slot again, masked out
    blocks = meta.block_tables.index_select(0, idx).long().gather(1, clamped // block_size)
    slots = (blocks * block_size + clamped % block_size).flatten()
    node = (key - ctx_t).clamp(0, q_max - 1)  # [S, T]: the tree slot's node (where key >= ctx)
    key_pos = torch.where(key < ctx_t, key, ctx_t + depth_t.gather(1, node))
    row_pos = ctx_t + depth_t  # [S, Q]
    bit = (masks_t[:, :, None] >> (key - ctx_t).clamp(0, 63)[:, None, :]) & 1  # [S, Q, T]
    visible = torch.where((key < ctx_t)[:, None, :], True, (bit != 0) & (key < lens_t)[:, None, :])
    if window is not None:
        visible &= key_pos[:, None, :] > row_pos[:, :, None] - window
    q_lens_t = torch.tensor(q_lens, dtype=torch.long, device=device)[:, None]
    j = torch.minimum(torch.arange(q_max, device=device)[None, :], q_lens_t - 1)
    rows = (torch.tensor([q_starts[i] for i in members], dtype=torch.long, device=device)[:, None] + j).flatten()
    visible = visible[:, None, None].expand(s, 1, heads_per_kv, q_max, max_len)
    keep = (torch.arange(q_max, device=device)[None, :] < q_lens_t).flatten().nonzero().flatten()
    return _Group(rows, slots, visible.reshape(s, 1, heads_per_kv * q_max, max_len), s, q_max, max_len,
                  keep, rows[keep], key_pos=key_pos, row_pos=row_pos)


def _alibi_bias(slopes: torch.Tensor, distance: torch.Tensor, visible: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """slope * (key position - query position) where visible, -inf elsewhere (broadcast together)."""
    bias = slopes.to(dtype) * distance.to(dtype)
    return bias.masked_fill(~visible, float("-inf"))


def _soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                           scale: float, cap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap), masked) v, as transformers' eager attention does it
    (SDPA has no soft-capping). q [B, H, Q, D], k/v [B, Hkv, T, D] with H a multiple of Hkv."""
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if visible.dtype == torch.bool:
        scores = scores.masked_fill(~visible, float("-inf"))
    else:  # an additive mask (ALiBi's biases, -inf where not visible)
        scores = scores + visible
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v)
