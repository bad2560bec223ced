"""Triton paged attention: a flash-decoding decode kernel and a varlen causal prefill kernel.

Both read K/V straight from the paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]``
through the block table, one token tile at a time (each token's block is looked up, so a tile may
span several blocks and need not align with them), and both keep an online softmax in float32
(running max and sum, exp2 with the scale folded into log2 units), so no score matrix larger than
one tile is ever built.

GQA/MQA: a program owns one KV head and computes all query heads of its group against each K/V
tile it loads, so a KV block is read once per KV head, not once per query head.

Decode (one query token per sequence): the launch has a fixed number of splits per sequence
(``num_splits``, chosen on the host from the batch size and the longest context the launch may
see, at most ``MAX_DECODE_SPLITS``), and each program works out from its sequence's *real*
length how many tokens a split holds (at least ``min_split_tokens``): a 200-token context in a
launch sized for 128k uses two splits, and the programs of the other splits return at once. Each
(sequence, KV head, split) program with tokens writes a normalised partial output and its
log-sum-exp, and a merge kernel combines the splits that have tokens (it derives their count
the same way, so it never reads what an empty split did not write). With a single split the
decode kernel writes the output directly and the merge is skipped. This is what lets a CUDA
graph captured for ``max_model_len`` replay cheaply for short contexts: the grid is fixed at
capture, the work is not.

Prefill: packed variable-length queries (``query_start_loc``), query token j of sequence i at
position ``seq_lens[i] - query_len_i + j``, attending causally over the cached prefix and the
chunk itself (already written to the cache). Rows of a program's tile are (token, group head)
pairs, so short queries still fill a tile. A tile's keys fall in two runs: whole key tiles at or
before its first row's position, which every row sees (loaded and scored without masks), then the
few up to its last row's position, masked causally; the tiles with the most keys are started
first. Launch configurations per head size and element size: `prefill_config`, `decode_config`.

Sliding window (``sliding_window`` w): a query at position p sees keys p - w < j <= p. Both
kernels start their key loop at the first position the program's rows can see, so a slot behind
the window is never read (its block may be freed) and the work is bounded by the window. Soft-capping
(``logits_soft_cap`` c, Gemma 2) replaces each scaled score s by c * tanh(s / c) before the softmax.
ALiBi (``alibi_slopes``, float32 [num_heads], MPT) adds slope_h * (j - i) to the score of a query
at position i and a key at j, after soft-capping; the slopes enter in log2 units like the scale.

float8 K/V pools (kv_cache_dtype fp8): tiles are loaded as float8 (half the bytes of bf16) and
upcast to the query dtype in registers; the per-layer k_scale multiplies the score scale and
v_scale the normalised output, both read from one-element tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_utils import dot_precision, kernel_for, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    Q, KC, VC, BT, SEQ_LENS, QSL, OUT, MID_O, MID_LSE, K_SCALE, V_SCALE, ALIBI,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    stride_ms, stride_mh, stride_mp,
    stride_ls, stride_lh,
    GROUP, HEAD_DIM, num_splits, min_split, align, window, soft_cap_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, KV_FP8: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    # float8 K/V: upcast each tile to the query dtype; k_scale joins the score scale and v_scale
    # the output, so the tiles are never multiplied element by element.
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * tl.load(K_SCALE)
    q_row = tl.load(QSL + seq).to(tl.int64)
    q_len = tl.load(QSL + seq + 1) - q_row
    # A sequence with no new token this step has no query row: attend over nothing.
    seq_len = tl.where(q_len > 0, tl.load(SEQ_LENS + seq), 0)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # Rows to read and write: none for a sequence without a query token (limits, not scalar
    # masks, because the interpreter rejects tensor & scalar-bool masks).
    row_ok = g < tl.where(q_len > 0, GROUP, 0)
    heads = kvh * GROUP + g
    q = tl.load(Q + q_row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_ALIBI:
        slope = tl.load(ALIBI + heads, mask=row_ok, other=0.0)  # log2 units

    # The query sits at seq_len - 1; with a window it sees seq_len - window .. seq_len - 1, and the
    # splits cover only that span.
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # Tokens per split from this sequence's real span (same formula as the merge kernel's).
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, num_splits), align) * align, min_split)
    start = lo + split * per_split
    end = tl.minimum(seq_len, start + per_split)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = BT + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        k = tl.load(KC + blk[None, :] * stride_kb + off[None, :] * stride_ks + kvh * stride_kh
                    + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
        if KV_FP8:
            k = k.to(Q.dtype.element_ty)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=DOT_PREC) * qk_scale
        else:
            s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
        if HAS_SOFT_CAP:
            # In log2 units: c' tanh(s' / c'), both scaled by log2(e); tanh(x) = 1 - 2 / (e^2x + 1)
            # (inline: the interpreter cannot call a jit helper) saturates cleanly to +-1.
            x = tl.minimum(tl.maximum(s / soft_cap_log2, -20.0), 20.0)  # tanh(20) is 1 in float32
            e2x = tl.exp2(x * (2.0 * 1.4426950408889634))
            s = soft_cap_log2 * (1.0 - 2.0 / (e2x + 1.0))
        if HAS_ALIBI:  # the query sits at seq_len - 1
            s = s + slope[:, None] * (n[None, :] - (seq_len - 1)).to(tl.float32)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh
                    + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        if KV_FP8:
            v = v.to(Q.dtype.element_ty)
        p = p.to(v.dtype)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(V_SCALE)
    if DIRECT:
        tl.store(OUT + q_row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # A split past the sequence's span did no work and stores nothing: the merge reads only
        # the splits that have tokens.
        live = g < tl.where(start < seq_len, GROUP, 0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(MID_O + seq * stride_ms + heads[:, None] * stride_mh + split * stride_mp + d[None, :],
                 o, mask=live[:, None] & d_ok[None, :])
        tl.store(MID_LSE + seq * stride_ls + heads * stride_lh + split, lse, mask=live)


@triton.jit
def _merge_kernel(
    MID_O, MID_LSE, QSL, SEQ_LENS, OUT,
    stride_ms, stride_mh, stride_mp,
    stride_ls, stride_lh,
    stride_ot, stride_oh,
    num_splits, min_split, align, window, HEAD_DIM,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    q_row = tl.load(QSL + seq).to(tl.int64)
    q_len = tl.load(QSL + seq + 1) - q_row
    # The splits that have tokens, worked out as the decode kernels do.
    seq_len = tl.where(q_len > 0, tl.load(SEQ_LENS + seq), 0)
    span = seq_len
    if HAS_WINDOW:
        span = seq_len - tl.maximum(seq_len - window, 0)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(span, num_splits), align) * align, min_split)
    live = tl.cdiv(span, per_split)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < live
    d_ok = d < HEAD_DIM
    lse = tl.load(MID_LSE + seq * stride_ls + head * stride_lh + sp, mask=sp_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    o = tl.load(MID_O + seq * stride_ms + head * stride_mh + sp[:, None] * stride_mp + d[None, :],
                mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.maximum(tl.sum(w, 0), 1e-30)
    out = tl.sum(w[:, None] * o, 0) / total
    tl.store(OUT + q_row * stride_ot + head * stride_oh + d, out.to(OUT.dtype.element_ty),
             mask=d < tl.where(q_len > 0, HEAD_DIM, 0))


@triton.jit
def _prefill_tiles(
    acc, m_i, l_i, q, KC, VC, bt_row, kvh, pos, slope, qk_scale, soft_cap_log2, window, lo, hi, kv_end, d, d_ok,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_ALIBI: tl.constexpr,
):
    """Key tiles lo, lo + BLOCK_N, ... below hi into the running softmax. Unmasked (MASKED off):
    every key of every tile is visible to every row, so neither the loads nor the scores are
    masked; masked: keys past kv_end, the causal diagonal and the window are."""
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = n < kv_end
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        k_ptr = KC + blk[None, :] * stride_kb + off[None, :] * stride_ks + kvh * stride_kh + d[:, None]
        if MASKED:
            k = tl.load(k_ptr, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptr)
        else:
            k = tl.load(k_ptr, mask=d_ok[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=DOT_PREC)
        else:
            s = tl.dot(q, k, input_precision=DOT_PREC)
        if HAS_SOFT_CAP:
            # In log2 units: c' tanh(s' / c'), both scaled by log2(e); tanh(x) = 1 - 2 / (e^2x + 1)
            # saturates cleanly to +-1.
            x = tl.minimum(tl.maximum(s * qk_scale / soft_cap_log2, -20.0), 20.0)  # tanh(20) is 1 in float32
            e2x = tl.exp2(x * (2.0 * 1.4426950408889634))
            s = soft_cap_log2 * (1.0 - 2.0 / (e2x + 1.0))
        else:
            s = s * qk_scale
        if HAS_ALIBI:
            s = s + slope[:, None] * (n[None, :] - pos[:, None]).to(tl.float32)
        if MASKED:
            visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
            if HAS_WINDOW:
                visible = visible & (n[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if HAS_WINDOW:
            # A later row's window may start past this tile: nothing visible yet, m_new is -inf,
            # and exp2(-inf - -inf) would be NaN. Subtract 0 instead (p and alpha come out 0).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            # Position 0 is in the first tile and visible to every row, so m_new is always finite.
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptr = VC + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + d[None, :]
        if MASKED:
            v = tl.load(v_ptr, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptr)
        else:
            v = tl.load(v_ptr, mask=d_ok[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        p = p.to(v.dtype)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    Q, KC, VC, BT, SEQ_LENS, QSL, OUT, K_SCALE, V_SCALE, ALIBI,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP, HEAD_DIM, window, soft_cap_log2,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_ALIBI: tl.constexpr, CAUSAL_SPLIT: tl.constexpr, EVEN_D: tl.constexpr,
):
    # Query tiles on grid axis 0 (up to 2^31 - 1 programs): a long prompt of a wide GQA group has
    # more tiles than axis z allows (65,535); sequences, at most max_num_seqs, sit on z. The last
    # tiles of a causal prompt have the most keys: they are started first, so that the final wave
    # of programs is the short ones.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = scale_log2 * tl.load(K_SCALE)
    q_start = tl.load(QSL + seq).to(tl.int64)
    q_len = tl.load(QSL + seq + 1) - q_start
    seq_len = tl.load(SEQ_LENS + seq)
    ctx_len = seq_len - q_len

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = r // GROUP
    heads = kvh * GROUP + r % GROUP
    r_ok = tok < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptr = Q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    pos = ctx_len + tok  # absolute position of each row's token
    if HAS_ALIBI:
        slope = tl.load(ALIBI + heads, mask=r_ok, other=0.0)  # log2 units
    else:
        slope = tl.zeros([BLOCK_M], tl.float32)  # unused

    # Keys past the tile's last valid token are causally invisible to every row of the tile.
    has_rows = tile * BLOCK_M < q_len * GROUP
    first_tok = (tile * BLOCK_M) // GROUP
    last_tok = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
    kv_end = tl.where(has_rows, ctx_len + last_tok + 1, 0)
    # With a window, keys before the first row's window are invisible to every row of the tile.
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.minimum(tl.maximum(ctx_len + first_tok - window + 1, 0), kv_end)
    # Whole key tiles every row sees (at or before the first row's position, no window to
    # leave): no masks there. The rest, up to the diagonal, is masked.
    kv_full = kv_lo
    if CAUSAL_SPLIT and not HAS_WINDOW:
        kv_full = tl.where(has_rows, (ctx_len + first_tok + 1) // BLOCK_N * BLOCK_N, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BT + seq * stride_bt
    acc, m_i, l_i = _prefill_tiles(
        acc, m_i, l_i, q, KC, VC, bt_row, kvh, pos, slope, qk_scale, soft_cap_log2, window, kv_lo, kv_full, kv_end,
        d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        BLOCK_SIZE, BLOCK_N, False, EVEN_D, DOT_PREC, DOT_F32, HAS_WINDOW, HAS_SOFT_CAP, KV_FP8, HAS_ALIBI)
    acc, m_i, l_i = _prefill_tiles(
        acc, m_i, l_i, q, KC, VC, bt_row, kvh, pos, slope, qk_scale, soft_cap_log2, window, kv_full, kv_end, kv_end,
        d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        BLOCK_SIZE, BLOCK_N, True, EVEN_D, DOT_PREC, DOT_F32, HAS_WINDOW, HAS_SOFT_CAP, KV_FP8, HAS_ALIBI)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(V_SCALE)
    o_ptr = OUT + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables):
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} != query head_dim {dim}")
    if heads % kv_heads:
        raise ValueError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc must be [{num_seqs + 1}] and block_tables [{num_seqs}, *], "
                         f"got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    return query if query.stride(-1) == 1 else query.contiguous()


def _check_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
        raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap!r}")


def _kv_scales(query: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(float8 pools?, k scale, v scale) as kernel arguments: float32 one-element tensors read
    in-kernel (no host sync, and a captured CUDA graph sees scale updates); unused otherwise."""
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return False, query, query
    one = None

    def as_arg(scale):
        nonlocal one
        if scale is None:
            if one is None:
                one = torch.ones(1, dtype=torch.float32, device=query.device)
            return one
        return scale.reshape(1).to(device=query.device, dtype=torch.float32)

    return True, as_arg(k_scale), as_arg(v_scale)


