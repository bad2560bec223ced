"""Paged attention in plain torch: runs anywhere, and is the reference the Triton backend must match.

Decode rows (one new token per sequence) are batched into one gather + two matmuls; prefill and
chunked-prefill sequences go one by one through scaled_dot_product_attention with a causal mask
offset by the tokens already cached. Padded and not-yet-written cache slots are masked in both
the scores and the values, since a freshly allocated pool may hold NaNs.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kvserve.runtime.attention.backend import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

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
        out = torch.empty_like(query)
        query_lens = meta.query_lens
        starts = meta.query_start_loc[:-1]
        decode = query_lens == 1
        if meta.is_decode_only or bool(decode.all()):
            decode_idx = torch.arange(meta.num_seqs, device=query.device)
        else:
            decode_idx = torch.nonzero(decode).flatten()
        if decode_idx.numel():
            rows = starts[decode_idx].long()
            out[rows] = self._decode(query[rows], k_cache, v_cache, meta.block_tables[decode_idx],
                                     meta.seq_lens[decode_idx], scale)
        if decode_idx.numel() == meta.num_seqs:
            return out
        block_size = k_cache.shape[1]
        q_starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        is_decode = decode.tolist()
        for i in range(meta.num_seqs):
            if is_decode[i]:
                continue
            q0, q1 = q_starts[i], q_starts[i + 1]
            if q1 == q0:
                continue
            seq_len, q_len = seq_lens[i], q1 - q0
            if seq_len == q_len:  # nothing cached before this step: the new K/V are the whole context
                k, v = key[q0:q1], value[q0:q1]
            else:
                blocks = meta.block_tables[i, : (seq_len + block_size - 1) // block_size].long()
                k = k_cache[blocks].flatten(0, 1)[:seq_len]
                v = v_cache[blocks].flatten(0, 1)[:seq_len]
            out[q0:q1] = self._prefill(query[q0:q1], k, v, seq_len - q_len, scale)
        return out

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, scale: float) -> torch.Tensor:
        """q [Q, H, D] at positions context..context+Q-1 over k/v [context+Q, Hkv, D]."""
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        q_len, kv_len = q.shape[0], k.shape[0]
        qh = q.transpose(0, 1).to(compute)
        kh = k.transpose(0, 1).to(compute)
        vh = v.transpose(0, 1).to(compute)
        groups = qh.shape[0] // kh.shape[0]
        if groups > 1:
            kh = kh.repeat_interleave(groups, dim=0)
            vh = vh.repeat_interleave(groups, dim=0)
        if context == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + context
            mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return o.transpose(0, 1).to(dtype)

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """One query row per sequence: q [S, H, D] over each sequence's cached context."""
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        s, h, d = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        groups = h // kv_heads
        seq_lens = seq_lens.to(q.device).long()
        num_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
        table = block_tables[:, :num_blocks].long()
        # Gathering whole blocks is one contiguous copy per sequence block: [S, T, Hkv, D].
        k = k_cache[table].flatten(1, 2).to(compute)
        v = v_cache[table].flatten(1, 2).to(compute)
        t = k.shape[1]
        valid = torch.arange(t, device=q.device)[None, :] < seq_lens[:, None]  # [S, T]
        invalid = ~valid
        if bool(invalid.any()):
            # Slots past seq_len (the unwritten tail of the last block, padding blocks) may hold
            # NaN, and probability 0 times NaN is still NaN; NaN scores are masked to -inf below.
            v.view(s, t, -1)[invalid] = 0
        qh = q.to(compute).view(s, kv_heads, groups, d)
        scores = torch.empty(kv_heads, s, groups, t, dtype=compute, device=q.device)
        # Per KV head, k[:, :, j] is a strided view that bmm reads in place; a 4-D matmul over
        # the whole thing would copy K first.
        for j in range(kv_heads):
            torch.bmm(qh[:, j], k[:, :, j].transpose(1, 2), out=scores[j])
        scores = scores.float().mul_(scale).masked_fill_(invalid[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(compute)
        out = torch.empty(kv_heads, s, groups, d, dtype=compute, device=q.device)
        for j in range(kv_heads):
            torch.bmm(probs[j], v[:, :, j], out=out[j])
        return out.permute(1, 0, 2, 3).reshape(s, h, d).to(dtype)
