"""MLA on the Triton path: the absorbed decode over the latent cache runs the Triton kernel
(kernels.mla); the cache write and the up-projected prefill are the torch implementation's
(index_copy and SDPA run on CUDA as they are)."""

from __future__ import annotations

import torch

from kvserve.kernels.mla import mla_decode_attention
from kvserve.runtime.attention.mla import MLAPlan, TorchMLAAttention


class TritonMLAAttention(TorchMLAAttention):
    name = "triton"

    def decode(self, q: torch.Tensor, cache: torch.Tensor, plan: MLAPlan, kv_lora_rank: int,
               scale: float) -> torch.Tensor:
        meta = plan.decode_meta
        assert meta is not None
        return mla_decode_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                                    kv_lora_rank, max_seq_len=meta.max_seq_len)
