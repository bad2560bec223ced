"""Uniform short queries (speculative verification: q = 1 + k rows per sequence) through the
decode kernel's split-K path.

Each of a sequence's q rows is causal attention over its own prefix: row j (0-based) of a
sequence with context length L sees keys 0 .. L - q + j. That is exactly a decode query of a
sequence of length L - q + j + 1 over the same block table. So the step is launched as s x q
decode "rows", each with its own length, block-table row and query row, and the decode kernel
splits each row's keys over the GPU (split-K plus merge) with the GQA group packed per program,
as it does for decode.

Why not the varlen prefill kernel: it holds one program per (query tile, KV head, sequence) and
walks the whole context serially, with BLOCK_M-row tiles of which a 5-token, group-4 query fills
20. Its float32 configuration (64 x 64 tiles, 'ieee' dots on CUDA cores) spills: compiled for
sm_90 it has a 10.7 KB stack frame and ~20 KB of spill stores per thread, where the decode kernel
has 224 bytes. docs/benchmarks.md ("Why a verification replay can cost 16 decodes") has the
analysis. Keys are read q times instead of once (mostly from L2 at these sizes); for short q that
is cheaper than serial tiles.

The expansion is a few device ops on shapes known on the host (s and q from the step's shapes),
so a CUDA graph captures it and nothing is read back.
"""

from __future__ import annotations

import torch

# Queries up to this many rows per sequence take this path (a verification step's 1 + k rows);
# longer ones are prefills and take the prefill kernel.
SHORT_QUERY_MAX_ROWS = 16


def uniform_query_len(num_tokens: int, num_seqs: int, max_query_len: int) -> int | None:
    """q when each of num_seqs sequences has exactly q > 1 rows, else None. Read from shapes only
    (no device read): every query is at most max_query_len rows, so the total reaches
    num_seqs x max_query_len only when each one does."""
    if num_seqs < 1 or max_query_len < 2 or num_tokens != num_seqs * max_query_len:
        return None
    return max_query_len


def uniform_short_query_len(num_tokens: int, num_seqs: int, max_query_len: int) -> int | None:
    """uniform_query_len, when it is at most SHORT_QUERY_MAX_ROWS."""
    q = uniform_query_len(num_tokens, num_seqs, max_query_len)
    return q if q is not None and q <= SHORT_QUERY_MAX_ROWS else None


def expand_short_queries(seq_lens: torch.Tensor, block_tables: torch.Tensor, q: int):
    """(query_start_loc, seq_lens, block_tables) of the s x q decode rows that stand for s uniform
    queries of q rows: row j of sequence i has length seq_lens[i] - q + 1 + j and i's block table."""
    s = seq_lens.shape[0]
    dev = seq_lens.device
    j = torch.arange(q, dtype=seq_lens.dtype, device=dev)
    row_lens = (seq_lens[:, None] - (q - 1) + j[None, :]).reshape(s * q)
    row_tables = block_tables.repeat_interleave(q, dim=0)
    qsl = torch.arange(s * q + 1, dtype=torch.int32, device=dev)
    return qsl, row_lens, row_tables
