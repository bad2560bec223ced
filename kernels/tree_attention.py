"""Tree attention over the paged cache: the verification pass of a Medusa candidate tree.

Each sequence's query rows are its tree's nodes (root first, parents before children, see
``kvserve.runtime.spec_decode.medusa_tree``), and their K/V are already written to the cache at
the sequence's last q_len slots, in node order. Node i sees the whole context (the seq_len - q_len
slots before the tree) and, among the tree's slots, only those whose bit is set in its int64
ancestor mask ``tree_masks[i]``: itself and its ancestors, never a sibling's branch. With the
chain masks (node i sees nodes 0..i) this is exactly causal prefill over the same slots.

Slot order is not position order: node i sits at position context + depth_i (depth = popcount of
its mask - 1), so siblings share a position while they sit in different slots. Rotary embeddings
are applied before the cache is written; what attention itself reads positions for, a sliding
window (a key is visible when its position > the row's - window) and ALiBi (slope_h * (key position
- row position), after soft-capping), takes every tree key's position from its node's depth, the
context's from its slot. Soft-capping (c tanh(s / c)) and float8 pools (k_scale joins the score
scale, v_scale the output) need no positions. All as the torch backend's tree group does them.

``paged_tree_attention`` is the Triton kernel (the prefill kernel's online softmax, with the
causal test replaced by the mask test past the context); ``tree_attention_ref`` is its torch
twin, which is also the CPU path.
"""

from __future__ import annotations

import torch

from kvserve.kernels.reference import gather_kv

_LOG2E = 1.4426950408889634


def _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, tree_masks, max_query_len=None):
    if query.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"query must be [tokens, heads, head_dim] and the caches [blocks, block_size, kv_heads, "
                         f"head_dim], got {tuple(query.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if query.shape[1] % k_cache.shape[2] or query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query heads/head_dim {tuple(query.shape[1:])} do not fit the cache's "
                         f"{tuple(k_cache.shape[2:])}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}] and block_tables [{num_seqs}, *]")
    if tree_masks.shape != (query.shape[0],) or tree_masks.dtype != torch.int64:
        raise ValueError(f"tree_masks must be int64 [{query.shape[0]}], got {tree_masks.dtype} "
                         f"{tuple(tree_masks.shape)}")
    if max_query_len is not None:  # the caller's word: nothing here may read the device (graph capture)
        longest = max_query_len
    else:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        longest = int(q_lens.max()) if q_lens.numel() else 0
    if longest > 64:
        raise ValueError("a tree has at most 64 nodes (its masks are 64-bit)")


def tree_depths(tree_masks: torch.Tensor) -> torch.Tensor:
    """int32 depth past the root of each node: its mask's popcount (itself and its ancestors) - 1."""
    bits = torch.arange(64, device=tree_masks.device)
    return (((tree_masks[:, None] >> bits) & 1).sum(1) - 1).to(torch.int32)


def _check_options(query, sliding_window, logits_soft_cap, alibi_slopes):
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
        raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap!r}")
    if alibi_slopes is not None and alibi_slopes.shape != (query.shape[1],):
        raise ValueError(f"alibi_slopes must be [num_heads] = [{query.shape[1]}], got {tuple(alibi_slopes.shape)}")


