"""DeepSeek V2/V3's multi-head latent attention layer (the attention math: runtime.attention.mla).

Queries: hidden -> q_a_proj -> RMSNorm -> q_b_proj (or one q_proj without q_lora_rank), split per
head into a no-position part (qk_nope_head_dim) and a rotary part (qk_rope_head_dim). Keys and
values: hidden -> kv_a_proj_with_mqa -> [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]; c is
RMS-normalized, k_pe rotated (one rotary key shared by all heads), and [c | k_pe] is what the
cache keeps. kv_b_proj up-projects c to each head's K_nope and V.

Tensor parallelism splits heads (q_b_proj/q_proj and kv_b_proj by output rows, o_proj by input
columns); the low-rank down-projections are small and replicated, so every rank computes the
whole latent and keeps a full copy of the latent cache.

DeepSeek's rotary dims come in interleaved pairs (x0, x1), (x2, x3), ...; the loader permutes
the rotary rows of q and kv_a_proj_with_mqa to (x0, x2, ..., x1, x3, ...) so the usual
rotate-half rotation applies. Queries and keys are permuted alike, so every score is unchanged.

With `quantization=` the projections go through the quantization interface like any linear
layer, except kv_b_proj: decode folds its weight into the query and the output (absorption), so
it stays in the compute dtype. A pre-quantized checkpoint is refused when its rotary rows would
need the permutation (its packed tensors cannot be permuted row by row).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops
from kvserve.runtime.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.runtime.attention.mla import mla_attention_for
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models.layers import MergedColumnParallelLinear, ReplicatedWeight, RowParallelLinear
from kvserve.runtime.models.quantization import QuantizationConfig

# DeepSeek's q_a_layernorm and kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps.
_LORA_NORM_EPS = 1e-6


def _deinterleave(rope_dim: int) -> torch.Tensor:
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


def _with_rope_rows_permuted(loader, head_size: int, rope_dim: int):
    """Wraps a weight loader so that, in every head_size-row group of the checkpoint tensor, the
    last rope_dim rows go from interleaved pairs to rotate-half order."""
    perm = _deinterleave(rope_dim)

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded.shape[0]
        if rows % head_size:
            raise ValueError(f"weight: checkpoint has {rows} rows, not a multiple of {head_size}")
        heads = loaded.view(rows // head_size, head_size, *loaded.shape[1:])
        nope, rope = heads.split([head_size - rope_dim, rope_dim], dim=1)
        fixed = torch.cat((nope, rope.index_select(1, perm.to(loaded.device))), dim=1)
        loader(param, fixed.reshape(loaded.shape), shard_id)

    return load


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device, layer: int = 0,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        shape, m = cfg.shape, cfg.shape.mla
        assert m is not None
        shape.check_tp(tp_size)
        self.num_heads = shape.num_attention_heads // tp_size
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        qk = self.nope + self.rope
        h = shape.hidden_size
        dd = dict(dtype=dtype, device=device)
        pre = f"model.layers.{layer}.self_attn."
        tp = dict(tp_rank=tp_rank, tp_size=tp_size)

        def by_heads(input_size: int, per_head: int, name: str, quant) -> MergedColumnParallelLinear:
            return MergedColumnParallelLinear(
                input_size, output_sizes=[shape.num_attention_heads * per_head],
                shard_sizes=[self.num_heads * per_head], shard_starts=[tp_rank * self.num_heads * per_head],
                bias=False, part_names=[name], prefixes=[pre + name], quant_config=quant, **dd, **tp)

        def replicated(input_size: int, output_size: int, name: str) -> MergedColumnParallelLinear:
            return MergedColumnParallelLinear(
                input_size, output_sizes=[output_size], shard_sizes=[output_size], shard_starts=[0], bias=False,
                part_names=[name], prefixes=[pre + name], quant_config=quant_config, **dd, **tp)

        if m.q_lora_rank is None:
            self.q_a_proj = self.q_a_layernorm = None
            self.q_proj = by_heads(h, qk, "q_proj", quant_config)
        else:
            self.q_a_proj = replicated(h, m.q_lora_rank, "q_a_proj")
            self.q_a_layernorm = ReplicatedWeight(m.q_lora_rank, **dd)
            self.q_proj = by_heads(m.q_lora_rank, qk, "q_b_proj", quant_config)
        self.kv_a_proj_with_mqa = replicated(h, m.latent_dim, "kv_a_proj_with_mqa")
        self.kv_a_layernorm = ReplicatedWeight(m.kv_lora_rank, **dd)
        self.kv_b_proj = by_heads(m.kv_lora_rank, self.nope + self.v_dim, "kv_b_proj", None)
        self.kv_b_proj.keeps_raw_weight = True  # _absorbed() reads its rows head by head
        self.o_proj = RowParallelLinear(shape.num_attention_heads * self.v_dim, h, bias=False,
                                        prefix=pre + "o_proj", quant_config=quant_config, **dd, **tp)
        if cfg.rope_interleave:
            for proj in (self.q_proj, self.kv_a_proj_with_mqa):
                w = getattr(proj, "weight", None)
                if not isinstance(w, torch.Tensor) or w.dtype != dtype or w.dim() != 2:
                    raise ValueError(f"quantization: a checkpoint quantized as {quant_config.name!r} is not "
                                     f"supported for {cfg.architecture} (its interleaved rotary rows are "
                                     "permuted at load, which a packed format cannot be); load a full-precision "
                                     "checkpoint with quantization='int8' or 'int4'")
            self.q_proj.weight.weight_loader = _with_rope_rows_permuted(  # type: ignore[attr-defined]
                self.q_proj.weight.weight_loader, qk, self.rope)
            self.kv_a_proj_with_mqa.weight.weight_loader = _with_rope_rows_permuted(  # type: ignore[attr-defined]
                self.kv_a_proj_with_mqa.weight.weight_loader, m.latent_dim, self.rope)
        self.rope_interleave = cfg.rope_interleave
        self.scale = cfg.attention_scale()
        self.impl = mla_attention_for(backend)
        # LoRA on kv_b_proj (runtime/lora/mla.py, set when adapters are enabled): its delta is
        # added wherever the weight is used, the absorbed decode included.
        self.kv_b_lora = None

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, L] and W_UV [H, v, L]: views of kv_b_proj's rows, head by head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        if self.q_a_proj is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_proj(ops.rms_norm(self.q_a_proj(hidden), self.q_a_layernorm.weight, _LORA_NORM_EPS))
        q_nope, q_pe = q.view(t, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        c = ops.rms_norm(c.contiguous(), self.kv_a_layernorm.weight, _LORA_NORM_EPS)
        q_pe, k_pe = ops.rotary_embedding(positions, q_pe.contiguous(), k_pe.reshape(t, 1, self.rope), cos_sin)
        k_pe = k_pe.reshape(t, self.rope)
        (cache,) = kv_cache
        impl = self.impl
        impl.write_latent(torch.cat((c, k_pe), dim=-1), cache, meta.slot_mapping)
        plan = impl.plan(meta)
        out = None
        if plan.decode_meta is not None:
            every = plan.decode_meta is meta  # a pure decode step: every row, no gather
            rows = plan.decode_rows
            w_uk, w_uv = self._absorbed()
            qn, qp = (q_nope, q_pe) if every else (q_nope[rows], q_pe[rows])
            q_lat = torch.bmm(qn.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, L]
            lora = self.kv_b_lora
            groups = lora.decode_groups(rows, every) if lora is not None else []
            if groups:
                q_lat = lora.add_to_query(q_lat, qn, groups)
            o_lat = impl.decode(torch.cat((q_lat, qp), dim=-1), cache, plan, self.kv_lora_rank, self.scale)
            o = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
            if groups:
                o = lora.add_to_output(o, o_lat, groups)
            if every:
                out = o
            else:
                out = torch.empty(t, self.num_heads, self.v_dim, dtype=hidden.dtype, device=hidden.device)
                out[rows] = o
        if out is None:
            out = torch.empty(t, self.num_heads, self.v_dim, dtype=hidden.dtype, device=hidden.device)
        trees = plan.prefill_trees or [None] * len(plan.prefill)
        for (seq, q0, q1, seq_len), tree in zip(plan.prefill, trees):
            q_len = q1 - q0
            if seq_len == q_len:  # nothing cached before: the chunk's own latents are the context
                ctx_c, ctx_pe = c[q0:q1], k_pe[q0:q1]
            else:
                ctx_c, ctx_pe = impl.gather_context(cache, meta, seq, seq_len).split(
                    [self.kv_lora_rank, self.rope], dim=-1)
                ctx_c, ctx_pe = ctx_c.to(hidden.dtype), ctx_pe.to(hidden.dtype)
            kv = self.kv_b_proj(ctx_c)
            if self.kv_b_lora is not None:
                kv = self.kv_b_lora.add_to_context(kv, ctx_c, q0)
            kv = kv.view(seq_len, self.num_heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat((k_nope, ctx_pe[:, None, :].expand(seq_len, self.num_heads, self.rope)), dim=-1)
            qs = torch.cat((q_nope[q0:q1], q_pe[q0:q1]), dim=-1)
            out[q0:q1] = impl.prefill(qs, k, v, seq_len - q_len, self.scale, tree)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))

    def checkpoint_params(self, pre: str) -> dict[str, tuple[torch.Tensor, str | None]]:
        out: dict[str, tuple[torch.Tensor, str | None]] = {}
        if self.q_a_proj is None:
            out.update(self.q_proj.checkpoint_params([f"{pre}q_proj"]))
        else:
            out.update(self.q_a_proj.checkpoint_params([f"{pre}q_a_proj"]))
            out[f"{pre}q_a_layernorm.weight"] = (self.q_a_layernorm.weight, None)
            out.update(self.q_proj.checkpoint_params([f"{pre}q_b_proj"]))
        out.update(self.kv_a_proj_with_mqa.checkpoint_params([f"{pre}kv_a_proj_with_mqa"]))
        out[f"{pre}kv_a_layernorm.weight"] = (self.kv_a_layernorm.weight, None)
        out.update(self.kv_b_proj.checkpoint_params([f"{pre}kv_b_proj"]))
        out.update(self.o_proj.checkpoint_params([f"{pre}o_proj"]))
        return out
