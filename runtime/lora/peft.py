"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) read
into full-size float32 matrices and checked against the model before any of it is used.

Each target module gets A ``[r, in]`` and B ``[out, r]`` with PEFT's scaling (``lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with rsLoRA; per-module ``rank_pattern`` / ``alpha_pattern``) folded
into B, so applying it is ``x @ A.T @ B.T``, what PEFT computes unmerged. Matrices stay whole
here: each tensor-parallel rank slices its part when it copies them into its device slots.

The token embedding (``lora_embedding_A`` [r, vocab], ``lora_embedding_B`` [hidden, r]) and the LM
head are adapted too, as model-level modules (layer ``MODEL_LEVEL``). PEFT saves a copy of a
targeted embedding's or head's own weights beside them (``save_embedding_layers``): a copy of this
model's shape is the base weights and is skipped; another shape (a resized vocabulary) is refused.

BLOOM, Falcon and MPT name their modules as their checkpoints do (FAMILY_MODULES); an adapter's
paths are mapped onto the shared layout the same way the checkpoint's are.

Every problem is a ValueError naming it: a missing file, a rank above ``max_lora_rank``, a target
module the model lacks (or that kvserve cannot adapt: Gemma's scaled embedding, the MoE router),
shapes of another base model, PEFT features that change the math (DoRA, trained biases,
``modules_to_save``).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvserve.runtime.architectures import checkpoint_name, fused_rows_per_head, per_group_qkv_order
from kvserve.runtime.lora.moe import expert_module_layer, expert_pair
from kvserve.runtime.lora.request import LoRARequest

# PEFT's module names kvserve adapts, and where each lives in a decoder layer.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
VOCAB_MODULES = ("embed_tokens", "lm_head")
# Multi-head latent attention's own projections (DeepSeek V2/V3; runtime/lora/mla.py).
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# Checkpoints that fuse projections kvserve splits at load (Phi-3's qkv_proj and gate_up_proj,
# Baichuan's W_pack): PEFT adapts the fused module, one A and B over the parts' rows in this order.
# The parts' delta is B[rows of the part] @ A, so each part takes A whole and its rows of B.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "W_pack": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
# The LayerNorm families' own names (BLOOM and Falcon: transformer.h.N.self_attention.query_key_value
# / .dense, .mlp.dense_h_to_4h / .dense_4h_to_h; MPT: transformer.blocks.N.attn.Wqkv / .out_proj,
# .ffn.up_proj / .down_proj). An adapter's module paths are mapped onto the shared layout as the
# checkpoint's are (architectures.checkpoint_name): their q|k|v is then the fused qkv_proj, which
# BLOOM and Falcon store per KV group, so B's rows are put in q | k | v order first, as the loader
# does with the weights.
FAMILY_MODULES = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "Wqkv", "out_proj",
                  "word_embeddings", "wte")
_FAMILY_ARCHITECTURES = ("BloomForCausalLM", "FalconForCausalLM", "MptForCausalLM")
SUPPORTED_MODULES = (ATTENTION_MODULES + MLP_MODULES + VOCAB_MODULES + MLA_MODULES + tuple(FUSED_MODULES)
                     + FAMILY_MODULES)
# The layer index of the model-level modules (embedding, LM head) in Targets keys.
MODEL_LEVEL = -1

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")
_EMBED_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_embedding_(?P<ab>[AB])(?:\.[A-Za-z0-9_-]+)?$")
# (the embedding under the family's own name: transformer.word_embeddings, transformer.wte)
_BASE_COPY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.base_layer\.weight$")
_VOCAB_MODULE = {"model.embed_tokens": "embed_tokens", "lm_head": "lm_head"}
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<name>(?:shared_experts?\.)?[A-Za-z_]+)$")
# transformers' fused expert parameters, as PEFT's target_parameters name them (runtime/lora/moe.py).
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# (layer index, PEFT module name) -> (in_features, out_features) of the whole (unsharded) layer.
Targets = Mapping[tuple[int, str], tuple[int, int]]


