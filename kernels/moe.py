"""Fused mixture-of-experts: tokens sorted by expert, then two grouped GEMMs.

Each token picks top_k experts, so the layer computes T * top_k (token, expert) pairs. The pairs
are sorted by expert and each expert's run padded to a multiple of BLOCK_M (`align_by_expert`),
so that every BLOCK_M-row tile of the sorted order belongs to one expert. A grouped GEMM then
launches one program per (tile, BLOCK_N output columns): it reads its expert id, gathers its
tile's rows of the input by pair id, and multiplies them by that expert's weight slice, so all
experts run in one launch with no per-expert Python loop and no gathered copy of the input.

  1. x [T, H] (row = pair // top_k)  @ w13[e]^T [H, 2I]  ->  inter [T * top_k, 2I]
  2. silu(gate) * up                                       ->  act   [T * top_k, I]
  3. act [T * top_k, I] (row = pair)  @ w2[e]^T  [I, H]    ->  out   [T * top_k, H], times the
     pair's routing weight
  4. out summed over each token's top_k pairs              ->        [T, H]

Tiles past the last expert's padded run carry expert id -1 and return at once; padding rows of a
tile carry the pair id T * top_k and are masked. The torch twin (reference.fused_moe_ref) is the
oracle and the CPU path; on CPU tensors this runs only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_utils import dot_precision, kernel_for


@triton.jit
def _grouped_gemm_kernel(
    A, B, C, WEIGHTS, SORTED_IDS, EXPERT_IDS,
    num_pairs, N, K, a_row_div,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(EXPERT_IDS + tile).to(tl.int64)
    if expert >= 0:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(SORTED_IDS + rows).to(tl.int64)
        row_ok = pairs < num_pairs
        a_rows = pairs // a_row_div
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(A + a_rows[:, None] * stride_am + k[None, :] * stride_ak,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(B + expert * stride_be + n[None, :] * stride_bn + k[:, None] * stride_bk,
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [K, N]: w[e]^T
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PREC)
            else:
                acc += tl.dot(a, b, input_precision=DOT_PREC)
        if MUL_WEIGHT:
            w = tl.load(WEIGHTS + pairs, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        tl.store(C + pairs[:, None] * stride_cm + n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids, expert id per BLOCK_M tile) for topk_ids [T, top_k].

    Pair p = t * top_k + j is token t's j-th choice. Sorted ids list each expert's pairs in
    order, each expert's run padded with the sentinel T * top_k to a multiple of block_m. The
    buffers are sized for the worst case (every expert one pair short of a full tile), so their
    shape depends only on T, top_k and the expert count; unused tiles have expert id -1.
    """
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    device = topk_ids.device
    # scatter_add, not bincount: bincount reads the largest id back to the host, which a CUDA
    # graph capturing this step cannot do.
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    max_tiles = (pairs + num_experts * (block_m - 1)) // block_m + 1
    sorted_ids = torch.full((max_tiles * block_m,), pairs, dtype=torch.int32, device=device)
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=device) - first_of_expert[experts_sorted]
    sorted_ids[starts[experts_sorted] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(max_tiles, device=device) * block_m
    tile_expert = torch.searchsorted(ends, tile_starts, right=True)
    expert_ids = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_ids, expert_ids


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                  expert_ids: torch.Tensor, num_pairs: int, a_row_div: int, weights: torch.Tensor | None,
                  block_m: int) -> None:
    n, k = w.shape[1], w.shape[2]
    if a.is_cuda:
        block_n, block_k, warps = 64, 64 if a.element_size() <= 2 else 32, 4
    else:  # interpreter: fewer, larger numpy ops
        block_n, block_k, warps = 64, 64, 4
    grid = (expert_ids.shape[0], triton.cdiv(n, block_n))
    kernel_for(_grouped_gemm_kernel, a.device)[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, expert_ids,
        num_pairs, n, k, a_row_div,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MUL_WEIGHT=weights is not None,
        DOT_PREC=dot_precision(a.dtype), DOT_F32=a.dtype == torch.bfloat16 and not a.is_cuda,
        num_warps=warps,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """Same contract as reference.fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights / topk_ids [T, top_k]; returns [T, H] in x's dtype."""
    t, h = x.shape
    e, two_i, h_w = w13.shape
    if h_w != h or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{t}, top_k]")
    top_k = topk_ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    # Small batches (decode) use narrow tiles: most experts then get a tile or two of real rows.
    block_m = block_m or (16 if t * top_k <= 64 * e else 64)
    sorted_ids, expert_ids = align_by_expert(topk_ids, e, block_m)
    pairs = t * top_k
    x = x if x.stride(-1) == 1 else x.contiguous()
    inter = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, inter, sorted_ids, expert_ids, pairs, top_k, None, block_m)
    from kvserve.kernels import ops

    act = ops.silu_and_mul(inter)
    out = torch.empty(pairs, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(act, w2, out, sorted_ids, expert_ids, pairs, 1, weights, block_m)
    # Summed in float32: the twin accumulates expert by expert into x's dtype, so in bfloat16 the
    # two agree to the dtype's precision, not bit for bit.
    return out.view(t, top_k, h).float().sum(dim=1).to(x.dtype)