def tree_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       tree_masks: torch.Tensor, scale: float, *, sliding_window: int | None = None,
                       logits_soft_cap: float | None = None, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin (float32 math): see the module docstring."""
    _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, tree_masks)
    _check_options(query, sliding_window, logits_soft_cap, alibi_slopes)
    group = query.shape[1] // k_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    depths = tree_depths(tree_masks).long()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        q_len = hi - lo
        ctx = seq_len - q_len
        k = gather_kv(k_cache, block_tables[i], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[i], seq_len).float().repeat_interleave(group, dim=1)
        q = query[lo:hi].float().transpose(0, 1)  # [H, q, D]
        if k_scale is not None:
            q = q * k_scale.float()
        # Keys before the root's window are invisible to every node (their blocks may be freed).
        first = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
        k, v = k[first:], v[first:]
        scores = (q @ k.permute(1, 2, 0)) * scale  # [H, q, seq_len - first]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        bits = torch.arange(q_len, device=query.device)
        in_tree = ((tree_masks[lo:hi, None] >> bits[None, :]) & 1).bool()  # [q, q]
        visible = torch.cat([torch.ones(q_len, ctx, dtype=torch.bool, device=query.device), in_tree], dim=1)
        row_pos = ctx + depths[lo:hi]  # [q]
        key_pos = torch.cat([torch.arange(ctx, device=query.device), ctx + depths[lo:hi]])[first:]
        visible = visible[:, first:]
        if sliding_window is not None:
            visible &= key_pos[None, :] > row_pos[:, None] - sliding_window
        if alibi_slopes is not None:
            distance = (key_pos[None, :] - row_pos[:, None]).float()
            scores = scores + alibi_slopes.float()[:, None, None] * distance[None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        o = probs @ v.transpose(0, 1)
        if v_scale is not None:
            o = o * v_scale.float()
        out[lo:hi] = o.transpose(0, 1).to(query.dtype)
    return out


try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twin still works without Triton
    triton = None

if triton is not None:

    @triton.jit
    def _tree_kernel(
        Q, KC, VC, BT, SEQ_LENS, QSL, MASKS, OUT, DEPTHS, K_SCALE, V_SCALE, ALIBI,
        scale_log2,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt,
        stride_ot, stride_oh,
        GROUP, HEAD_DIM, window, soft_cap_log2,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr,
        HAS_ALIBI: tl.constexpr,
    ):
        # One program: a tile of (node, group head) rows of one sequence and one KV head.
        tile = tl.program_id(0)
        kvh = tl.program_id(1).to(tl.int64)
        seq = tl.program_id(2).to(tl.int64)
        q_start = tl.load(QSL + seq).to(tl.int64)
        q_len = tl.load(QSL + seq + 1) - q_start
        seq_len = tl.load(SEQ_LENS + seq)
        ctx_len = seq_len - q_len

        r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        node = r // GROUP
        heads = kvh * GROUP + r % GROUP
        r_ok = node < q_len
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + (q_start + node)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        masks = tl.load(MASKS + q_start + node, mask=r_ok, other=0)
        qk_scale = scale_log2
        if KV_FP8:
            qk_scale = scale_log2 * tl.load(K_SCALE)
        if HAS_WINDOW or HAS_ALIBI:
            row_pos = ctx_len + tl.load(DEPTHS + q_start + node, mask=r_ok, other=0)
        if HAS_ALIBI:
            slope = tl.load(ALIBI + heads, mask=r_ok, other=0.0)  # log2 units
        kv_end = tl.where(tile * BLOCK_M < q_len * GROUP, seq_len, 0)
        # Every row sits at context + depth >= ctx_len, so nothing before ctx_len - window + 1 is
        # visible to any of them (and those blocks may already be freed).
        kv_lo = 0
        if HAS_WINDOW:
            kv_lo = tl.minimum(tl.maximum(ctx_len - window + 1, 0), kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = BT + seq * stride_bt
        for n0 in range(kv_lo, kv_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            off = (n % BLOCK_SIZE).to(tl.int64)
            k = tl.load(KC + blk[None, :] * stride_kb + off[None, :] * stride_ks + kvh * stride_kh + d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=DOT_PREC) * qk_scale
            if HAS_SOFT_CAP:
                # In log2 units: c' tanh(s' / c'), both scaled by log2(e); tanh(x) = 1 - 2 / (e^2x + 1)
                x = tl.minimum(tl.maximum(s / soft_cap_log2, -20.0), 20.0)  # tanh(20) is 1 in float32
                e2x = tl.exp2(x * (2.0 * 1.4426950408889634))
                s = soft_cap_log2 * (1.0 - 2.0 / (e2x + 1.0))
            j = tl.maximum(n - ctx_len, 0).to(tl.int64)
            bit = (masks[:, None] >> j[None, :]) & 1
            visible = n_ok[None, :] & ((n[None, :] < ctx_len) | (bit != 0))
            if HAS_WINDOW or HAS_ALIBI:
                # A tree key's position is its node's (context + depth), a context key's its slot.
                key_depth = tl.load(DEPTHS + q_start + j, mask=n_ok & (n >= ctx_len), other=0)
                key_pos = tl.where(n < ctx_len, n, ctx_len + key_depth)
            if HAS_ALIBI:
                s = s + slope[:, None] * (key_pos[None, :] - row_pos[:, None]).to(tl.float32)
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > row_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows past q_len see nothing, and with a window a row may see nothing in a tile yet:
            # subtract 0 there (p and alpha come out 0) rather than -inf - -inf.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PREC)
            m_i = m_new

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * tl.load(V_SCALE)
        tl.store(OUT + (q_start + node)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def paged_tree_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         tree_masks: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                         sliding_window: int | None = None, logits_soft_cap: float | None = None,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                         alibi_slopes: torch.Tensor | None = None, max_query_len: int | None = None) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1). float32 math.
    `max_query_len`: the longest tree, when the caller knows it; then the launch reads nothing
    back from the device, so a CUDA graph can capture it."""
    from kvserve.kernels.attention import _alibi_arg, _kv_scales
    from kvserve.kernels.triton_utils import dot_precision, kernel_for, next_pow2

    if triton is None:
        raise RuntimeError("paged_tree_attention needs Triton; tree_attention_ref is the torch path")
    _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, tree_masks, max_query_len)
    _check_options(query, sliding_window, logits_soft_cap, alibi_slopes)
    kv_fp8, k_scale_arg, v_scale_arg = _kv_scales(query, k_cache, k_scale, v_scale)
    alibi = _alibi_arg(query, alibi_slopes)
    positions = sliding_window is not None or alibi_slopes is not None
    depths = tree_depths(tree_masks) if positions else tree_masks  # placeholder pointer: never read
    if query.stride(-1) != 1:
        query = query.contiguous()
    tokens, heads, dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if tokens == 0 or num_seqs == 0:
        return out
    max_q = (max_query_len if max_query_len is not None
             else int((query_start_loc[1:] - query_start_loc[:-1]).max().item()))
    block_d = max(16, next_pow2(dim))
    block_m, block_n = (64, 32) if query.is_cuda else (32, 32)
    tiles = triton.cdiv(max_q * group, block_m)
    kernel_for(_tree_kernel, query.device)[(tiles, kv_heads, num_seqs)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_masks, out, depths, k_scale_arg,
        v_scale_arg, alibi, scale * _LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        group, dim, sliding_window or 0, (logits_soft_cap or 0.0) * _LOG2E,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PREC=dot_precision(torch.float32), HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None, KV_FP8=kv_fp8, HAS_ALIBI=alibi_slopes is not None,
        num_warps=4 if block_d <= 64 else 8, num_stages=2,
    )
    return out
