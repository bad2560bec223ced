"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm) and
Gemma 2/3, and, with an expert block for the MLP (models.moe) or latent attention (models.mla),
Mixtral, Qwen2/3-MoE and DeepSeek V2/V3.

They differ only in flags that ModelConfig reads from config.json, so one implementation serves
them all and one parity test suite covers them. Per layer: a sliding window or full attention
(Mistral, Qwen2 with max_window_layers, Gemma's alternating local/global layers) and, in Gemma 3,
the local layers' own RoPE. Gemma adds (1 + weight) RMSNorms with post-attention and pre/post
feed-forward norms, embeddings scaled by sqrt(hidden_size), a GELU(tanh) MLP, the attention scale
query_pre_attn_scalar ** -0.5 and tanh soft-capping of attention scores and final logits.
Tokens are packed (no batch axis, no padding); attention goes through the AttentionBackend, layer
ops through kvserve.kernels.ops.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import ops, reference
from kvserve.kernels.reference import is_fp8
from kvserve.runtime.attention.backend import AttentionBackend, AttentionMetadata
from kvserve.runtime.executor.platform import platform_for
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    ReplicatedWeight,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from kvserve.runtime.models.quantization import QuantizationConfig
from kvserve.runtime.models.rope import rope_cos_sin_cache


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype, device: torch.device, layer: int = 0,
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        shape = cfg.shape
        shape.check_tp(tp_size)
        d = shape.head_dim
        self.head_dim = d
        self.num_heads = shape.num_attention_heads // tp_size
        self.num_kv_heads = shape.kv_heads_per_rank(tp_size)
        if shape.num_kv_heads >= tp_size:
            kv_start = tp_rank * self.num_kv_heads
        else:  # fewer KV heads than ranks: each rank keeps a copy of the head its query heads use
            kv_start = tp_rank * shape.num_kv_heads // tp_size
        self.qkv_proj = MergedColumnParallelLinear(
            shape.hidden_size,
            output_sizes=[shape.num_attention_heads * d, shape.num_kv_heads * d, shape.num_kv_heads * d],
            shard_sizes=[self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d],
            shard_starts=[tp_rank * self.num_heads * d, kv_start * d, kv_start * d],
            bias=cfg.qkv_bias, dtype=dtype, device=device, part_names=["q", "k", "v"],
            prefixes=[f"model.layers.{layer}.self_attn.{p}_proj" for p in "qkv"], quant_config=quant_config,
            tp_rank=tp_rank, tp_size=tp_size,
        )
        self.o_proj = RowParallelLinear(shape.num_attention_heads * d, shape.hidden_size, bias=cfg.o_proj_bias,
                                        tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device,
                                        prefix=f"model.layers.{layer}.self_attn.o_proj", quant_config=quant_config)
        self.q_norm = ReplicatedWeight(d, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = ReplicatedWeight(d, dtype=dtype, device=device) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.norm = ops.gemma_rms_norm if cfg.gemma_norms else ops.rms_norm
        self.scale = (cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else d) ** -0.5
        self.sliding_window = cfg.layer_window(layer)
        self.logits_soft_cap = cfg.attn_logit_softcapping
        self.backend = backend
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        # A float8 KV cache stores value / scale per layer: 1.0 unless the checkpoint has scales
        # (k_scale / v_scale, as llm-compressor's kv_cache_scheme and ModelOpt write them).
        for name in ("k_scale", "v_scale"):
            self.register_buffer(name, torch.ones((), dtype=torch.float32, device=device))
            getattr(self, name).weight_loader = self._load_kv_scale

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.norm(q, self.q_norm.weight, self.eps)
            k = self.norm(k, self.k_norm.weight, self.eps)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv_cache
        # Only float8 pools take scales, so backends without float8 support never see them.
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale) if is_fp8(k_cache) else {}
        self.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        if self.sliding_window is None and self.logits_soft_cap is None:
            out = self.backend.attend(q, k, v, k_cache, v_cache, meta, self.scale, **scales)
        else:
            out = self.backend.attend(q, k, v, k_cache, v_cache, meta, self.scale,
                                      sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                                      **scales)
        return self.o_proj(out.reshape(t, self.q_size))

    def _load_kv_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """A checkpoint's scalar K or V scale (shard "kv": one scale for both, older checkpoints)."""
        if loaded.numel() != 1:
            raise ValueError(f"weight kv cache scale: expected one value per layer, got shape {tuple(loaded.shape)}")
        value = loaded.reshape(()).float()
        if not (torch.isfinite(value) and value > 0):
            raise ValueError(f"weight kv cache scale: must be a positive finite number, got {value.item()}")
        for target in ((self.k_scale, self.v_scale) if shard_id == "kv" else (param,)):
            target.copy_(value)

    def checkpoint_params(self, pre: str) -> dict[str, tuple[torch.Tensor, str | None]]:
        # The linear layers list their own tensors: their weight format decides which.
        out = self.qkv_proj.checkpoint_params([f"{pre}{p}_proj" for p in "qkv"])
        out.update(self.o_proj.checkpoint_params([f"{pre}o_proj"]))
        if self.q_norm is not None:
            out[f"{pre}q_norm.weight"] = (self.q_norm.weight, None)
            out[f"{pre}k_norm.weight"] = (self.k_norm.weight, None)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device,
                 intermediate_size: int | None = None, reduce_results: bool = True, prefix: str = "mlp",
                 quant_config: QuantizationConfig | None = None):
        super().__init__()
        inter = intermediate_size or cfg.shape.intermediate_size
        if inter % tp_size:
            raise ValueError(f"intermediate_size {inter} is not divisible by tensor_parallel_size {tp_size}")
        shard = inter // tp_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, output_sizes=[inter, inter], shard_sizes=[shard, shard],
            shard_starts=[tp_rank * shard, tp_rank * shard], bias=cfg.mlp_bias, dtype=dtype, device=device,
            part_names=["gate", "up"], prefixes=[f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size,
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias, tp_rank=tp_rank,
                                           tp_size=tp_size, dtype=dtype, device=device,
                                           reduce_results=reduce_results, prefix=f"{prefix}.down_proj",
                                           quant_config=quant_config)
        self.act_and_mul = ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_tanh" else ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def checkpoint_params(self, pre: str) -> dict[str, tuple[torch.Tensor, str | None]]:
        out = self.gate_up_proj.checkpoint_params([f"{pre}gate_proj", f"{pre}up_proj"])
        out.update(self.down_proj.checkpoint_params([f"{pre}down_proj"]))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, layer: int = 0,
                 quant_config: QuantizationConfig | None = None, **kw):
        super().__init__()
        if cfg.shape.mla is not None:
            from kvserve.runtime.models.mla import MLAAttention

            self.self_attn = MLAAttention(cfg, backend, layer=layer, quant_config=quant_config, **kw)
        elif cfg.alibi_llama_layers:  # Baichuan-13B: ALiBi attention in the Llama layer
            from kvserve.runtime.models.mpt import AlibiAttention

            self.self_attn = AlibiAttention(cfg, backend, layer=layer, quant_config=quant_config, **kw)
        else:
            self.self_attn = Attention(cfg, backend, layer=layer, quant_config=quant_config, **kw)
        # Where the checkpoint keeps this layer's MLP (Mixtral: its expert block).
        self.mlp_prefix = "block_sparse_moe." if cfg.architecture == "MixtralForCausalLM" else "mlp."
        moe = cfg.shape.moe
        if moe is not None and layer in moe.moe_layers:
            from kvserve.runtime.models.moe import SparseMoeBlock

            self.mlp = SparseMoeBlock(cfg, prefix=f"model.layers.{layer}.{self.mlp_prefix[:-1]}",
                                      quant_config=quant_config, **kw)
        else:
            self.mlp = MLP(cfg, prefix=f"model.layers.{layer}.mlp", quant_config=quant_config, **kw)
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.input_layernorm = ReplicatedWeight(cfg.hidden_size, **dd)
        self.post_attention_layernorm = ReplicatedWeight(cfg.hidden_size, **dd)
        self.eps = cfg.rms_norm_eps
        self.norm_names = ("input_layernorm", "post_attention_layernorm")

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin):
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_layernorm.weight, self.eps)
        else:
            hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.input_layernorm.weight, self.eps)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin)
        hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(hidden), residual


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3: every sublayer's output is normed before the residual add ("sandwich" norms).

    Carries (hidden, residual) between layers like DecoderLayer, so the add that closes one
    sublayer fuses with the norm that opens the next."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, layer: int = 0,
                 quant_config: QuantizationConfig | None = None, **kw):
        super().__init__()
        self.self_attn = Attention(cfg, backend, layer=layer, quant_config=quant_config, **kw)
        self.mlp = MLP(cfg, prefix=f"model.layers.{layer}.mlp", quant_config=quant_config, **kw)
        self.mlp_prefix = "mlp."
        dd = dict(dtype=kw["dtype"], device=kw["device"])
        self.norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm")
        for name in self.norm_names:
            setattr(self, name, ReplicatedWeight(cfg.hidden_size, **dd))
        self.eps = cfg.rms_norm_eps

    def forward(self, positions, hidden, residual, kv_cache, meta, cos_sin):
        if residual is None:
            residual = hidden
            hidden = ops.gemma_rms_norm(hidden, self.input_layernorm.weight, self.eps)
        else:
            hidden, residual = ops.gemma_fused_add_rms_norm(hidden, residual, self.input_layernorm.weight, self.eps)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin)
        hidden = ops.gemma_rms_norm(hidden, self.post_attention_layernorm.weight, self.eps)
        hidden, residual = ops.gemma_fused_add_rms_norm(hidden, residual, self.pre_feedforward_layernorm.weight,
                                                        self.eps)
        hidden = self.mlp(hidden)
        return ops.gemma_rms_norm(hidden, self.post_feedforward_layernorm.weight, self.eps), residual


