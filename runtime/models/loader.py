"""Builds a CausalLM and streams its weights in from safetensors, one shard file at a time."""

from __future__ import annotations

import json
import logging
import pathlib
import re

import torch
from safetensors import SafetensorError, safe_open

from kvserve.runtime.architectures import (
    checkpoint_name,
    fused_part_rows,
    fused_parts,
    fused_rows_per_head,
    per_group_qkv_order,
)
from kvserve.runtime.attention.backend import AttentionBackend
from kvserve.runtime.gguf.reader import is_gguf_path
from kvserve.runtime.model_config import ModelConfig
from kvserve.runtime.models.layers import LinearBase
from kvserve.runtime.models.llama import CausalLM
from kvserve.runtime.models.quantization import QuantizationConfig, resolve_quantization

log = logging.getLogger(__name__)

# Buffers some older checkpoints saved that are recomputed here.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _mtp_tensor(name: str, cfg: ModelConfig) -> bool:
    """A tensor of the multi-token prediction layers DeepSeek-V3 keeps after the decoder layers
    (MiMo: under model.mtp_layers.*), read only by speculative decoding's mtp method
    (spec_decode/mtp.py)."""
    if not cfg.hf_config.get("num_nextn_predict_layers"):
        return False
    m = _LAYER_INDEX.match(name)
    return (m is not None and int(m.group(1)) >= cfg.num_layers) or name.startswith("model.mtp_layers.")


def checkpoint_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checkpoint: the index's shards, or every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(model_dir)!r} (only safetensors is supported)")
    missing = [str(f.name) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"model: checkpoint shards listed in the index are missing: {missing}")
    return files


def load_model(model_dir: str | pathlib.Path, *, dtype: torch.dtype, device: torch.device | str,
               attention_backend: AttentionBackend, tp_rank: int = 0, tp_size: int = 1,
               config: ModelConfig | None = None,
               quantization: str | QuantizationConfig | None = None,
               layer_range: tuple[int, int] | None = None) -> CausalLM:
    """Loads a supported HF causal LM from a local directory (or a GGUF file), with this rank's
    weight shards.

    `quantization`: a format name (None: whatever the checkpoint's quantization_config says,
    else full precision) or an already resolved QuantizationConfig. `layer_range`: a pipeline
    stage's layers [start, end) (runtime/models/pipeline_stage.py); other stages' tensors are skipped."""
    model_dir = pathlib.Path(model_dir)
    cfg = config or ModelConfig.from_pretrained(model_dir)
    device = torch.device(device)
    quant_config = (quantization if isinstance(quantization, QuantizationConfig)
                    else resolve_quantization(quantization, cfg.hf_config))
    if quant_config is not None:
        quant_config.check_supported(device, dtype)
    from kvserve.runtime.models import host_weights

    key = host_weights.snapshot_key(model_dir, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size,
                                    quant_config=quant_config, layer_range=layer_range)
    with host_weights.loading(key):
        kept = host_weights.lookup(key)
        if kept is not None:  # this shard was loaded before in this process: its tensors, shared
            from kvserve.runtime.models.quantization.base import parameters_replaced

            with parameters_replaced():
                model = CausalLM(cfg, attention_backend, dtype=dtype, device=device, tp_rank=tp_rank,
                                 tp_size=tp_size, quant_config=quant_config, layer_range=layer_range)
            host_weights.apply(model, kept)
            return model.eval()
        model = CausalLM(cfg, attention_backend, dtype=dtype, device=device,
                         tp_rank=tp_rank, tp_size=tp_size, quant_config=quant_config, layer_range=layer_range)
        before = {name: host_weights.module_state(m) for name, m in model.named_modules()} if key else {}
        _load_weights(model, model_dir, cfg, quant_config, layer_range)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, LinearBase):
                    module.process_weights_after_loading()
        host_weights.record(key, model, before)
    return model.eval()


