"""Batched LoRA: the segmented-gather shrink and expand of Punica's SGMV / S-LoRA.

A step's adapter tokens are grouped in segments of one adapter slot each (runtime/lora/slots.py:
`token_idx` lists the tokens segment after segment, `seg_start` / `seg_len` / `seg_slot` describe
the segments). Two launches cover every adapter of the step:

  1. shrink: one program per (segment, BLOCK_M tokens) gathers its token rows of x [T, in] and
     multiplies them by its slot's A^T [in, C] (C = parts x rank, padded) -> s [num_tokens, C];
  2. expand: one program per (segment, BLOCK_M tokens, BLOCK_N outputs) multiplies its rows of s
     by its slot's B^T [C, out] and adds the product into out's token rows (each token is in one
     segment, so the read-add-write needs no atomics).

Tokens of the base model are in no segment and cost nothing. The torch twin
(reference.lora_sgmv_ref) is the oracle and the CPU path; on CPU tensors this runs only under
TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_utils import dot_precision, kernel_for, next_pow2


@triton.jit
def _shrink_kernel(X, A, S, TOKENS, SEG_START, SEG_LEN, SEG_SLOT, K, C,
                   stride_xm, stride_xk, stride_al, stride_ak, stride_ac, stride_sm, stride_sc,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    start = tl.load(SEG_START + seg)
    length = tl.load(SEG_LEN + seg)
    slot = tl.load(SEG_SLOT + seg).to(tl.int64)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < length
    rows = tl.load(TOKENS + start + m, mask=m_ok, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(A + slot * stride_al + k[:, None] * stride_ak + c[None, :] * stride_ac,
                    mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision=DOT_PREC)
    tl.store(S + (start + m)[:, None] * stride_sm + c[None, :] * stride_sc, acc,
             mask=m_ok[:, None] & c_ok[None, :])


@triton.jit
def _expand_kernel(S, B, OUT, TOKENS, SEG_START, SEG_LEN, SEG_SLOT, C, N,
                   stride_sm, stride_sc, stride_bl, stride_bc, stride_bn, stride_om, stride_on,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(SEG_START + seg)
    length = tl.load(SEG_LEN + seg)
    slot = tl.load(SEG_SLOT + seg).to(tl.int64)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < length
    rows = tl.load(TOKENS + start + m, mask=m_ok, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    s = tl.load(S + (start + m)[:, None] * stride_sm + c[None, :] * stride_sc,
                mask=m_ok[:, None] & c_ok[None, :], other=0.0)
    b = tl.load(B + slot * stride_bl + c[:, None] * stride_bc + n[None, :] * stride_bn,
                mask=c_ok[:, None] & n_ok[None, :], other=0.0)
    delta = tl.dot(s, b.to(tl.float32), input_precision=DOT_PREC)
    mask = m_ok[:, None] & n_ok[None, :]
    ptrs = OUT + rows[:, None] * stride_om + n[None, :] * stride_on
    old = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (old.to(tl.float32) + delta).to(OUT.dtype.element_ty), mask=mask)


def lora_sgmv(x: torch.Tensor, out: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, token_idx: torch.Tensor,
              seg_slot: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor, max_seg_len: int) -> torch.Tensor:
    """out[t] += x[t] @ a_t[slot] @ b_t[slot] for every token of every segment (in place).

    x [T, in]; out [T, n]; a_t [L, in, C]; b_t [L, C, n]; token_idx [num_tokens] (token rows,
    segment after segment); seg_* [num_segments] int32; max_seg_len the longest segment."""
    num_segments = seg_slot.shape[0]
    num_tokens = token_idx.shape[0]
    if num_segments == 0 or num_tokens == 0:
        return out
    k, c = a_t.shape[1], a_t.shape[2]
    n = b_t.shape[2]
    if a_t.shape[0] != b_t.shape[0] or b_t.shape[1] != c or x.shape[1] != k or out.shape[1] != n:
        raise ValueError(f"lora_sgmv: a_t {tuple(a_t.shape)}, b_t {tuple(b_t.shape)} do not fit "
                         f"x {tuple(x.shape)} -> out {tuple(out.shape)}")
    block_m, block_c = 16, max(16, next_pow2(c))
    block_k = 64 if not x.is_cuda else 32
    block_n = 64
    s = torch.empty(num_tokens, c, dtype=torch.float32, device=x.device)
    prec = dot_precision(torch.float32) if x.dtype == torch.float32 else dot_precision(x.dtype)
    grid_m = triton.cdiv(max_seg_len, block_m)
    kernel_for(_shrink_kernel, x.device)[(num_segments, grid_m)](
        x, a_t, s, token_idx, seg_start, seg_len, seg_slot, k, c,
        x.stride(0), x.stride(1), a_t.stride(0), a_t.stride(1), a_t.stride(2), s.stride(0), s.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_C=block_c, DOT_PREC=prec)
    kernel_for(_expand_kernel, x.device)[(num_segments, grid_m, triton.cdiv(n, block_n))](
        s, b_t, out, token_idx, seg_start, seg_len, seg_slot, c, n,
        s.stride(0), s.stride(1), b_t.stride(0), b_t.stride(1), b_t.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_C=block_c, DOT_PREC=prec)
    return out
