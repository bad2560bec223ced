"""Multi-head latent attention (DeepSeek V2/V3) over a paged cache of latents.

Each layer's cache is one pool ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``:
per token, the normalized KV latent ``c`` and the rotated, head-shared rotary key ``k_pe``. The
block tables, slot mapping, prefix caching, copy-on-write and preemption are those of any other
model: only what a slot holds differs.

Two ways to attend, picked per sequence of a packed batch:

- prefill (a prompt or chunk of several tokens): the context's latents (the new ones, or the
  cached prefix gathered through the block table plus the chunk) are up-projected with kv_b_proj
  to per-head K_nope and V, k_pe is appended to every head's K, and causal attention runs as for
  any model (query/key dim nope + rope, value dim v_head_dim). Up-projecting S tokens costs
  S x kv_lora_rank x H x (nope + v) once per chunk, which the chunk's many queries amortize.
- decode (one new token): weight absorption. W_UK (kv_b_proj's K rows) is folded into the query,
  q_lat = q_nope W_UK, so scores are [q_lat | q_pe] . [c | k_pe] straight against the cached
  latents, the attention-weighted sum of the c's is the output in latent space, and W_UV (the V
  rows) takes it back to v_head_dim per head. No per-token up-projection at all: the step reads
  each cached latent once for all heads (an MQA with one 576-wide "head" in DeepSeek V3).

The decode attention over latents is the only paged kernel: `TorchMLAAttention` does it with
SDPA (CPU and the reference), the Triton subclass (kvserve.runtime.attention.triton_mla) with a flash-
decoding kernel. Both share the prefill path, which is plain torch (SDPA) on either device.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kvserve.runtime.attention.backend import AttentionBackend, AttentionMetadata

# Decode sequences are attended in groups of at most this many padded (sequence x position)
# latents, so a large batch of long contexts never gathers one huge workspace.
_DECODE_GROUP_TOKENS = 32768


@dataclass
class MLAPlan:
    """How one packed batch splits into absorbed decodes and up-projected prefills."""

    meta: AttentionMetadata
    # Packed rows of the decode sequences, and a metadata of just those sequences (one query row
    # each, packed in the same order) for the decode kernel.
    decode_rows: torch.Tensor
    decode_meta: AttentionMetadata | None
    prefill: list[tuple[int, int, int, int]]  # (sequence, first row, end row, seq_len)
    # Medusa trees (AttentionMetadata.tree_masks): per prefill entry, its rows' ancestor masks
    # when the sequence is verified as a candidate tree, else None (causal).
    prefill_trees: list[torch.Tensor | None] | None = None
    # Torch path: decode sequences in length-sorted groups (indices into decode_meta's sequences),
    # made on first use (the Triton path never needs them).
    decode_groups: list[torch.Tensor] | None = None


def _decode_groups(meta: AttentionMetadata) -> list[torch.Tensor]:
    lens = meta.seq_lens.tolist()
    device = meta.seq_lens.device
    groups, group = [], []
    for j in sorted(range(len(lens)), key=lambda j: lens[j]):
        if group and (len(group) + 1) * lens[j] > _DECODE_GROUP_TOKENS:
            groups.append(torch.tensor(group, dtype=torch.long, device=device))
            group = []
        group.append(j)
    groups.append(torch.tensor(group, dtype=torch.long, device=device))
    return groups


def build_plan(meta: AttentionMetadata) -> MLAPlan:
    if meta.is_decode_only:
        # Every row is one sequence's decode: the metadata is already the decode kernel's, and
        # nothing here may read the device (a CUDA graph captures this step).
        rows = torch.arange(meta.seq_lens.shape[0], device=meta.seq_lens.device)
        return MLAPlan(meta, rows, meta, [])
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    decode_seqs, prefill = [], []
    tree = None if meta.tree_masks is None else meta.tree_masks.tolist()
    trees = []
    for i, seq_len in enumerate(seq_lens):
        q0, q1 = starts[i], starts[i + 1]
        if q1 - q0 == 1:
            decode_seqs.append(i)
        elif q1 > q0:
            prefill.append((i, q0, q1, seq_len))
            trees.append(meta.tree_masks[q0:q1] if tree is not None and tree[q0] else None)
    device = meta.seq_lens.device
    decode_meta = None
    rows = torch.tensor([starts[i] for i in decode_seqs], dtype=torch.long, device=device)
    if decode_seqs:
        idx = torch.tensor(decode_seqs, dtype=torch.long, device=device)
        n = len(decode_seqs)
        decode_meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_lens=meta.seq_lens.index_select(0, idx),
            block_tables=meta.block_tables.index_select(0, idx),
            slot_mapping=meta.slot_mapping.index_select(0, rows),
            max_query_len=1, max_seq_len=max(seq_lens[i] for i in decode_seqs), is_decode_only=True)
    return MLAPlan(meta, rows, decode_meta, prefill, prefill_trees=trees)


class TorchMLAAttention:
    """MLA's cache write, prefill and absorbed decode in plain torch. One instance per attention
    backend (see `mla_attention_for`): every layer of a step shares its plan."""

    name = "torch"

    def __init__(self) -> None:
        self._plan: MLAPlan | None = None

    def plan(self, meta: AttentionMetadata) -> MLAPlan:
        # Same rule as the torch attention backend: one metadata object per step, never mutated.
        if self._plan is None or self._plan.meta is not meta:
            self._plan = build_plan(meta)
        return self._plan

    @staticmethod
    def write_latent(entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """entry [T, latent_dim] into cache [num_blocks, block_size, 1, latent_dim] at the slots."""
        flat = cache.view(-1, cache.shape[-1])
        valid = slot_mapping >= 0
        if bool(valid.all()):
            flat.index_copy_(0, slot_mapping, entry.to(cache.dtype))
        else:
            flat.index_copy_(0, slot_mapping[valid], entry[valid].to(cache.dtype))

    def decode(self, q: torch.Tensor, cache: torch.Tensor, plan: MLAPlan, kv_lora_rank: int,
               scale: float) -> torch.Tensor:
        """Absorbed queries q [n, H, latent_dim] (one per decode sequence, in plan order) over
        their cached latents: [n, H, kv_lora_rank], the attention output in latent space."""
        meta = plan.decode_meta
        assert meta is not None
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=dtype, device=q.device)
        block_size = cache.shape[1]
        flat = cache.view(-1, cache.shape[-1])
        if plan.decode_groups is None:
            plan.decode_groups = _decode_groups(meta)
        for members in plan.decode_groups:
            lens = meta.seq_lens.index_select(0, members).long()[:, None]
            max_len = int(lens.max())
            pos = torch.arange(max_len, device=q.device)[None, :]
            # Past a sequence's end read its last latent again (written, so finite) and mask it.
            clamped = torch.minimum(pos, lens - 1)
            blocks = meta.block_tables.index_select(0, members).long().gather(1, clamped // block_size)
            lat = flat.index_select(0, (blocks * block_size + clamped % block_size).flatten())
            lat = lat.view(len(members), 1, max_len, -1).to(compute)
            # The H query heads share the one latent "head": they are SDPA's query rows.
            o = F.scaled_dot_product_attention(q.index_select(0, members).to(compute)[:, None], lat,
                                               lat[..., :kv_lora_rank], attn_mask=(pos < lens)[:, None, None, :],
                                               scale=scale)
            out[members] = o[:, 0].to(dtype)
        return out

    def gather_context(self, cache: torch.Tensor, meta: AttentionMetadata, seq: int, seq_len: int) -> torch.Tensor:
        """One sequence's latents [seq_len, latent_dim] in position order."""
        block_size = cache.shape[1]
        blocks = meta.block_tables[seq, : (seq_len + block_size - 1) // block_size].long()
        return cache[blocks].reshape(-1, cache.shape[-1])[:seq_len]

    @staticmethod
    def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, scale: float,
                tree_masks: torch.Tensor | None = None) -> torch.Tensor:
        """q [Q, H, Dqk] at positions context.. over k [S, H, Dqk], v [S, H, Dv]: [Q, H, Dv].
        With `tree_masks` (int64 [Q], a Medusa candidate tree: kernels/tree_attention.py) row j
        sees the context and the new slots whose bit is set in its mask instead of rows 0..j.
        Nothing else reads positions here: the rotary key was rotated at the node's depth."""
        dtype = q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        qh, kh, vh = (t.transpose(0, 1).to(compute)[None] for t in (q, k, v))  # 4-D: SDPA's fast CPU path
        if tree_masks is not None:
            bits = torch.arange(q.shape[0], device=q.device)
            in_tree = ((tree_masks[:, None] >> bits[None, :]) & 1).bool()
            mask = torch.cat([torch.ones(q.shape[0], context, dtype=torch.bool, device=q.device), in_tree], dim=1)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        elif context == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            rows = torch.arange(q.shape[0], device=q.device)[:, None] + context
            mask = torch.arange(k.shape[0], device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1).to(dtype)


_instances: weakref.WeakKeyDictionary[object, TorchMLAAttention] = weakref.WeakKeyDictionary()


def mla_attention_for(backend: AttentionBackend) -> TorchMLAAttention:
    """The MLA counterpart of an attention backend ("triton": the Triton decode kernel), shared by
    every layer that uses that backend."""
    impl = _instances.get(backend)
    if impl is None:
        if getattr(backend, "name", "torch") == "triton":
            from kvserve.runtime.attention.triton_mla import TritonMLAAttention

            impl = TritonMLAAttention()
        else:
            impl = TorchMLAAttention()
        _instances[backend] = impl
    return impl
