"""Pure-torch twins of every kernel: the CPU path of the runtime and the oracle of the kernel tests.

The layer twins follow Hugging Face's numerics exactly (norms in float32 and cast back before the
weight multiply, rotary in the activation dtype), because the model parity tests compare the
torch path with transformers token for token. The attention twins favour clarity: they gather a
sequence's K/V through its block table and compute a causal softmax in float32.
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------- layers


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scales by (1 + weight), everything in float32, one rounding at the end."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.to(torch.float32))).to(x.dtype)


def gemma_fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return gemma_rms_norm_ref(summed, weight, eps), summed


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype):
    """cos and sin, each [num_tokens, 1, rotary_dim // 2], for the tokens' positions."""
    return cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), one half at a time: the same
    # products and sums (a + (-b) * c is exactly a - b * c), without building the concatenations.
    half = cos.shape[-1]
    rotary_dim = 2 * half
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:rotary_dim]).add_(x1 * sin)
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out


def rotary_ref(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    return _rotate(x, *_cos_sin(positions, cos_sin_cache, x.dtype))


def rotary_embedding_ref(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if query.dtype != key.dtype:
        return rotary_ref(positions, query, cos_sin_cache), rotary_ref(positions, key, cos_sin_cache)
    cos, sin = _cos_sin(positions, cos_sin_cache, query.dtype)  # once for both
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    # In place into silu's fresh output: a prefill-sized product skips a page-faulting allocation.
    return torch.nn.functional.silu(gate).mul_(up)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for x = [gate | up] (Gemma's gelu_pytorch_tanh MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh").mul_(up)


def soft_cap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype, as transformers caps Gemma 2's final logits."""
    return torch.tanh(x / cap) * cap


# ------------------------------------------------------------------------------------- KV cache


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a KV pool stores float8 (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2)."""
    return cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x / scale as float8 `dtype`, saturated at the format's largest finite value (e4m3fn has no
    infinity: an unclamped overflow would be NaN; e5m2 would be inf). scale None means 1."""
    x = x.float()
    if scale is not None:
        # On x's device, IEEE-rounded like the kernel: CUDA divides by a CPU 0-dim scale through its
        # rounded reciprocal.
        x = x / scale.float().to(x.device)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes key/value row i to flat cache slot slot_mapping[i] (block * block_size + offset);
    into a float8 pool as row / scale (`quantize_kv_ref`)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_blocks, block_size, heads, dim = k_cache.shape
    if is_fp8(k_cache):
        key = quantize_kv_ref(key, k_scale, k_cache.dtype)
        value = quantize_kv_ref(value, v_scale, v_cache.dtype)
    k_cache.view(num_blocks * block_size, heads, dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, heads, dim)[slots] = value[keep].to(v_cache.dtype)


# ------------------------------------------------------------------------------------ attention


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's cached rows [seq_len, num_kv_heads, head_dim] in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context (float32 math).
    float8 pools are dequantized with `k_scale` / `v_scale` (None: 1) before anything else.

    Covers decode (one new token), prefill, chunked prefill and cached prefixes alike: query token
    j of sequence i sits at position seq_lens[i] - query_len_i + j. With `sliding_window` w it
    sees positions p - w < j <= p only; with `logits_soft_cap` c each score s becomes c tanh(s / c);
    with `alibi_slopes` (ALiBi) slope_h * (j - p) is then added to each score.
    Blocks wholly behind every window are never read (they may have been freed).
    """
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        q = query[q_lo:q_hi].float().transpose(0, 1)  # [H, q, D]
        lo = 0  # the first position any of these queries can see; nothing before it is read
        if sliding_window is not None:
            lo = max(0, seq_len - (q_hi - q_lo) - sliding_window + 1)
        first = lo // k_cache.shape[1]
        skip = lo - first * k_cache.shape[1]
        table = block_tables[i][first:]
        k = gather_kv(k_cache, table, seq_len - lo + skip)[skip:].float()
        v = gather_kv(v_cache, table, seq_len - lo + skip)[skip:].float()
        if is_fp8(k_cache):
            k = k * k_scale if k_scale is not None else k
            v = v * v_scale if v_scale is not None else v
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.permute(1, 2, 0)) * scale  # [H, q, seq_len - lo]
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        positions = torch.arange(seq_len - (q_hi - q_lo), seq_len, device=query.device)
        keys = torch.arange(lo, seq_len, device=query.device)[None, :]
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float().view(-1, 1, 1) * (keys - positions[:, None]).float()
        visible = keys <= positions[:, None]
        if sliding_window is not None:
            visible &= keys > positions[:, None] - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.softmax(-1)
        out[q_lo:q_hi] = (probs @ v.transpose(0, 1)).transpose(0, 1).to(query.dtype)
    return out


# ------------------------------------------------------------------------- mixture of experts


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]: float32 or x's dtype; the product takes its dtype
    topk_ids: torch.Tensor,  # int [T, k]
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j].

    The (token, choice) pairs are sorted by expert and each expert runs once over its tokens, in
    ascending expert order, accumulating with index_add: transformers' expert loop, product for
    product, so the CPU path matches it bit for bit in float32.
    """
    t, k = topk_ids.shape
    out = torch.zeros_like(x)
    if t == 0:
        return out
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // k
        gate, up = torch.nn.functional.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, (y * weights[pairs, None]).to(out.dtype))
    return out


# ------------------------------------------------------------------ multi-head latent attention


def mla_decode_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + rope_dim]: absorbed queries
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]; query lengths 0 or 1
    seq_lens: torch.Tensor,  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Each sequence's query heads over its cached latents, float32 math: scores against the whole
    latent (c and k_pe), output the softmax-weighted c's: [num_tokens, num_heads, kv_lora_rank]."""
    out = torch.zeros(query.shape[0], query.shape[1], kv_lora_rank, dtype=query.dtype, device=query.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        if starts[i + 1] == starts[i]:
            continue
        latents = gather_kv(kv_cache, block_tables[i], seq_len)[:, 0].float()  # [S, L + R]
        q = query[starts[i]].float()  # [H, L + R]
        probs = ((q @ latents.T) * scale).softmax(-1)
        out[starts[i]] = (probs @ latents[:, :kv_lora_rank]).to(query.dtype)
    return out


# A direct segment at least this long expands per fused part (lora_sgmv_ref's out_parts).
LORA_PARTS_MIN_ROWS = 16


def lora_sgmv_ref(x: torch.Tensor, out: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                  segments: list[tuple[int, int, int]], perm: torch.Tensor | None,
                  cols: list[int] | None = None, padded: tuple[torch.Tensor, torch.Tensor] | None = None,
                  out_parts: list[tuple[int, int]] | None = None) -> torch.Tensor:
    """Adds each adapter segment's LoRA product to `out` in place: out[t] += x[t] @ a_t[s] @ b_t[s]
    for the tokens t of segment (s, start, end). a_t [L, in, C] / b_t [L, C, out] are the slots'
    stacked matrices (B already scaled); `cols[s]` the columns slot s uses (the rest are zeros).

    Segments index x itself when `perm` is None (each adapter's tokens contiguous: two matmuls
    per segment, no copy), else the rows gathered in `perm` order (Punica's segmented gather:
    one gather, two matmuls per adapter, one scatter-add).

    `padded` (gather [L, M], scatter [L * M]): every slot's tokens in a row of M (padding gathers
    the zero row x[T] and scatters its zero product onto row 0), so all adapters take two batched
    matmuls over the whole slot stack: five ops per layer whatever the adapter count, for steps
    of many short segments (decode).

    `out_parts` ((start, end) output columns per part of a fused layer, whose B is block-diagonal:
    part p's rows p*r .. (p+1)*r with r = cols[s] / parts): a long direct segment (prefill) expands
    each part on its own diagonal block, skipping the zero blocks (a third of q|k|v's expand
    work, half of gate|up's); short ones keep the one matmul (fewer ops)."""
    if padded is not None:
        gather, scatter = padded
        xs = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, gather.view(-1))
        delta = torch.bmm(torch.bmm(xs.view(*gather.shape, -1), a_t), b_t)
        return out.index_add_(0, scatter, delta.view(-1, out.shape[1]))
    if perm is None:
        for slot, start, end in segments:
            c = a_t.shape[2] if cols is None else cols[slot]
            if out_parts is None or len(out_parts) == 1 or end - start < LORA_PARTS_MIN_ROWS:
                out[start:end].addmm_(x[start:end] @ a_t[slot, :, :c], b_t[slot, :c])
                continue
            shrunk = x[start:end] @ a_t[slot, :, :c]
            r = c // len(out_parts)
            for p, (lo, hi) in enumerate(out_parts):
                out[start:end, lo:hi].addmm_(shrunk[:, p * r:(p + 1) * r], b_t[slot, p * r:(p + 1) * r, lo:hi])
        return out
    xs = x.index_select(0, perm)
    delta = torch.empty(xs.shape[0], out.shape[1], dtype=out.dtype, device=out.device)
    for slot, start, end in segments:
        c = a_t.shape[2] if cols is None else cols[slot]
        torch.mm(xs[start:end] @ a_t[slot, :, :c], b_t[slot, :c], out=delta[start:end])
    return out.index_add_(0, perm, delta)
