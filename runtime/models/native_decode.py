"""Decode steps of a float32 Llama-family model on the CPU in one native call.

At batch 1 the per-op path still spends a few milliseconds a step in Python: about ten calls per
layer (module dispatch, tensor allocations, the kernel wrappers), 30 layers a step, against
~25 ms of matmuls. `kvserve.kernels.cpu.native.DecoderStack` runs every layer of a decode-only
step in C with the same kernels in the same order, so its results are bit-identical to the
per-op path's (tests/test_fastpath.py compares them) and the model's forward is one call.

Only what the per-op native path would run qualifies: every layer a plain DecoderLayer
(Llama, Mistral, Qwen2, Qwen3: not Gemma's sandwich norms, not MoE or MLA) with SiLU, an ALiBi
layer (MPT, BLOOM, Falcon-RW: models/mpt.py) or rotary Falcon's parallel layer (models/falcon.py), weights
packed for a native matmul (float32 panels, or the int8/int4 panels of
`quantization.packed` that int8, int4, AWQ, GPTQ, compressed-tensors and GGUF weights end in;
not a GPTQ/compressed-tensors act-order layer, which permutes its input), tp_size 1, the torch
attention backend, float32 caches. Anything else keeps the per-op path.

ALiBi and Falcon layers' LayerNorms and GELU run in C where the per-op path calls torch's, so their results
agree with it to float rounding, not bit for bit (tests/test_alibi_native.py bounds the gap).
"""

from __future__ import annotations

import torch

from kvserve.kernels import ops


def _bias(linear) -> torch.Tensor | None:
    linear = getattr(linear, "base_layer", linear)
    return None if linear.bias is None else linear.bias.detach()


def _native_weight(linear):
    """What the native stack multiplies by for this linear layer, or None: its float32 panels, or
    the native panels of its int8/int4/bitsandbytes 4-bit weight when its method's apply is
    exactly matmul + bias.
    A LoRA wrapper stands for its base layer (its adapters are added beside it: _lora_slots)."""
    linear = getattr(linear, "base_layer", linear)
    if getattr(linear, "packed_out_features", None) is not None:
        return linear.weight.detach()
    if getattr(linear, "gptq_perm", None) is not None or getattr(linear, "ct_perm", None) is not None:
        return None
    for attr in ("int8", "int4", "bnb4"):  # bnb4: a bitsandbytes 4-bit layer held packed
        weight = getattr(linear, attr, None)
        if weight is not None:
            return getattr(weight, "native", None)
    return None


def _gate_up_features(linear) -> int:
    n = getattr(linear, "packed_out_features", None)
    return n if n is not None else _native_weight(linear).n


