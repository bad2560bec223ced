"""MLA on the Triton path: the absorbed decode over the latent cache runs the Triton kernel
(kernels.mla) and the cache write the Triton scatter (kernels.cache: it skips slot -1 on the
device, where the torch write's mask would read back to the host, which a CUDA graph capture
cannot do); the up-projected prefill is the torch implementation's (SDPA runs on CUDA as it is)."""

from __future__ import annotations

import torch

from kvserve.kernels.custom_ops import mla_decode, write_latent
from kvserve.runtime.attention.mla import MLAPlan, TorchMLAAttention


class TritonMLAAttention(TorchMLAAttention):
    name = "triton"

    @staticmethod
    def write_latent(entry: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_latent(entry, cache, slot_mapping)

    def decode(self, q: torch.Tensor, cache: torch.Tensor, plan: MLAPlan, kv_lora_rank: int,
               scale: float) -> torch.Tensor:
        meta = plan.decode_meta
        assert meta is not None
        return mla_decode(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                                    kv_lora_rank, max_seq_len=meta.max_seq_len)