@dataclass
class LoRAWeights:
    """One adapter, loaded: per (layer, module) the float32 A [r, in] and scaled B [out, r]."""

    request: LoRARequest
    rank: int  # the largest rank of any of its modules (its slot rows)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    # Set by the rank that loads it: its slot contents per wrapped layer (runtime/lora/worker.py).
    images: list | None = None

    @property
    def nbytes(self) -> int:
        pairs = self.images if self.images is not None else self.modules.values()
        return sum(t.numel() * t.element_size() for t in _tensors(pairs))


def _tensors(items):
    """Every tensor in nested tuples/lists (slot images: None where a part is not adapted)."""
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from _tensors(item)


def read_config(path: str) -> dict:
    """The adapter's adapter_config.json, checked for what kvserve can run."""
    if not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"lora_path: {path!r} has no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"lora_path: {cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"lora_path: {cfg_path} must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"adapter_config: peft_type {peft_type!r} is not supported (LORA only)")
    if cfg.get("use_dora"):
        raise ValueError("adapter_config: use_dora (DoRA) is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise ValueError(f"adapter_config: bias {cfg.get('bias')!r} is not supported (trained biases); use 'none'")
    if cfg.get("modules_to_save"):
        raise ValueError(f"adapter_config: modules_to_save {cfg['modules_to_save']!r} is not supported "
                         "(fully trained copies of modules, not LoRA; LoRA on embed_tokens and lm_head is: "
                         "list them in target_modules instead)")
    if cfg.get("fan_in_fan_out"):
        raise ValueError("adapter_config: fan_in_fan_out is not supported (Conv1D models)")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"adapter_config: {key} must be a positive number, got {value!r}")
    for t in cfg.get("target_parameters") or ():
        # PEFT also lists a target_modules name that is an expert parameter's (down_proj) here.
        if str(t).rsplit(".", 1)[-1] not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"adapter_config: target parameter {t!r} is not supported; kvserve adapts the "
                             f"routed experts' {' and '.join(EXPERT_PARAMETERS)}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            name = str(t).rsplit(".", 1)[-1]
            if name not in SUPPORTED_MODULES:
                raise ValueError(f"adapter_config: target module {t!r} is not supported; kvserve adapts "
                                 f"{', '.join(SUPPORTED_MODULES)}")
    return cfg


def _pattern_value(patterns: Mapping[str, float] | None, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name's suffix (as regex)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def check_base_model(cfg: dict, request: LoRARequest, model_dir: str, hf_config) -> None:
    """A base-model mismatch where it can be told from names: the request's base_model_name, or
    the adapter's base_model_name_or_path when that is a local model directory."""
    base = cfg.get("base_model_name_or_path")
    if not base or not isinstance(base, str):
        return
    if request.base_model_name is not None:
        # Compare the last path component: hub ids and local copies of one model share it.
        if os.path.basename(base.rstrip("/")) != os.path.basename(request.base_model_name.rstrip("/")):
            raise ValueError(f"base_model_name: the adapter was trained on {base!r}, "
                             f"not {request.base_model_name!r}")
    config_json = os.path.join(base, "config.json")
    if os.path.isfile(config_json) and os.path.realpath(base) != os.path.realpath(model_dir):
        try:
            with open(config_json, encoding="utf-8") as f:
                theirs = json.load(f)
        except (OSError, ValueError):
            return
        ours = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
            if key in theirs and key in ours and theirs[key] != ours[key]:
                raise ValueError(f"base model mismatch: the adapter's base model {base!r} has {key} "
                                 f"{theirs[key]!r}, this model {ours[key]!r}")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(file, device="cpu")
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: say which
            raise ValueError(f"lora_path: cannot read {file}: {type(exc).__name__}: {exc}") from None
    raise ValueError(f"lora_path: {path!r} has no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _fused_pairs(module: str, layer: int, parts: tuple[str, ...], a: torch.Tensor, b: torch.Tensor,
                 targets: Targets, max_lora_rank: int, only_targets: bool, cfg: dict, row_order=None) -> dict:
    """A fused module's pair as its parts' pairs: A whole for each, B's rows of each part.
    `row_order(rows)`: B's rows in the parts' order, when the checkpoint interleaves them."""
    shapes = [targets.get((layer, part)) for part in parts]
    if any(shape is None for shape in shapes):
        if only_targets:
            return {}  # another pipeline stage's layer
        raise ValueError(f"target module {module!r}: the model lacks it (this architecture's layer {layer} "
                         f"has no adaptable {' / '.join(parts)})")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"adapter weights: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                         "which do not form a LoRA pair")
    if a.shape[0] > max_lora_rank:
        raise ValueError(f"adapter rank: {module} has rank {a.shape[0]}, above max_lora_rank {max_lora_rank}")
    in_f, rows = shapes[0][0], [shape[1] for shape in shapes]
    if any(shape[0] != in_f for shape in shapes) or a.shape[1] != in_f or b.shape[0] != sum(rows):
        raise ValueError(f"base model mismatch: {module} expects [{sum(rows)} x {in_f}] (out x in), the adapter's "
                         f"lora_B x lora_A is [{b.shape[0]} x {a.shape[1]}] "
                         f"(trained on {cfg.get('base_model_name_or_path')!r}?)")
    if row_order is not None:
        b = b[torch.tensor(row_order(b.shape[0]))]
    return {part: (a, rows_b) for part, rows_b in zip(parts, torch.split(b, rows, dim=0))}


def _shared_name(module: str, arch: str) -> str:
    """An adapter's module path in the shared layout (model.layers.N.self_attn.qkv_proj, ...): the
    LayerNorm families' own paths mapped as their checkpoints' are. A ValueError when a family
    with its own names gets a path in another family's names (an adapter of another model)."""
    mapped = checkpoint_name(arch, module + ".")[:-1]
    if arch in _FAMILY_ARCHITECTURES and mapped == module and module != "lm_head":
        own = "transformer.blocks.N.attn / .ffn" if arch == "MptForCausalLM" else "transformer.h.N.self_attention / .mlp"
        raise ValueError(f"target module {module!r}: not a module of this {arch} model (its modules are "
                         f"{own}): an adapter of another architecture?")
    return mapped


def load_adapter(request: LoRARequest, *, targets: Targets, max_lora_rank: int, num_layers: int,
                 model_dir: str = "", hf_config=None, only_targets: bool = False,
                 model_config=None) -> LoRAWeights:
    """Reads and checks `request`'s adapter against the model's adaptable modules (`targets`).
    `only_targets`: `targets` are one pipeline stage's, and modules outside them belong to other
    stages: they are skipped, not refused (rank 0 has checked them against every stage's).
    `model_config` (the runtime's ModelConfig) names the architecture, whose own module names
    (BLOOM, Falcon, MPT) and fused q|k|v layout the adapter follows."""
    path = request.lora_path
    cfg = read_config(path)
    if hf_config is not None:
        check_base_model(cfg, request, model_dir, hf_config)
    tensors = _read_tensors(path)
    arch = getattr(model_config, "architecture", "") or ""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    base_copies: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key) or _EMBED_KEY.match(key)
        if m is None:
            copy = _BASE_COPY.match(key)
            shared = None if copy is None else checkpoint_name(arch, copy["module"] + ".")[:-1]
            if shared in _VOCAB_MODULE:
                base_copies[_VOCAB_MODULE[shared]] = tensor
                continue
            raise ValueError(f"adapter weights: tensor {key!r} is not a LoRA A/B matrix (trained biases and "
                             f"saved modules are not supported)")
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise ValueError(f"adapter weights: {path!r} holds no LoRA matrices")
    alpha_default = cfg.get("lora_alpha", cfg.get("r", 8))
    rslora = bool(cfg.get("use_rslora", False))
    row_order = None
    if fused_rows_per_head(arch):
        heads, kv_heads = model_config.shape.num_attention_heads, model_config.shape.num_kv_heads

        def row_order(rows: int) -> list[int]:
            return per_group_qkv_order(rows, heads, kv_heads)
    out = LoRAWeights(request, rank=0)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter weights: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        expert_layer = expert_module_layer(module)
        if expert_layer is not None:
            if expert_layer >= num_layers:
                raise ValueError(f"target module {module!r}: the model has {num_layers} layers (base model mismatch?)")
            found = expert_pair(module, expert_layer, ab["A"], ab["B"], targets, max_lora_rank=max_lora_rank,
                                only_targets=only_targets, scaling=lambda name, r: (
                                    _pattern_value(cfg.get("alpha_pattern"), name, alpha_default)
                                    / (math.sqrt(r) if rslora else r)))
            if found is not None:
                key, pair, rank = found
                if key in out.modules:
                    raise ValueError(f"adapter weights: two LoRA pairs of the shape of {key[1]} in layer {key[0]}")
                out.modules[key] = pair
                out.rank = max(out.rank, rank)
            continue
        shared = _shared_name(module, arch)
        m = _LAYER_MODULE.match(shared)
        name = shared.rsplit(".", 1)[-1] if m is None else m["name"]
        if shared in _VOCAB_MODULE:
            layer, name = MODEL_LEVEL, _VOCAB_MODULE[shared]
        elif m is None or name.rsplit(".", 1)[-1] not in SUPPORTED_MODULES:
            raise ValueError(f"target module {module!r}: not supported by kvserve's LoRA (it adapts the decoder "
                             f"layers' self_attn q/k/v/o_proj (MLA: q_proj or q_a/q_b_proj, kv_a_proj_with_mqa, "
                             f"kv_b_proj, o_proj), mlp gate/up/down_proj (dense, or MoE shared experts), the "
                             f"routed experts' fused parameters, model.embed_tokens and lm_head; BLOOM and "
                             f"Falcon: self_attention.query_key_value / dense, mlp.dense_h_to_4h / dense_4h_to_h, "
                             f"word_embeddings; MPT: attn.Wqkv / out_proj, ffn.up_proj / down_proj, wte)")
        else:
            layer = int(m["layer"])
            if layer >= num_layers:
                raise ValueError(f"target module {module!r}: the model has {num_layers} layers (base model mismatch?)")
        a, b = ab["A"], ab["B"]
        if a.dim() == 2 and a.shape[0] > max_lora_rank:
            raise ValueError(f"adapter rank: {module} has rank {a.shape[0]}, above max_lora_rank {max_lora_rank}")
        if name in FUSED_MODULES:
            pairs_out = _fused_pairs(module, layer, FUSED_MODULES[name], a, b, targets, max_lora_rank, only_targets,
                                     cfg, row_order=row_order if name == "qkv_proj" else None)
            for part, (pa, pb) in pairs_out.items():
                alpha = _pattern_value(cfg.get("alpha_pattern"), module, alpha_default)
                scaling = alpha / math.sqrt(pa.shape[0]) if rslora else alpha / pa.shape[0]
                out.modules[(layer, part)] = (pa.float().contiguous(), (pb.float() * scaling).contiguous())
                out.rank = max(out.rank, pa.shape[0])
            continue
        shape = targets.get((layer, name))
        if shape is None and only_targets:
            continue  # another pipeline stage's module
        if shape is None:
            if layer == MODEL_LEVEL:
                why = " (Gemma's scaled embedding is not supported)" if name == "embed_tokens" else ""
                raise ValueError(f"target module {module!r}: this model's {name} cannot take LoRA{why}")
            raise ValueError(f"target module {module!r}: the model lacks it (this architecture's layer {layer} "
                             f"has no adaptable {name})")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter weights: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             "which do not form a LoRA pair")
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise ValueError(f"adapter rank: {module} has rank {rank}, above max_lora_rank {max_lora_rank}")
        in_f, out_f = shape
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise ValueError(f"base model mismatch: {module} expects [{out_f} x {in_f}] (out x in), the adapter's "
                             f"lora_B x lora_A is [{b.shape[0]} x {a.shape[1]}] "
                             f"(trained on {cfg.get('base_model_name_or_path')!r}?)")
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, alpha_default)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        out.modules[(layer, name)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
        out.rank = max(out.rank, rank)
    for name, weight in base_copies.items():
        shape = targets.get((MODEL_LEVEL, name))
        if shape is None:
            continue  # not adapted here (another stage's, or refused above)
        want = shape if name == "embed_tokens" else shape[::-1]  # [vocab, hidden] either way
        if tuple(weight.shape) != tuple(want):
            raise ValueError(f"base model mismatch: the adapter saves {name} of shape {tuple(weight.shape)}, this "
                             f"model's is {tuple(want)} (a resized vocabulary is not supported)")
    return out
