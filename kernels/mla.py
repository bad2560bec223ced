"""Triton decode attention for multi-head latent attention (DeepSeek V2/V3), absorbed form.

The cache holds one latent per token, ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]``:
the normalized KV latent c followed by the rotated key k_pe. Queries arrive already absorbed,
``[num_tokens, num_heads, kv_lora_rank + rope_dim]`` (q_nope W_UK, then q_pe), so for every head

    score_j = q . latent_j            (both parts, one dot product)
    out     = sum_j softmax(score)_j c_j   ([kv_lora_rank], in latent space)

which is an MQA with one very wide "KV head" whose values are the first kv_lora_rank entries of
the keys. A program owns one sequence, BLOCK_H heads and a split of its context, and loads each
token tile of latents once, using it both as K (c and k_pe against q) and as V (c again): no V
pool exists and no latent is read twice. Online softmax in float32 with exp2; splits of a long
context are merged by the standard attention kernels' merge kernel (flash decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.attention import _LOG2E, _merge_kernel, _split_args
from kvserve.kernels.triton_utils import dot_precision, kernel_for, next_pow2


@triton.jit
def _mla_decode_kernel(
    Q, KV, BT, SEQ_LENS, QSL, OUT, MID_O, MID_LSE,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks,
    stride_bt,
    stride_ot, stride_oh,
    stride_ms, stride_mh, stride_mp,
    stride_ls, stride_lh,
    NUM_HEADS, num_splits, min_split, align,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(QSL + seq).to(tl.int64)
    q_len = tl.load(QSL + seq + 1) - q_row
    seq_len = tl.where(q_len > 0, tl.load(SEQ_LENS + seq), 0)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = heads < tl.where(q_len > 0, NUM_HEADS, 0)
    lat = tl.arange(0, BLOCK_L)
    lat_ok = lat < KV_LORA
    rope = tl.arange(0, BLOCK_R)
    rope_ok = rope < ROPE
    q_base = Q + q_row * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_base + lat[None, :], mask=row_ok[:, None] & lat_ok[None, :], other=0.0)  # [H, L]
    q_r = tl.load(q_base + KV_LORA + rope[None, :], mask=row_ok[:, None] & rope_ok[None, :], other=0.0)  # [H, R]

    # Tokens per split from this sequence's real length (the merge kernel's formula).
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), align) * align, min_split)
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row = BT + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        base = KV + blk * stride_kb + off * stride_ks
        c = tl.load(base[:, None] + lat[None, :], mask=n_ok[:, None] & lat_ok[None, :], other=0.0)  # [N, L]
        k_r = tl.load(base[None, :] + KV_LORA + rope[:, None], mask=n_ok[None, :] & rope_ok[:, None],
                      other=0.0)  # [R, N]
        c_t = tl.trans(c)  # [L, N]: the same tile as keys
        if DOT_F32:
            s = (tl.dot(q_c.to(tl.float32), c_t.to(tl.float32), input_precision=DOT_PREC)
                 + tl.dot(q_r.to(tl.float32), k_r.to(tl.float32), input_precision=DOT_PREC))
        else:
            s = tl.dot(q_c, c_t, input_precision=DOT_PREC) + tl.dot(q_r, k_r, input_precision=DOT_PREC)
        s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, c.to(tl.float32), input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if DIRECT:
        tl.store(OUT + q_row * stride_ot + heads[:, None] * stride_oh + lat[None, :],
                 o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & lat_ok[None, :])
    else:
        # A split past the sequence's end stores nothing; the merge reads only splits with tokens.
        live = heads < tl.where(start < seq_len, NUM_HEADS, 0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(MID_O + seq * stride_ms + heads[:, None] * stride_mh + split * stride_mp + lat[None, :],
                 o, mask=live[:, None] & lat_ok[None, :])
        tl.store(MID_LSE + seq * stride_ls + heads * stride_lh + split, lse, mask=live)


def mla_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + rope_dim]: absorbed queries
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]; every query length is 0 or 1
    seq_lens: torch.Tensor,  # int32 [num_seqs]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    scale: float,
    kv_lora_rank: int,
    max_seq_len: int | None = None,  # the longest context this launch may see (sizes the split count)
    num_splits: int | None = None,  # splits per sequence (None: kernels.attention.decode_num_splits)
    min_split_tokens: int | None = None,  # the smallest split (None: four key tiles)
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
    if query.dim() != 3 or kv_cache.dim() != 4 or kv_cache.shape[2] != 1:
        raise ValueError(f"query must be [tokens, heads, dim] and kv_cache [blocks, block_size, 1, dim], got "
                         f"{tuple(query.shape)} and {tuple(kv_cache.shape)}")
    tokens, heads, dim = query.shape
    if kv_cache.shape[3] != dim or not 0 < kv_lora_rank < dim:
        raise ValueError(f"kv_cache latent dim {kv_cache.shape[3]} and kv_lora_rank {kv_lora_rank} do not fit "
                         f"query dim {dim}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dimension")
    query = query if query.stride(-1) == 1 else query.contiguous()
    rope = dim - kv_lora_rank
    num_seqs = seq_lens.shape[0]
    out = torch.empty(tokens, heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    if tokens == 0 or num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    # 16 heads per program: tl.dot's minimum rows, and a [16, kv_lora_rank] float32 accumulator
    # (32 KiB at DeepSeek's 512) stays in registers. Unmeasured on a GPU so far.
    block_h = 16
    head_blocks = triton.cdiv(heads, block_h)
    block_n = 32
    num_splits, min_split, align = _split_args(query.device, num_seqs, head_blocks, max_seq_len, block_n, num_splits,
                                        min_split_tokens)
    direct = num_splits == 1
    if direct:
        mid_o = mid_lse = out
        mid_strides = (0, 0, 0, 0, 0)
    else:
        mid_o = torch.empty((num_seqs, heads, num_splits, kv_lora_rank), dtype=torch.float32, device=query.device)
        mid_lse = torch.empty((num_seqs, heads, num_splits), dtype=torch.float32, device=query.device)
        mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    kernel_for(_mla_decode_kernel, query.device)[(num_seqs, head_blocks, num_splits)](
        query, kv_cache, block_tables, seq_lens, query_start_loc, out, mid_o, mid_lse,
        scale * _LOG2E,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *mid_strides,
        heads, num_splits, min_split, align,
        KV_LORA=kv_lora_rank, ROPE=rope, BLOCK_SIZE=kv_cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_L=next_pow2(kv_lora_rank), BLOCK_R=max(16, next_pow2(rope)),
        DIRECT=direct, DOT_PREC=dot_precision(query.dtype),
        DOT_F32=query.dtype == torch.bfloat16 and not query.is_cuda,
        num_warps=4 if kv_lora_rank <= 128 else 8, num_stages=2,
    )
    if not direct:
        kernel_for(_merge_kernel, query.device)[(num_seqs, heads)](
            mid_o, mid_lse, query_start_loc, seq_lens, out,
            *mid_strides,
            out.stride(0), out.stride(1),
            num_splits, min_split, align, 0, kv_lora_rank,
            BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(kv_lora_rank),
            HAS_WINDOW=False, num_warps=4,
        )
    return out