def _load_weights(model: CausalLM, model_dir: pathlib.Path, cfg: ModelConfig,
                  quant_config: QuantizationConfig | None, layer_range: tuple[int, int] | None) -> None:
    """Streams the checkpoint's tensors into `model`'s parameters (this rank's slices)."""
    if layer_range is None:
        def other_stage(name: str) -> bool:
            return False
    else:
        from kvserve.runtime.models.pipeline_stage import other_stage_tensor

        def other_stage(name: str) -> bool:
            return other_stage_tensor(name, *layer_range, cfg.num_layers, cfg.tie_word_embeddings)
    targets = model.checkpoint_params()
    optional = model.optional_checkpoint_params()
    loaded: set[str] = set()

    def consume(name: str, tensor: torch.Tensor) -> None:
        parts = fused_parts(cfg.architecture, name)
        if parts is not None:
            for part, piece in _split_rows(cfg, name, parts, tensor):
                consume(part, piece)
            return
        if name in optional:  # float8 KV scales: float32 whatever the model dtype
            param, shard_id = optional[name]
            param.weight_loader(param, tensor, shard_id)
            return
        param, shard_id = targets[name]
        # Into the parameter's own dtype: the model's for full-precision weights, float32 for a
        # parameter kept wider (DeepSeek V3's routing bias, a quantized format's scales), the
        # integer or FP8 dtype of a quantized format's values.
        param.weight_loader(param, tensor.to(dtype=getattr(param, "load_dtype", param.dtype)), shard_id)
        loaded.add(name)

    with torch.no_grad():
        if is_gguf_path(model_dir):
            from kvserve.runtime.gguf import GroupQuantized, checkpoint_tensors

            def target(name: str) -> str:  # a fused tensor's layer is its first part's
                return (fused_parts(cfg.architecture, name) or (name,))[0]

            def keep_quantized(name: str, ggml_type) -> bool:  # the layer's method holds codes
                return getattr(targets[target(name)][0], "gguf_codes", False)

            def consume_gguf(name: str, tensor) -> None:
                if isinstance(tensor, GroupQuantized):
                    prefix = name.removesuffix(".weight")
                    consume(name, tensor.codes)
                    consume(f"{prefix}.gguf_scale", tensor.scales)
                    if tensor.offsets is not None:
                        consume(f"{prefix}.gguf_offset", tensor.offsets)
                else:
                    consume(name, tensor)

            for name, tensor in checkpoint_tensors(model_dir, cfg, keep_quantized=keep_quantized,
                                                   wanted=lambda n: target(n) in targets):
                parts = fused_parts(cfg.architecture, name)
                if parts is not None and isinstance(tensor, GroupQuantized):
                    for part, piece in _split_rows(cfg, name, parts, tensor):
                        consume_gguf(part, piece)
                else:
                    consume_gguf(name, tensor)
        else:
            for path in checkpoint_files(model_dir):
                try:
                    with safe_open(str(path), framework="pt", device="cpu") as f:
                        for stored in f.keys():
                            name = checkpoint_name(cfg.architecture, stored)
                            if (name not in targets and name not in optional
                                    and fused_parts(cfg.architecture, name) is None):
                                tied_head = name == "lm_head.weight" and cfg.tie_word_embeddings
                                if (not _IGNORED.search(name) and not other_stage(name) and not tied_head
                                        and not _mtp_tensor(name, cfg)):
                                    log.warning("ignoring checkpoint tensor %s: not used by %s", name, cfg.architecture)
                                continue
                            consume(name, f.get_tensor(stored))
                except (SafetensorError, OSError) as exc:  # truncated or corrupt download: name the file
                    raise ValueError(f"model: {path} is not a readable safetensors file ({exc})") from None
    missing = sorted(name for name in set(targets) - loaded if not getattr(targets[name][0], "optional", False))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        fmt = f" (quantization {quant_config.name})" if quant_config is not None else ""
        raise ValueError(f"model: checkpoint in {str(model_dir)!r} lacks weights{fmt}: {shown}")


def _split_rows(cfg: ModelConfig, name: str, parts: tuple[str, ...], tensor):
    """A fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) as its parts, by rows; a GGUF
    tensor kept quantized splits by rows the same way (its blocks run along rows)."""
    codes = getattr(tensor, "codes", tensor)
    shape = cfg.shape
    rows = fused_part_rows(name, codes.shape[0], shape.num_attention_heads, shape.num_kv_heads, shape.head_dim)
    if sum(rows) != codes.shape[0]:
        raise ValueError(f"weight {name}: checkpoint has {codes.shape[0]} rows, the config implies "
                         f"{' + '.join(map(str, rows))}")
    if fused_rows_per_head(cfg.architecture):  # [q_g...; k_g; v_g] per KV group g -> [q; k; v]
        order = torch.tensor(per_group_qkv_order(codes.shape[0], shape.num_attention_heads, shape.num_kv_heads))
        tensor = tensor.permute_rows(order) if hasattr(tensor, "permute_rows") else tensor.index_select(0, order)
    start = 0
    for part, n in zip(parts, rows):
        if hasattr(tensor, "permute_rows"):
            yield part, tensor.permute_rows(torch.arange(start, start + n))
        else:
            yield part, tensor.narrow(0, start, n)
        start += n
