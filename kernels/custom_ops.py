"""The Triton attention and cache launchers as torch custom ops (``torch.ops.kvserve.*``), for
code that torch.compile traces.

A launcher does host-side arithmetic on its arguments (grid sizes, the decode split count from
the batch size and the longest context) before it launches. Traced by dynamo, every such integer
becomes a guard: at ``-O3`` with ``dynamic=True`` the model specialised on the split count of
each CUDA-graph bucket, about a dozen values, and past dynamo's recompile limit (8) it silently
ran eagerly. As custom ops the launchers are opaque to the tracer: it sees one call with tensor
arguments and plain integers (which may stay symbolic), guards on none of what happens inside,
and never tries to trace the interpreter's or Triton's launch machinery.

Eager callers go through ``decode_attention`` & co., which call the launcher directly (no
dispatcher overhead) unless torch.compile is tracing.
"""

from __future__ import annotations

import torch

from kvserve.kernels.attention import paged_decode_attention, paged_prefill_attention
from kvserve.kernels.cache import write_kv_cache
from kvserve.kernels.mla import mla_decode_attention


@torch.library.custom_op("kvserve::paged_decode_attention", mutates_args=())
def _decode_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_seq_len: int,
               sliding_window: int | None, logits_soft_cap: float | None, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    return paged_decode_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                  max_seq_len=max_seq_len, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                                  alibi_slopes=alibi_slopes)


@_decode_op.register_fake
def _(query, *args):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("kvserve::paged_prefill_attention", mutates_args=())
def _prefill_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_query_len: int,
                sliding_window: int | None, logits_soft_cap: float | None, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    return paged_prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                   max_query_len=max_query_len, sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                                   alibi_slopes=alibi_slopes)


@_prefill_op.register_fake
def _(query, *args):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("kvserve::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_write_kv_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("kvserve::write_latent_cache", mutates_args=("cache",))
def _write_latent_op(entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # The scatter kernel writes a K and a V pool; MLA's one latent pool is both.
    latent = entry[:, None, :]
    write_kv_cache(latent, latent, cache, cache, slot_mapping)


@_write_latent_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("kvserve::mla_decode_attention", mutates_args=())
def _mla_decode_op(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, kv_lora_rank: int,
                   max_seq_len: int) -> torch.Tensor:
    return mla_decode_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, kv_lora_rank,
                                max_seq_len=max_seq_len)


@_mla_decode_op.register_fake
def _(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, kv_lora_rank, max_seq_len):
    return query.new_empty(query.shape[0], query.shape[1], kv_lora_rank)


def decode_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, *, max_seq_len,
                     sliding_window=None, logits_soft_cap=None, k_scale=None, v_scale=None,
                     alibi_slopes=None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.kvserve.paged_decode_attention(query, k_cache, v_cache, query_start_loc, seq_lens,
                                                        block_tables, scale, max_seq_len, sliding_window,
                                                        logits_soft_cap, k_scale, v_scale, alibi_slopes)
    return paged_decode_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                  max_seq_len=max_seq_len, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                                  alibi_slopes=alibi_slopes)


def prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, *, max_query_len,
                      sliding_window=None, logits_soft_cap=None, k_scale=None, v_scale=None,
                      alibi_slopes=None) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.kvserve.paged_prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens,
                                                         block_tables, scale, max_query_len, sliding_window,
                                                         logits_soft_cap, k_scale, v_scale, alibi_slopes)
    return paged_prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                                   max_query_len=max_query_len, sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
                                   alibi_slopes=alibi_slopes)


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    if torch.compiler.is_compiling():
        torch.ops.kvserve.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def write_latent(entry, cache, slot_mapping) -> None:
    if torch.compiler.is_compiling():
        torch.ops.kvserve.write_latent_cache(entry, cache, slot_mapping)
    else:
        latent = entry[:, None, :]
        write_kv_cache(latent, latent, cache, cache, slot_mapping)


def mla_decode(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, kv_lora_rank, *,
               max_seq_len) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.kvserve.mla_decode_attention(query, kv_cache, query_start_loc, seq_lens, block_tables,
                                                      scale, kv_lora_rank, max_seq_len)
    return mla_decode_attention(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, kv_lora_rank,
                                max_seq_len=max_seq_len)