def build(model) -> object | None:
    """A DecoderStack for `model` (a CausalLM), or None when it does not qualify."""
    from kvserve.kernels.cpu import native
    from kvserve.runtime.attention.torch_backend import TorchAttentionBackend
    from kvserve.runtime.models import mpt
    from kvserve.runtime.models.falcon import FalconParallelLayer
    from kvserve.runtime.models.llama import MLP, Attention, DecoderLayer

    cfg = model.config
    if (model.device.type != "cpu" or model.dtype != torch.float32 or model.tp_size != 1 or cfg.gemma_norms
            or model.embed_scale is not None or not native.available() or not model.layers):
        return None
    specs = []
    for i, layer in enumerate(model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        # exactly the torch backend: a subclass may change what attention computes
        if type(getattr(attn, "backend", None)) is not TorchAttentionBackend:
            return None
        if type(layer) is mpt.AlibiDecoderLayer:
            spec = _alibi_spec(layer, attn, mlp, mpt)
            if spec is None:
                return None
            specs.append(spec)
            continue
        if type(layer) is FalconParallelLayer:
            spec = _falcon_spec(model, i, layer, attn, mlp, mpt)
            if spec is None:
                return None
            specs.append(spec)
            continue
        # Baichuan-13B: ALiBi attention in the Llama layer (the slopes instead of the rotation)
        alibi = type(attn) is mpt.AlibiAttention
        if (type(layer) is not DecoderLayer or type(attn) not in (Attention, mpt.AlibiAttention)
                or type(mlp) is not MLP or mlp.act_and_mul is not ops.silu_and_mul):
            return None
        weights = [_native_weight(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(w is None for w in weights):
            return None
        cos_sin = _cos_sin(model, i, attn)
        if cos_sin is None:
            return None
        if attn.num_heads // attn.num_kv_heads > native.MAX_GQA_GROUP:
            return None
        specs.append(dict(
            input_norm=layer.input_layernorm.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
            q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
            k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
            qkv=weights[0], qkv_bias=_bias(attn.qkv_proj), o=weights[1], o_bias=_bias(attn.o_proj),
            gate_up=weights[2], gate_up_bias=_bias(mlp.gate_up_proj), down=weights[3],
            down_bias=_bias(mlp.down_proj),
            cos_sin=cos_sin, window=attn.sliding_window, softcap=attn.logits_soft_cap,
            scale=attn.scale, alibi=attn.alibi_slopes.detach().to(torch.float32).contiguous() if alibi else None,
            clip_qkv=attn.clip_qkv if alibi else None))
        if layer.eps != cfg.rms_norm_eps or attn.eps != cfg.rms_norm_eps:
            return None
    first = model.layers[0]
    inter = (_gate_up_features(first.mlp.up_proj) if type(first.mlp) is mpt.PlainMLP
             else _gate_up_features(first.mlp.gate_up_proj) // 2)
    stack = native.DecoderStack(specs, hidden=cfg.hidden_size, heads=first.self_attn.num_heads,
                                kv_heads=first.self_attn.num_kv_heads, head_dim=first.self_attn.head_dim,
                                inter=inter, eps=cfg.rms_norm_eps)
    stack.lora_slots = _lora_slots(model, native)
    return stack


def _alibi_spec(layer, attn, mlp, mpt) -> dict | None:
    """An ALiBi layer (MPT, BLOOM, Falcon-RW) as the stack runs it: LayerNorms, no rotary, the
    slopes, an ungated GELU MLP (its up projection in the gate_up slot)."""
    if type(attn) is not mpt.AlibiAttention or type(mlp) is not mpt.PlainMLP or attn.sliding_window is not None:
        return None
    weights = [_native_weight(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.up_proj, mlp.down_proj)]
    if any(w is None for w in weights) or attn.num_heads // attn.num_kv_heads > _max_group():
        return None
    if layer.eps != attn.eps:
        return None
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    return dict(
        input_norm=ln1.weight.detach(), post_norm=ln2.weight.detach(),
        input_norm_bias=None if ln1.bias is None else ln1.bias.detach(),
        post_norm_bias=None if ln2.bias is None else ln2.bias.detach(), norm="layer",
        q_norm=None, k_norm=None,
        qkv=weights[0], qkv_bias=_bias(attn.qkv_proj), o=weights[1], o_bias=_bias(attn.o_proj),
        gate_up=weights[2], gate_up_bias=_bias(mlp.up_proj), down=weights[3], down_bias=_bias(mlp.down_proj),
        mlp="gelu_tanh" if mlp.approximate == "tanh" else "gelu",
        cos_sin=None, alibi=attn.alibi_slopes.detach().to(torch.float32).contiguous(),
        window=None, softcap=None, scale=attn.scale, clip_qkv=attn.clip_qkv)


def _cos_sin(model, i: int, attn) -> torch.Tensor | None:
    """Layer i's rotary table as the stack reads it, or None when the kernel cannot rotate by it."""
    local = model.local_cos_sin_cache
    cos_sin = local if local is not None and i in model._local_rope_layers else model.cos_sin_cache
    if cos_sin.dtype != torch.float32 or cos_sin.shape[1] > attn.head_dim or cos_sin.shape[1] % 2:
        return None
    return cos_sin.contiguous()


def _falcon_spec(model, i: int, layer, attn, mlp, mpt) -> dict | None:
    """A rotary Falcon layer (models/falcon.py): rotary attention beside an ungated GELU MLP, both
    fed by LayerNorms of the same x; the layer's own MLP LayerNorm (the new decoder architecture)
    goes in the post-norm slot, which the stack then applies to x rather than to x + attn."""
    from kvserve.runtime.models.llama import Attention

    if type(attn) is not Attention or type(mlp) is not mpt.PlainMLP or attn.q_norm is not None:
        return None
    weights = [_native_weight(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.up_proj, mlp.down_proj)]
    cos_sin = _cos_sin(model, i, attn)
    if any(w is None for w in weights) or cos_sin is None or attn.num_heads // attn.num_kv_heads > _max_group():
        return None
    if layer.eps != model.config.rms_norm_eps:
        return None
    ln_a, ln_m = layer.input_layernorm, layer.mlp_layernorm
    return dict(
        input_norm=ln_a.weight.detach(), input_norm_bias=None if ln_a.bias is None else ln_a.bias.detach(),
        post_norm=None if ln_m is None else ln_m.weight.detach(),
        post_norm_bias=None if ln_m is None or ln_m.bias is None else ln_m.bias.detach(), norm="layer",
        parallel="shared_norm" if ln_m is None else "two_norms", q_norm=None, k_norm=None,
        qkv=weights[0], qkv_bias=_bias(attn.qkv_proj), o=weights[1], o_bias=_bias(attn.o_proj),
        gate_up=weights[2], gate_up_bias=_bias(mlp.up_proj), down=weights[3], down_bias=_bias(mlp.down_proj),
        mlp="gelu_tanh" if mlp.approximate == "tanh" else "gelu", cos_sin=cos_sin,
        window=attn.sliding_window, softcap=attn.logits_soft_cap, scale=attn.scale, alibi=None, clip_qkv=None)


def _max_group() -> int:
    from kvserve.kernels.cpu import native

    return native.MAX_GQA_GROUP


def _lora_slots(model, native):
    """The LoRA wrappers' slots (runtime/lora/layers.py) for the stack, or None without LoRA:
    steps with adapters then run in the stack too, each adapted layer adding its rows' products
    right after its base matmul, as the wrapper does on the per-op path."""
    from kvserve.runtime.lora.layers import LoRALinear

    layers, max_rank = [], None
    for layer in model.layers:
        mlp = layer.mlp
        up = mlp.gate_up_proj if hasattr(mlp, "gate_up_proj") else mlp.up_proj  # ALiBi layers: ungated
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, up, mlp.down_proj)
        entries = []
        for w in linears:
            if not isinstance(w, LoRALinear):
                entries.append(None)
                continue
            rank = w.a_t.shape[2] // len(w.parts)
            if max_rank not in (None, rank) or w.a_t.dtype not in (torch.float32, torch.bfloat16):
                return None  # float16 slots (lora_dtype): adapter steps take the per-op path
            max_rank = rank
            entries.append((w.a_t, w.b_t, [size for _, _, size in w.out_slices]))
        layers.append(entries)
    if max_rank is None:
        return None
    return native.LoRASlots(layers, max_rank)


# Longest query of a sequence a tree step may hold to run as decode rows: a tree has at most 64
# nodes; a longer causal query is a prefill chunk, which the per-op path runs as one block.
_MAX_TREE_ROWS = 64
# Most rows a tree step runs on the stack: its 6-row AVX2 micro-kernel reads each weight panel
# once, which wins while the step is bandwidth bound, but past a few dozen rows the step is
# compute bound and the per-op path's sgemm is faster (bench/medusa_step_cost.py: 8 trees of 8
# nodes, 64 rows, cost 10.2x a decode here against 6.5x per-op; 32 rows 3.4x against 5.4x).
_MAX_STEP_ROWS = 48


def tree_rows(meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A Medusa tree verification step (AttentionMetadata.tree_masks set, one entry per sequence)
    as decode rows for DecoderStack.run: (block tables, seq lens, tree masks), one row per token.
    Row j of a sequence with q new tokens after c cached ones sees c + j + 1 slots, its own last:
    a causal sequence's rows then attend exactly as its query would (mask 0), and a tree node's
    mask (its own bit j, its ancestors' below) drops its siblings' slots. Every row is computed as
    the plain decode row of the same token would be, so the accepted path's logits are those of
    decoding without speculation, bit for bit. None when a sequence's query is longer than a tree,
    or the step has more rows than the stack runs faster than the per-op path."""
    starts = meta.query_start_loc.to(torch.long)
    q_lens = starts[1:] - starts[:-1]
    if int(q_lens.max()) > _MAX_TREE_ROWS or int(starts[-1]) > _MAX_STEP_ROWS:
        return None
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    j = torch.arange(seq.shape[0]) - starts[:-1][seq]
    lens = (meta.seq_lens.to(torch.long) - q_lens)[seq] + j + 1
    return meta.block_tables.index_select(0, seq), lens.to(torch.int32), meta.tree_masks.to(torch.int64)