_UNBUILT = object()


class CausalLM(nn.Module):
    """A packed-token decoder: forward() gives final hidden states, compute_logits() the logits."""

    # True while a step with LoRA adapters runs (runtime/lora/worker.py); `lora_state` is the
    # wrappers' shared LoRAState (its batch names each token's slot). The native decode stack
    # adds the adapters itself when it was built with the wrappers' slots, else such a step takes
    # the per-op path.
    lora_active = False
    lora_state = None
    # Speculative heads that read intermediate layers (EAGLE-3: a low, a middle and a high layer;
    # EAGLE-1: the last layer before the final norm) name them here; forward() then leaves each
    # one's residual stream (hidden + residual, in the model's layer numbering) in `aux_hidden`.
    # Empty: nothing is kept, and the native decode stack stays on.
    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, *, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1,
                 quant_config: QuantizationConfig | None = None, layer_range: tuple[int, int] | None = None):
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        # A pipeline stage (runtime/models/pipeline_stage.py) builds only its layers; the first
        # stage holds the embedding, the last the final norm and the head (and the embedding
        # again when it is the head: tied embeddings).
        self.layer_start, self.layer_end = layer_range or (0, cfg.num_layers)
        first, last = self.layer_start == 0, self.layer_end == cfg.num_layers
        self.config = cfg
        self.dtype, self.device = dtype, torch.device(device)
        self._platform = platform_for(self.device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.quant_config = quant_config
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=self.device)
        qkw = dict(kw, quant_config=quant_config)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **qkw)
                             if first or (last and cfg.tie_word_embeddings) else None)
        layer_cls = GemmaDecoderLayer if cfg.gemma_norms else DecoderLayer
        if cfg.falcon_parallel:  # Falcon-7B/40B: RoPE, attention and MLP in parallel, LayerNorms
            from kvserve.runtime.models.falcon import FalconParallelLayer

            layer_cls = FalconParallelLayer
        elif cfg.alibi_bias_max is not None and not cfg.alibi_llama_layers:  # MPT: ALiBi, LayerNorms, plain MLP
            from kvserve.runtime.models import mpt

            layer_cls = mpt.AlibiDecoderLayer
        self.layers = nn.ModuleList(layer_cls(cfg, backend, layer=i, **qkw)
                                    for i in range(self.layer_start, self.layer_end))
        self.norm = ReplicatedWeight(cfg.hidden_size, dtype=dtype, device=self.device) if last else None
        self.lm_head = (ParallelLMHead(cfg.vocab_size, cfg.hidden_size, **qkw)
                        if last and not cfg.tie_word_embeddings else None)
        # float32 regardless of the model dtype: ops.rotary_embedding casts per call, as HF does.
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(cfg, device=self.device), persistent=False)
        # Gemma 3's local layers rotate with their own base frequency.
        self.register_buffer("local_cos_sin_cache", None if cfg.local_rope is None else
                             rope_cos_sin_cache(cfg, device=self.device, local=True), persistent=False)
        self._layer_windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        self._local_rope_layers = frozenset(i for i in range(cfg.num_layers) if cfg.layer_window(i) is not None)
        self.final_norm = ops.gemma_fused_add_rms_norm if cfg.gemma_norms else ops.fused_add_rms_norm
        self.first_norm = ops.gemma_rms_norm if cfg.gemma_norms else ops.rms_norm
        self.embed_layernorm = None
        if cfg.layer_norms:  # MPT, BLOOM, Falcon: LayerNorms (BLOOM, Falcon: biases; BLOOM: embed norm)
            from kvserve.runtime.models import mpt

            dd = dict(dtype=dtype, device=self.device)
            self.final_layernorm = mpt.LayerNorm(cfg.hidden_size, bias=cfg.norm_bias, **dd) if last else None
            if cfg.embed_norm and first:
                self.embed_layernorm = mpt.LayerNorm(cfg.hidden_size, bias=cfg.norm_bias, **dd)
            if last:
                self.norm = self.final_layernorm.norm_weight
            final = self.final_layernorm

            def final_norm(hidden, residual, weight, eps):
                return mpt.add_layer_norm(hidden, residual, weight, eps, final.bias)

            def first_norm(hidden, weight, eps):
                return mpt.layer_norm(hidden, weight, eps, final.bias)

            self.final_norm, self.first_norm = final_norm, first_norm
        # Gemma multiplies the embeddings by sqrt(hidden_size), rounded to the model dtype as HF does.
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5).to(dtype).to(self.device)
                            if cfg.gemma_norms else None)
        _, self.num_kv_heads, self.head_dim = cfg.shape.kv_cache_layout(tp_size)
        # float32 on the CPU: decode steps through one native call (models/native_decode.py),
        # built at the first decode step (after loading has packed the weights); None: not eligible.
        self._native_stack = _UNBUILT
        self.aux_hidden: list[torch.Tensor] = []

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) pool on this rank (of its latent pool, for MLA)."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def _native_lora(self, stack, num_tokens: int):
        """This step's adapter rows for the native stack, or None when it cannot add them."""
        batch = None if self.lora_state is None else self.lora_state.batch
        if stack.lora_slots is None or batch is None or len(batch.token_slots) != num_tokens:
            return None
        from kvserve.kernels.cpu import native

        return native.lora_step(stack.lora_slots, batch.token_slots, self.lora_state.slot_ranks)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected {len(self.layers)} layers, got {len(kv_caches)}")
        aux = self.aux_hidden_layers
        # Medusa tree verification steps run as decode rows too (native_decode.tree_rows).
        if (meta.is_decode_only or meta.tree_masks is not None) and self.device.type == "cpu" and not aux:
            stack = self._native_stack
            if stack is _UNBUILT:
                from kvserve.runtime.models import native_decode

                stack = self._native_stack = native_decode.build(self)
            lora = self._native_lora(stack, input_ids.shape[0]) if self.lora_active and stack is not None else None
            # One block table for every layer: a model with KV cache groups keeps the per-op path.
            rows = None
            if (stack is not None and (lora is not None or not self.lora_active) and meta.kv_groups is None
                    and self._platform.native_ops(self.cos_sin_cache) and stack.accepts(kv_caches)):
                if meta.is_decode_only:
                    rows = meta.block_tables, meta.seq_lens, None
                elif stack.takes_trees:
                    from kvserve.runtime.models import native_decode

                    rows = native_decode.tree_rows(meta)
            if rows is not None:
                hidden, residual = stack.run(self._embed(input_ids), positions, meta.slot_mapping, rows[0], rows[1],
                                             kv_caches, lora, tree_masks=rows[2])
                hidden, _ = self.final_norm(hidden, residual, self.norm.weight, self.config.rms_norm_eps)
                return hidden
        hidden = self._embed(input_ids)
        residual = None
        captured: list[torch.Tensor] = []
        local = self.local_cos_sin_cache
        groups = meta.kv_groups
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            cos_sin = local if local is not None and i in self._local_rope_layers else self.cos_sin_cache
            layer_meta = meta if groups is None else groups[self._layer_windows[i]]
            hidden, residual = layer(positions, hidden, residual, kv_cache, layer_meta, cos_sin)
            if aux and self.layer_start + i in aux:
                captured.append(hidden if residual is None else hidden + residual)
        if aux:
            self.aux_hidden = captured
        if residual is None:
            return self.first_norm(hidden, self.norm.weight, self.config.rms_norm_eps)
        hidden, _ = self.final_norm(hidden, residual, self.norm.weight, self.config.rms_norm_eps)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.embed_layernorm is not None:  # BLOOM
            ln = self.embed_layernorm
            hidden = torch.nn.functional.layer_norm(hidden, (hidden.shape[-1],), ln.weight, ln.bias,
                                                    self.config.rms_norm_eps)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 [N, vocab_size] for hidden states [N, hidden_size]."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        logits = head.logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers does, before the float32 cast
            logits = reference.soft_cap_ref(logits, cap)
        return logits.float()

    def optional_checkpoint_params(self) -> dict[str, tuple[torch.Tensor, str | None]]:
        """Checkpoint tensors this model reads when present: the float8 KV cache scales, under the
        names vLLM accepts (self_attn.k_scale / v_scale, k_proj.k_scale / v_proj.v_scale, and the
        older single self_attn.kv_scale)."""
        out: dict[str, tuple[torch.Tensor, str | None]] = {}
        for i, layer in enumerate(self.layers, start=self.layer_start):
            attn, pre = layer.self_attn, f"model.layers.{i}.self_attn."
            if not hasattr(attn, "k_scale"):  # MLA: its latent cache has no float8 form yet
                continue
            out[f"{pre}k_scale"] = out[f"{pre}k_proj.k_scale"] = (attn.k_scale, None)
            out[f"{pre}v_scale"] = out[f"{pre}v_proj.v_scale"] = (attn.v_scale, None)
            out[f"{pre}kv_scale"] = (attn.k_scale, "kv")
        return out

    def checkpoint_params(self) -> dict[str, tuple[torch.Tensor, str | None]]:
        """Maps every checkpoint tensor name this model consumes to (parameter, shard id)."""
        out: dict[str, tuple[torch.Tensor, str | None]] = {}
        if self.norm is not None:
            out["model.norm.weight"] = (self.norm.weight, None)
        if getattr(self, "final_layernorm", None) is not None:
            out.update(self.final_layernorm.checkpoint_params("model.norm"))
        if self.embed_layernorm is not None:
            out.update(self.embed_layernorm.checkpoint_params("model.embed_layernorm"))
        if self.embed_tokens is not None:
            out.update(self.embed_tokens.checkpoint_params())
        if self.lm_head is not None:
            out.update(self.lm_head.checkpoint_params())
        for i, layer in enumerate(self.layers, start=self.layer_start):
            pre = f"model.layers.{i}."
            out.update(layer.self_attn.checkpoint_params(f"{pre}self_attn."))
            out.update(layer.mlp.checkpoint_params(pre + layer.mlp_prefix))
            for name in layer.norm_names:
                out[f"{pre}{name}.weight"] = (getattr(layer, name).weight, None)
            if hasattr(layer, "checkpoint_extras"):
                out.update(layer.checkpoint_extras(pre))
        return out