def _alibi_arg(query: torch.Tensor, slopes: torch.Tensor | None) -> torch.Tensor:
    """The slopes in log2 units as the kernels read them (a placeholder pointer without ALiBi)."""
    if slopes is None:
        return query  # never read: HAS_ALIBI is off
    if slopes.shape != (query.shape[1],):
        raise ValueError(f"alibi_slopes must be [num_heads] = [{query.shape[1]}], got {tuple(slopes.shape)}")
    return (slopes.to(device=query.device, dtype=torch.float32) * _LOG2E).contiguous()


def _dot_f32(query: torch.Tensor) -> bool:
    # Triton's interpreter computes bfloat16 dots wrongly (3.9); there the operands are widened
    # after the same bfloat16 rounding the GPU applies, so the numerics stay those of the GPU path.
    return query.dtype == torch.bfloat16 and not query.is_cuda


# At most this many splits per sequence: the merge then reads a [32, head_dim] float32 tile per
# head, and a long context still gets 32-way parallelism per (sequence, head) program column.
MAX_DECODE_SPLITS = 32


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the interpreter runs one program at
    a time, so splitting buys nothing there)."""
    if device.type != "cuda":
        return 0
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def decode_num_splits(sms: int, num_seqs: int, parallel_heads: int, max_span: int, min_split: int) -> int:
    """Splits per sequence of a decode launch: enough programs for several waves per SM (a short
    last wave then costs little), no more than a `max_span`-token context fills with splits of
    `min_split` tokens, and at most MAX_DECODE_SPLITS. Depends only on the launch's shape (batch
    size and the longest context it may see, e.g. max_model_len under a CUDA graph), never on
    the contexts' real lengths: the kernels derive the tokens per split from those. Unmeasured on
    a GPU so far: a starting point to tune."""
    if sms <= 0:
        return 1
    want = -(-8 * sms // max(1, num_seqs * parallel_heads))
    fits = -(-max(1, max_span) // max(1, min_split))
    return max(1, min(want, fits, MAX_DECODE_SPLITS))


def _split_args(device: torch.device, num_seqs: int, parallel_heads: int, max_span: int, block_n: int,
                num_splits: int | None, min_split_tokens: int | None,
                default_min_split: int | None = None) -> tuple[int, int, int]:
    """(splits per sequence, smallest split in tokens, what a split's length is a multiple of:
    whole key tiles, or the smallest split where that is shorter than a tile)."""
    if min_split_tokens is not None and min_split_tokens < 1:
        raise ValueError(f"min_split_tokens must be >= 1, got {min_split_tokens!r}")
    if num_splits is not None and not 1 <= num_splits <= MAX_DECODE_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_DECODE_SPLITS}, got {num_splits!r}")
    min_split = min_split_tokens or default_min_split or 4 * block_n
    align = min(block_n, min_split)
    if num_splits is None:
        num_splits = decode_num_splits(device_sms(device), num_seqs, parallel_heads, max_span, min_split)
    return num_splits, min_split, align


def decode_config(block_d: int, elt_size: int, is_cuda: bool, measured: bool = True) -> dict:
    """Launch configuration of the decode kernel for a padded head_dim and element size: K and V
    tiles of 64 tokens, halved where a row is over 512 bytes (fp32 x 256) so that two pipeline
    stages stay well inside shared memory; splits of at least `min_split` tokens. The interpreter
    gets 32-token tiles.

    Measured on an H200 (bf16, head_dim 128, block size 16, bench/kernel_sweep.py, 2026-11-27):
    these tiles are within 1-4% of the best of 24 tile/warp/stage configurations at batch 1-64 x
    1k-4k, CUDA-graph replays. Splits of 64 tokens (not four tiles, 256) let a batch-1 decode
    spread over the GPU: at 1k context 16 splits take 6.5 us where 4 took 11.1. Only where the sweep
    measured it (`measured`: 16-bit queries on 16-bit pools, no window, soft cap or ALiBi); elsewhere
    splits of four tiles, as before the sweep."""
    if not is_cuda:
        return dict(block_n=32, num_warps=4, num_stages=2, min_split=128)
    block_n = 64 if block_d * elt_size <= 512 else 32
    min_split = 64 if measured and elt_size == 2 else 4 * block_n
    return dict(block_n=block_n, num_warps=4 if block_d <= 128 else 8, num_stages=2, min_split=min_split)


def prefill_config(block_d: int, elt_size: int, is_cuda: bool, measured: bool = True) -> dict:
    """Launch configuration of the prefill kernel for a padded head_dim and element size.

    16-bit queries up to head_dim 128: 128 x 128 tiles, 8 warps, 3 stages, the best of 33
    configurations on an H200 (bf16, head_dim 128, GQA 4, bench/kernel_sweep.py, 2026-11-27): 1.9-2.4x
    the 64 x 64 / 2-stage tiles before it, within 2% of each shape's own best; head_dim 64 takes
    them untimed (half the shared memory and registers). Larger rows keep the smaller tiles that
    fit shared memory (head_dim 256 and float32: not measured).

    The tiles and the unmasked/masked key split are used only where the sweep measured them
    (`measured`: 16-bit queries on 16-bit pools, no window, soft cap or ALiBi). Elsewhere (float8
    pools, Gemma's windows and soft caps, ALiBi, float32) the launch is the one before the sweep,
    one masked key loop. (A float32 Gemma 2 long-context divergence in a GPU run, which first
    prompted this, turned out to be the test's transformers oracle dropping the soft cap under
    SDPA; the limit stays because nothing else was measured.)"""
    if not is_cuda:  # interpreter: fewer, larger numpy ops are what make it fast
        return dict(block_m=32, block_n=32, num_warps=4, num_stages=2, causal_split=True)
    if measured and elt_size == 2 and block_d <= 128:
        return dict(block_m=128, block_n=128, num_warps=8, num_stages=3, causal_split=True)
    row_bytes = block_d * elt_size
    block_m, block_n = (64, 64) if row_bytes <= 256 else (64, 32) if row_bytes <= 512 else (32, 32)
    return dict(block_m=block_m, block_n=block_n, num_warps=4 if block_d <= 64 else 8, num_stages=2,
                causal_split=measured and elt_size == 2)


def _checked_config(default: dict, override: dict) -> dict:
    unknown = set(override) - set(default)
    if unknown:
        raise ValueError(f"unknown launch configuration keys {sorted(unknown)}; known: {sorted(default)}")
    return {**default, **override}


def paged_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]; at most one row per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]; every query length is 0 or 1
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    scale: float,
    max_seq_len: int | None = None,  # the longest context this launch may see (sizes the split count)
    num_splits: int | None = None,  # splits per sequence (None: decode_num_splits)
    min_split_tokens: int | None = None,  # the smallest split (None: decode_config's min_split)
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,  # float8 pools: stored = value / scale (None: 1)
    v_scale: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads] (None: no ALiBi)
    _config: dict | None = None,  # launch configuration overrides, for bench/kernel_sweep.py only
) -> torch.Tensor:
    query = _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    _check_options(sliding_window, logits_soft_cap)
    kv_fp8, k_scale, v_scale = _kv_scales(query, k_cache, k_scale, v_scale)
    alibi = _alibi_arg(query, alibi_slopes)
    tokens, heads, dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if tokens == 0 or num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    # The longest span one query reads: the splits cut that, not the whole context.
    span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    block_d = max(16, next_pow2(dim))
    measured = not kv_fp8 and sliding_window is None and logits_soft_cap is None and alibi_slopes is None
    cfg = decode_config(block_d, query.element_size(), query.is_cuda, measured)
    if _config:
        cfg = _checked_config(cfg, _config)
    block_n = cfg["block_n"]
    num_splits, min_split, align = _split_args(query.device, num_seqs, kv_heads, span, block_n, num_splits,
                                               min_split_tokens, cfg["min_split"])
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out  # unused by the DIRECT variant
        mid_strides = (0, 0, 0, 0, 0)
    else:
        mid_o = torch.empty((num_seqs, heads, num_splits, dim), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((num_seqs, heads, num_splits), dtype=torch.float32, device=query.device)
        mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    kernel_for(_decode_kernel, query.device)[(num_seqs, kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, mid_o, mid_lse,
        k_scale, v_scale, alibi, scale * _LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *mid_strides,
        group, dim, num_splits, min_split, align, sliding_window or 0, (logits_soft_cap or 0.0) * _LOG2E,
        BLOCK_SIZE=block_size, BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DIRECT=direct, DOT_PREC=dot_precision(query.dtype), DOT_F32=_dot_f32(query),
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None, KV_FP8=kv_fp8,
        HAS_ALIBI=alibi_slopes is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if not direct:
        kernel_for(_merge_kernel, query.device)[(num_seqs, heads)](
            mid_o, mid_lse, query_start_loc, seq_lens, out,
            *mid_strides,
            out.stride(0), out.stride(1),
            num_splits, min_split, align, sliding_window or 0, dim,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(dim),
            HAS_WINDOW=sliding_window is not None, num_warps=4,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], packed by query_start_loc
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,  # float8 pools: stored = value / scale (None: 1)
    v_scale: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads] (None: no ALiBi)
    _config: dict | None = None,  # launch configuration overrides, for bench/kernel_sweep.py only
) -> torch.Tensor:
    query = _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    _check_options(sliding_window, logits_soft_cap)
    kv_fp8, k_scale, v_scale = _kv_scales(query, k_cache, k_scale, v_scale)
    alibi = _alibi_arg(query, alibi_slopes)
    tokens, heads, dim = query.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    block_d = max(16, next_pow2(dim))
    measured = not kv_fp8 and sliding_window is None and logits_soft_cap is None and alibi_slopes is None
    cfg = prefill_config(block_d, query.element_size(), query.is_cuda, measured)
    if _config:
        cfg = _checked_config(cfg, _config)
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    tiles = triton.cdiv(max_query_len * group, block_m)
    kernel_for(_prefill_kernel, query.device)[(tiles, kv_heads, num_seqs)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, k_scale, v_scale, alibi,
        scale * _LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        group, dim, sliding_window or 0, (logits_soft_cap or 0.0) * _LOG2E,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PREC=dot_precision(query.dtype), DOT_F32=_dot_f32(query),
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None, KV_FP8=kv_fp8,
        HAS_ALIBI=alibi_slopes is not None, CAUSAL_SPLIT=cfg["causal_split"], EVEN_D=block_d == dim,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
